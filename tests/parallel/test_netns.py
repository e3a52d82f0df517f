"""One EP world over two real "hosts" (network namespaces joined by a veth pair, tests/netns_harness.py)
whose hostnames resolve to loopback: every rank binds the store, gloo and NCCL to the interface that
routes to the master address, so the world starts and serves the same text as one process; a host
whose master cannot be reached fails start-up in one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from epserve import LLM, SamplingParams
from tests.netns_harness import Host, NsProc, ns_proc, two_hosts
from tests.serve_harness import wait_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256"]
PROMPT = "Expert parallelism"
CLIENT = """
import json, sys, time, httpx
url, prompt = sys.argv[1], sys.argv[2]
deadline = time.monotonic() + 60
while True:
    try:
        if httpx.get(url + "/health", timeout=5).status_code == 200:
            break
    except httpx.HTTPError:
        pass
    assert time.monotonic() < deadline, "the router never became healthy"
    time.sleep(0.1)
texts = []
for _ in range(2):  # round robin: once on each host's instance
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    texts.append(r.json()["choices"][0]["text"])
print("TEXTS " + json.dumps(texts))
"""


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as pair:
        yield pair


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")




def _engine(host: Host, rank: int, master: Host, ckpt: Path, port: int, log: Path, *extra: str) -> NsProc:
    return ns_proc(host, ["engine", str(ckpt), *ENGINE_ARGS, "--dp", "2", "--nnodes", "2", "--node-rank", str(rank),
                          "--master-addr", master.address, "--master-port", "29500", "--engine-host", host.address,
                          "--engine-port", str(port), "--engine-token", "t0ken", *extra], log)


def test_a_world_across_two_namespaces_serves_the_text_of_one_process(hosts, ckpt, tmp_path):
    a, b = hosts
    port = 50051
    started = time.monotonic()
    nodes = [_engine(h, i, a, ckpt, port, tmp_path / f"node{i}.log") for i, h in enumerate(hosts)]
    procs = list(nodes)
    try:
        for i, (node, host) in enumerate(zip(nodes, hosts)):
            wait_output(node, f"engine instance {i} listening on {host.address}:{port + i}", 60)
        print(f"two-namespace world started in {time.monotonic() - started:.1f} s")
        router = ns_proc(a, ["router", str(ckpt), "--port", "8000", "--policy", "round_robin", "--engine-token",
                             "t0ken", "--engine", f"{a.address}:{port}", "--engine", f"{b.address}:{port + 1}"],
                         tmp_path / "router.log")
        procs.append(router)
        client = ns_proc(a, ["-c", CLIENT, "http://127.0.0.1:8000", PROMPT], tmp_path / "client.log", module=False)
        procs.append(client)
        assert client.wait(60) == 0, client.output()[-3000:] + router.output()[-2000:]
        [line] = [x for x in client.output().splitlines() if x.startswith("TEXTS ")]
        want = LLM(ckpt, dtype="float32", num_blocks=64).generate(
            [PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
        assert json.loads(line[len("TEXTS "):]) == [want, want]
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.kill_all()


def test_an_unreachable_master_fails_start_up_in_one_line(hosts, ckpt, tmp_path):
    """Host B alone: nobody listens at host A's store. It exits within the rendezvous timeout, its last
    line naming the address, the port, and where it tried from."""
    a, b = hosts
    node = _engine(b, 1, a, ckpt, 50061, tmp_path / "lonely.log", "--rendezvous-timeout", "2")
    try:
        code = node.wait(60)
    finally:
        if node.proc.poll() is None:
            node.kill_all()
    out = node.output()
    assert code != 0, out
    errors = [x for x in out.splitlines() if "epserve: error:" in x]
    assert len(errors) == 1, out
    assert (f"cannot reach the rendezvous at {a.address}:29500 within 2 s (from {b.address}, interface "
            f"{b.interface})") in errors[0], out
    assert "Traceback" not in out and "Gloo" not in out, out
