"""Prefill/decode disaggregation across real processes (loopback): two prefill instances (``epserve
engine --role prefill``, and a ``both`` one that also serves plain requests: the colocated server),
a decode world of two instances (``--role decode --dp 2``) and ``epserve router --prefill ... --decode
...``. Greedy text equals the colocated instance's and the offline engine's; bytes moved are blocks x
block bytes, fewer when the decode instance holds a prefix; an abort during a transfer frees blocks on
both sides; a stalled transfer times out and a killed prefill instance is retried on the other one;
each token's logprobs are its own; a malformed reply from a (fake) prefill instance fails that request
alone, and a router retries it on a real one."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import engine_channel
from tests.prefill_toys import MALFORMED, serve_fake_prefill
from tests.serve_harness import Proc, metric, named, wait_http_ok

pytestmark = pytest.mark.slow

TOKEN = "disagg-token"
ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256", "--engine-token", TOKEN]
KV_TIMEOUT = 4.0
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class Deployment:
    def __init__(self, ckpt: Path, tmp: Path) -> None:
        p0, p1, d, http = (free_port() for _ in range(4))
        self.ports = [p0, p1, d, d + 1, http]  # prefill 0, prefill/both 1, decode 2 and 3 (one world), http
        self.procs = [
            Proc(["engine", str(ckpt), *ENGINE_ARGS, "--role", "prefill", "--engine-port", str(p0)], tmp / "p0.log"),
            Proc(["engine", str(ckpt), *ENGINE_ARGS, "--engine-port", str(p1)], tmp / "p1.log"),
            Proc(["engine", str(ckpt), *ENGINE_ARGS, "--role", "decode", "--dp", "2", "--engine-port", str(d),
                  "--kv-transfer-timeout", str(KV_TIMEOUT)], tmp / "d.log"),
        ]
        self.prefill, self.both, self.decode = self.procs
        self.router = Proc(["router", str(ckpt), "--port", str(http), "--engine-token", TOKEN, "--engine-wait-timeout",
                            "20", "--prefill", f"127.0.0.1:{p0}", "--prefill", f"127.0.0.1:{p1}",
                            "--decode", f"127.0.0.1:{d}", "--decode", f"127.0.0.1:{d + 1}"], tmp / "router.log")
        self.procs.append(self.router)
        self.url = f"http://127.0.0.1:{http}"
        try:
            wait_http_ok(f"{self.url}/health", self.router)
            self.stubs = [pb_grpc.EngineStub(engine_channel(f"127.0.0.1:{p}", TOKEN)) for p in self.ports[:4]]
            for i in range(4):  # /health is ok with one prefill and one decode instance up
                self.wait_healthy(i, timeout=120)
        except BaseException:  # leave nothing running
            self.close()
            raise

    def load(self, index: int) -> pb.GetLoadResponse:
        return self.stubs[index].GetLoad(pb.GetLoadRequest(), timeout=5)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def complete(self, prompt: list[int], max_tokens: int = 8) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})

    def rank_of(self, proc: Proc) -> int:
        return named(proc.pid, ["epserve-p-rank0"])[0]

    def wait_healthy(self, index: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while metric(self.metrics(), "epserve:engine_healthy", engine=str(index)) != 1:
            assert time.monotonic() < deadline, f"instance {index} not healthy again"
            time.sleep(0.2)

    def wait_free(self, index: int, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while (load := self.load(index)).kv_blocks_used or load.num_running or load.num_receiving:
            assert time.monotonic() < deadline, f"instance {index} still holds blocks: {load}"
            time.sleep(0.1)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill_all()


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")


@pytest.fixture(scope="module")
def deployment(ckpt, tmp_path_factory):
    dep = Deployment(ckpt, tmp_path_factory.mktemp("disagg"))
    yield dep
    dep.close()


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, dtype="float32", num_blocks=64, max_model_len=256)


PROMPTS = [list(range(5, 45)), list(range(5, 45)) + [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [300, 301, 302]]


def test_greedy_text_equals_colocated_and_offline(deployment, offline):
    want = offline.generate(PROMPTS, GREEDY)
    # The colocated server: the `both` instance serving a plain request itself.
    colocated = deployment.stubs[1].Generate(pb.GenerateRequest(
        request_id="colocated", prompt_token_ids=PROMPTS[0],
        sampling_params=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    assert [t for msg in colocated for t in msg.token_ids] == want[0].token_ids
    before = deployment.metrics()
    layout = deployment.stubs[2].GetInfo(pb.GetInfoRequest()).kv_layout
    block_bytes = layout.num_layers * layout.block_size * layout.token_bytes
    for prompt, out in zip(PROMPTS, want):
        r = deployment.complete(prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == out.text
        deployment.metrics()  # the router refreshes the loads: both decode instances idle again
    after = deployment.metrics()

    def moved(direction: str) -> float:
        return (metric(after, "epserve:kv_transfer_bytes_total", direction=direction)
                - metric(before, "epserve:kv_transfer_bytes_total", direction=direction))

    # Idle decode instances: each request goes to the first, which holds the first prompt's 2 full blocks
    # (of 40 tokens) when the second (50 tokens, 4 blocks) arrives: 3 + 2 + 1 blocks move, not 3 + 4 + 1.
    assert moved("received") == moved("sent") == (3 + 2 + 1) * block_bytes
    assert metric(after, "epserve:router_requests_total", role="decode", engine="2") >= 3
    assert metric(after, "epserve:kv_transfer_seconds_count", role="decode") >= 3
    for i in range(4):
        deployment.wait_free(i)


def test_router_routes_nothing_to_an_instance_in_the_wrong_role(deployment):
    import asyncio

    from epserve.router.instances import Router
    from epserve.router.policy import make_policy

    async def states():
        router = Router((), make_policy("least_load"), token=TOKEN, prefill=[f"127.0.0.1:{deployment.ports[2]}"],
                        decode=[f"127.0.0.1:{deployment.ports[0]}"])
        await router.start()
        try:
            return [inst.last_error for inst in router.instances if not inst.healthy], router.serving
        finally:
            await router.close()

    errors, serving = asyncio.run(states())
    assert not serving
    assert errors == ["the engine's role is decode; the router uses it as prefill",
                      "the engine's role is prefill; the router uses it as decode"]


def test_bench_serve_shows_each_role(deployment, capsys):
    from epserve.cli import main

    assert main(["bench", "serve", "--base-url", deployment.url, "--num-prompts", "4", "--random-input-len", "20",
                 "--random-output-len", "4", "--disable-tqdm"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[out.splitlines().index(
        next(line for line in out.splitlines() if line.startswith("Per role"))) + 2:] if line.strip()}
    assert set(rows) == {"prefill", "decode"}, out
    assert int(rows["prefill"][2]) == int(rows["decode"][2]) == 4  # requests per role
    assert float(rows["prefill"][3]) == float(rows["decode"][4]) > 0  # KV MiB out of prefill = into decode
    assert rows["prefill"][-1] == "-/-" and rows["decode"][-2] == "-/-"  # TTFT on prefill, ITL on decode


def test_abort_during_transfer_frees_blocks_on_both_sides(deployment):
    rank = deployment.rank_of(deployment.prefill)
    os.kill(rank, signal.SIGSTOP)  # the prefill instance (the idle router's first choice) hangs mid-transfer
    body = json.dumps({"prompt": list(range(60, 100)), "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    try:
        with socket.create_connection(("127.0.0.1", deployment.ports[4])) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            deadline = time.monotonic() + 10
            while not (waiting := [i for i in (2, 3) if deployment.load(i).num_receiving]):
                assert time.monotonic() < deadline, "no decode instance waited for KV"
                time.sleep(0.05)
            assert deployment.load(waiting[0]).kv_blocks_used == 3  # allocated before the transfer
        # The client went away: the router cancels the request, the decode side frees its blocks at once.
        deployment.wait_free(waiting[0])
    finally:
        os.kill(rank, signal.SIGCONT)
    deployment.wait_free(0)  # and the prefill side, once it ran again and saw its call cancelled
    deployment.wait_healthy(0)


def test_stalled_transfer_times_out_and_killed_prefill_is_retried(deployment, offline):
    want = offline.generate([list(range(110, 140)), list(range(150, 190))], GREEDY)
    failures = metric(deployment.metrics(), "epserve:kv_transfer_failures_total")
    rank = deployment.rank_of(deployment.prefill)
    os.kill(rank, signal.SIGSTOP)  # stalls: the decode instance gives up after its transfer timeout
    try:
        start = time.monotonic()
        r = deployment.complete(list(range(110, 140)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].text  # retried on the other prefill instance
        assert time.monotonic() - start >= KV_TIMEOUT
        deployment.wait_free(2)
    finally:
        os.kill(rank, signal.SIGCONT)
    deployment.wait_free(0)  # the stalled prefill freed its blocks once it ran again
    assert metric(deployment.metrics(), "epserve:kv_transfer_failures_total") == failures + 1
    deployment.wait_healthy(0)

    os.kill(rank, signal.SIGSTOP)

    killed_at: list[float] = []

    def kill_with_the_request_on_it() -> None:  # once a decode instance waits for the stopped one's KV
        deadline = time.monotonic() + 10  # (not after a fixed delay: the request is there by then)
        while not any(deployment.load(i).num_receiving for i in (2, 3)) and time.monotonic() < deadline:
            time.sleep(0.02)
        killed_at.append(time.monotonic())  # (the decode instance's transfer timeout started before this)
        os.kill(rank, signal.SIGKILL)

    with httpx.Client(timeout=60) as client:
        killer = threading.Thread(target=kill_with_the_request_on_it)
        killer.start()
        r = client.post(f"{deployment.url}/v1/completions", json={
            "prompt": list(range(150, 190)), "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        killer.join(30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[1].text
        # the failure, not the timeout, sent it elsewhere: the timeout would have answered no sooner than
        # KV_TIMEOUT after the kill, less the 20 ms poll (counted from the kill: the wait for the request to
        # reach a decode instance is not the failover's)
        assert killed_at and time.monotonic() - killed_at[0] < KV_TIMEOUT - 0.1
    m = deployment.metrics()
    assert metric(m, "epserve:kv_transfer_failures_total") == failures + 2
    assert metric(m, "epserve:router_requests_total", role="prefill", engine="1") >= 2


def test_serve_disaggregate_on_one_host_and_a_dead_decode_rank(ckpt, offline, tmp_path):
    """`epserve serve --disaggregate`: a prefill world and a decode world of TP 2 (the arrived KV written
    on both of its ranks) behind the router on one host; the same text as one engine. The decode rank killed
    mid-stream: the stream ends with an error event, its world is restarted, and the next request is served;
    SIGTERM then stops everything (exit 0)."""
    http = free_port()
    server = Proc(["serve", str(ckpt), *ENGINE_ARGS[:-2], "--disaggregate", "--prefill-dp", "1", "--decode-tp", "2",
                   "--port", str(http), "--step-timeout", "3"], tmp_path / "serve.log")
    url = f"http://127.0.0.1:{http}"
    try:
        wait_http_ok(f"{url}/health", server)
        want = offline.generate([PROMPTS[2]], GREEDY)[0].text
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        decode_rank = named(server.pid, ["epserve-d-rank0"])[0]
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            os.kill(decode_rank, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data:")]
        assert any('"error"' in line for line in rest), rest[-3:]
        deadline = time.monotonic() + 60
        while True:  # the supervisor restarts the decode world; requests wait for it
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        assert "engine group failed" in server.output()
        server.signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        server.kill_all()


# ---- issue 25: what a decode instance gets from its prefill peer -----------------------------------
def test_disaggregated_logprobs_are_each_tokens_own(deployment, offline):
    """The first token's logprob and top logprobs are its own (they were the second token's: both come
    in the step the KV arrives in): per token those of the colocated instance and of the offline engine,
    through the decode instance's stream and through the router's completions."""
    prompt = PROMPTS[0]
    want = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))[0]
    sampling = pb.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)

    def streamed(stub: pb_grpc.EngineStub, rid: str, prefill_address: str = "") -> tuple[list, list]:
        msgs = list(stub.Generate(pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sampling,
                                                     prefill_address=prefill_address), timeout=60))
        return ([t for m in msgs for t in m.token_ids],
                [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for m in msgs for lp in m.logprobs])

    colocated = streamed(deployment.stubs[1], "logprobs-colocated")
    disaggregated = streamed(deployment.stubs[2], "logprobs-disaggregated", f"127.0.0.1:{deployment.ports[1]}")
    for tokens, logprobs in (colocated, disaggregated):
        assert tokens == want.token_ids
        assert len(logprobs) == len(want.logprobs)
        for (lp, top), expected in zip(logprobs, want.logprobs):
            assert lp == pytest.approx(expected.logprob, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in expected.top]
            assert [v for _, v in top] == pytest.approx([v for _, v in expected.top], abs=1e-4)

    r = httpx.post(f"{deployment.url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]

    def text(token: int) -> str:
        return offline.tokenizer.decode([token], skip_special_tokens=False)

    def top_by_text(top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        out: dict[str, float] = {}  # (two ids of one text, a byte of a character, say: the likelier counts)
        for token, value in top:
            out[text(token)] = max(value, out.get(text(token), value))
        return out

    assert got["tokens"] == [text(t) for t in want.token_ids]
    assert got["token_logprobs"] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert got["top_logprobs"] == [pytest.approx(top_by_text(lp.top), abs=1e-4) for lp in want.logprobs]
    deployment.wait_free(2)


@pytest.fixture(scope="module")
def fake_prefill(deployment):
    vocab = deployment.stubs[2].GetInfo(pb.GetInfoRequest(), timeout=10).vocab_size
    fake, address, server = serve_fake_prefill(deployment.stubs[1], vocab, TOKEN)
    yield fake, address
    server.stop(0)


@pytest.mark.parametrize("mode", MALFORMED)
def test_a_malformed_prefill_reply_fails_that_request_not_the_decode_instance(deployment, offline, fake_prefill,
                                                                              mode):
    """A decode instance checks what its prefill peer sends like a client's input: a malformed reply
    (an out-of-vocabulary first token used to kill the decode world in its step loop, and four such
    calls spent its restarts) fails that request alone, as a failed KV transfer (ABORTED, which a
    router retries elsewhere), and the instance serves on: the same rank processes, no restart."""
    fake, address = fake_prefill
    fake.mode = mode
    ranks = named(deployment.decode.pid, ["epserve-d-rank0", "epserve-d-rank1"])
    before, calls, k = deployment.load(2), fake.calls, MALFORMED[mode]
    sampling = pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    if k is not None:
        sampling.logprobs = k
    with pytest.raises(grpc.RpcError) as failed:
        list(deployment.stubs[2].Generate(pb.GenerateRequest(
            request_id=f"malformed-{mode}", prompt_token_ids=PROMPTS[2], sampling_params=sampling,
            prefill_address=address), timeout=30))
    assert fake.calls == calls + 1
    assert failed.value.code() == grpc.StatusCode.ABORTED, failed.value.details()
    assert "malformed" in failed.value.details()
    deployment.wait_free(2)  # its blocks freed
    load = deployment.load(2)
    assert (load.restarts, load.stalled, load.draining) == (before.restarts, False, False)
    assert named(deployment.decode.pid, ["epserve-d-rank0", "epserve-d-rank1"]) == ranks
    r = deployment.complete(PROMPTS[2])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == offline.generate([PROMPTS[2]], GREEDY)[0].text


def test_router_retries_a_malformed_prefill_reply_on_another_instance(deployment, offline, fake_prefill, ckpt,
                                                                      tmp_path):
    """Behind a router (least load: an idle router tries the first prefill instance listed, the fake),
    the decode instance's failed transfer sends the request to the real prefill instance: the client
    gets the offline engine's text."""
    fake, address = fake_prefill
    fake.mode = "first_token_out_of_vocab"
    http, d = free_port(), deployment.ports[2]
    router = Proc(["router", str(ckpt), "--port", str(http), "--engine-token", TOKEN, "--policy", "least_load",
                   "--engine-wait-timeout", "20", "--prefill", address,
                   "--prefill", f"127.0.0.1:{deployment.ports[1]}",
                   "--decode", f"127.0.0.1:{d}", "--decode", f"127.0.0.1:{d + 1}"], tmp_path / "router.log")
    url = f"http://127.0.0.1:{http}"
    try:
        wait_http_ok(f"{url}/health", router)
        deadline = time.monotonic() + 30
        while not all(metric(httpx.get(f"{url}/metrics", timeout=30).text, "epserve:engine_healthy",
                             engine=str(i)) == 1 for i in range(4)):
            assert time.monotonic() < deadline, router.output()[-3000:]
            time.sleep(0.2)
        calls = fake.calls
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline.generate([PROMPTS[2]], GREEDY)[0].text
        assert fake.calls == calls + 1  # tried first, then the real one
        m = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric(m, "epserve:router_requests_total", role="prefill", engine="1") == 1
    finally:
        router.kill_all()
    deployment.wait_free(2)
