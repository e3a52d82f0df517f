"""End to end: ``epserve serve --dp 2`` (two engine instances behind the router) driven by the official
``openai`` client and by raw HTTP: completions and chat, streamed and not, the bad-input matrix, a
dropped stream freeing its KV blocks, prefix-aware routing, metrics, and a clean shutdown."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from tests import serve_harness as harness
from tests.serve_harness import Proc, alive, metric, parse_metrics, wait_http_ok

pytestmark = pytest.mark.slow

API_KEY = "sk-test"
MODEL = "tiny"
MAX_MODEL_LEN = 1024
ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN)]


class Server:
    def __init__(self, proc: Proc, url: str) -> None:
        self.proc, self.url = proc, url
        self.ranks = proc.ranks(2)  # the rank processes' pids, rank 0 first
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)

    def wait_until_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Metrics once no request runs and no KV block is in use (asserted after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m["epserve:num_requests_running"] == 0 and m["epserve:kv_cache_usage_perc"] == 0
            if idle or time.monotonic() > deadline:
                assert idle, m
                return m
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """Each sample name summed over its labels."""
        out: dict[str, float] = {}
        for name, _, value in parse_metrics(self.http.get("/metrics").text):
            out[name] = out.get(name, 0.0) + value
        return out


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc = Proc(["serve", str(ckpt), "--dp", "2", "--port", str(port), "--served-model-name", MODEL,
                 "--api-key", API_KEY, *ENGINE_ARGS], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        proc.remember_descendants()
        yield Server(proc, url)
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, dtype="float32", num_blocks=128, max_model_len=MAX_MODEL_LEN)


def test_completion_matches_offline_engine(server, offline):
    prompt = "The quick brown fox"
    want = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    for _ in range(2):  # whichever instance serves it, the same greedy answer
        out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert out.choices[0].text == want.text
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(want.prompt_token_ids)
        assert out.usage.completion_tokens == 12
        assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_completion_equals_whole_one(server):
    kw = dict(model=MODEL, prompt=[5, 17, 99, 230], max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = server.client.completions.create(**kw)
    chunks = list(server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_and_not(server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 8
    stream = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_seed_logprobs_and_batched_prompts(server):
    out = server.client.completions.create(model=MODEL, prompt=["Hello there", "General Kenobi"], n=2, max_tokens=5,
                                           temperature=1.0, seed=1234, logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    again = server.client.completions.create(model=MODEL, prompt=["Hello there", "General Kenobi"], n=2, max_tokens=5,
                                             temperature=1.0, seed=1234, logprobs=3, extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded: reproducible
    for c in out.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert all(len(top) <= 3 for top in lp.top_logprobs)
        assert all(v <= 0 for v in lp.token_logprobs)
    assert out.usage.completion_tokens == 20
    chat = server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                 extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_stop_string_cuts_the_text(server):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = server.client.completions.create(**kw).choices[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 2)
                if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2])
    cut = full[: full.index(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(server.client.completions.create(**kw, stop=[stop], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            choice = server.client.completions.create(**kw, stop=[stop]).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert text == cut
        assert reason == "stop"


BAD = [
    # (body or raw bytes, status, param/code hint)
    (b'{"model": "tiny", "prompt": ', 400, "invalid_json"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": 12}, 400, "prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "model_not_found"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": []}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1] * MAX_MODEL_LEN}, 400, "context_length_exceeded"),
    ({"model": "tiny", "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "context_length_exceeded"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "top_k": -5}, 400, "top_k"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"model": "tiny", "prompt": [1, 2, 100000]}, 400, "vocabulary"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    # what the engine's gRPC fields cannot hold, lone surrogates, deep nesting: 400, never 500
    ({"model": "tiny", "prompt": "x", "top_k": 2**31}, 400, "top_k"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [2**32]}, 400, "stop_token_ids"),
    ({"model": "tiny", "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 2**32}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "logprobs": 2**32}, 400, "logprobs"),
    (b'{"model": "tiny", "prompt": "a\\ud800"}', 400, "invalid_unicode"),
    (b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', 400, '"prompt[1]"'),
    (b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800"]}', 400, '"stop[0]"'),
    (b'{"model": "tiny", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "invalid_json"),
    (b'{"model": "tiny", "prompt": "x", "extra": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "invalid_json"),
    ({"model": "tiny", "prompt": ["x"] * 257}, 400, "too_many_choices"),
    ({"model": "tiny", "prompt": "word " * 40_000}, 400, "context_length_exceeded"),  # refused untokenized
]


@pytest.mark.parametrize("body,status,hint", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_completion_requests(server, body, status, hint):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = server.http.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    assert hint in json.dumps(err), err


@pytest.mark.parametrize("body,hint", [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', '"messages[0].content"'),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "content[0].text"),
    ({"model": "tiny", "messages": []}, "messages"),
    ({"model": "tiny", "messages": "hello"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10_000},
     "context_length_exceeded"),
])
def test_bad_chat_requests(server, body, hint):
    r = server.http.post("/v1/chat/completions", content=body if isinstance(body, bytes) else json.dumps(body))
    assert r.status_code == 400, r.text
    assert hint in json.dumps(r.json()["error"])


def test_bad_input_keeps_the_connection(server):
    """A 400 for inputs that once were 500s is an answer like any other: the connection stays open."""
    with httpx.Client(base_url=server.url, headers=server.http.headers) as client:
        addresses = set()
        for body, status, _ in [*BAD[-8:], ({"model": MODEL, "prompt": "still here", "max_tokens": 2}, 200, "")]:
            r = client.post("/v1/completions", content=body if isinstance(body, bytes) else json.dumps(body))
            assert r.status_code == status, r.text
            addresses.add(r.extensions["network_stream"].get_extra_info("client_addr"))
        assert len(addresses) == 1


def test_health_and_models_show_no_internal_details(server, ckpt):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "num_engines": 2, "num_healthy_engines": 2}
    r = server.http.get("/v1/models")
    assert r.json()["data"][0]["root"] == MODEL and str(ckpt) not in r.text


def test_api_key_and_openai_errors(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics need no key
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=5)
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_dropped_stream_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": list(range(40, 140)), "max_tokens": MAX_MODEL_LEN - 101, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with harness.HeldInstance(server.proc, server.url, wait_cancel=True) as held, server.http.stream(
            "POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: an iterator dropped early would close the connection
        next(i for i, line in enumerate(line for line in lines if line.startswith("data: {")) if i == 2)
        held.start()  # by construction, not by racing the engine: no token comes from here on
        m = server.metrics()
        assert m["epserve:num_requests_running"] == 1
        assert m["epserve:kv_cache_usage_perc"] > 0
    # the connection is closed mid-stream: the engine must abort the request and free its KV blocks
    m = server.wait_until_idle()
    assert m["epserve:request_success_total"] >= 1


def test_disconnected_client_aborts_a_whole_response(server):
    """Not streamed: the client gives up (its timeout closes the connection); the router notices and
    aborts the engine request instead of generating 900 tokens nobody reads."""
    aborted = server.metrics().get("epserve:request_success_total", 0.0)
    body = {"model": MODEL, "prompt": list(range(40, 140)), "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with harness.frozen_when(server.ranks, harness.first_token(server.url)), pytest.raises(httpx.ReadTimeout):
        server.http.post("/v1/completions", json=body, timeout=1.0)  # held open (frozen) until it gives up
    m = server.wait_until_idle()
    text = server.http.get("/metrics").text
    assert metric(text, "epserve:request_success_total", finished_reason="abort") >= 1
    assert m["epserve:request_success_total"] == aborted + 1


def test_mixed_load_with_dropped_clients_leaks_nothing(server):
    """Many concurrent requests of every kind (n, stop strings, logprobs, streamed or not), a part of
    them abandoned mid-stream or by a short client timeout: afterwards no request runs and no KV block
    is in use on either instance, and the server still answers."""
    rng = random.Random(7)

    async def one(client: httpx.AsyncClient) -> str:
        body = {"model": MODEL, "prompt": [rng.randrange(512) for _ in range(rng.randrange(1, 300))],
                "max_tokens": rng.randrange(1, 200), "n": rng.choice([1, 1, 2, 3]), "temperature": rng.random(),
                "stop": rng.choice([None, ["a"], ["the", "e "]]), "logprobs": rng.choice([None, 0, 3]),
                "ignore_eos": True, "stream": rng.random() < 0.7}
        drop_after = rng.choice([None, None, 1, 3, 10])
        try:
            if body["stream"]:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    lines = 0
                    async for _ in r.aiter_lines():
                        lines += 1
                        if drop_after is not None and lines >= drop_after:
                            return "dropped"
                    return str(r.status_code)
            r = await client.post("/v1/completions", json=body, timeout=0.3 if drop_after else 60)
            return str(r.status_code)
        except httpx.TimeoutException:
            return "timed out"

    async def run() -> list[str]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(80)))

    outcomes = asyncio.run(run())
    assert set(outcomes) <= {"200", "dropped", "timed out"}, outcomes
    assert outcomes.count("dropped") >= 10 and outcomes.count("200") >= 10
    server.wait_until_idle()
    out = server.client.completions.create(model=MODEL, prompt="still here", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_cache_aware_routing_reuses_prefixes(server):
    """Each group's second prompt goes where its first one went, so its shared prefix is cached."""
    for g in range(4):
        system = [(37 * g + 11 * k) % 500 + 3 for k in range(96)]  # 6 full blocks, different per group
        cached = []
        for q in range(2):
            out = server.client.completions.create(model=MODEL, prompt=system + [q + 1, g + 2], max_tokens=2,
                                                   temperature=0, extra_body={"ignore_eos": True})
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
        assert cached[0] == 0 and cached[1] >= 96, (g, cached)
    text = server.http.get("/metrics").text
    assert metric(text, "epserve:router_decisions_total", decision="cache_hit") >= 4


def test_metrics_are_exported(server):
    server.client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, temperature=0)
    m = server.metrics()
    for name in ["epserve:num_requests_running", "epserve:num_requests_waiting", "epserve:kv_cache_usage_perc",
                 "epserve:prefix_cache_queries_total", "epserve:prefix_cache_hits_total",
                 "epserve:prompt_tokens_total", "epserve:generation_tokens_total",
                 "epserve:time_to_first_token_seconds_count", "epserve:inter_token_latency_seconds_count",
                 "epserve:e2e_request_latency_seconds_count", "epserve:expert_load_imbalance",
                 "epserve:engine_load", "epserve:engine_healthy", "epserve:request_prompt_tokens_count"]:
        assert name in m, name
    assert m["epserve:engine_healthy"] == 2 == m["epserve:cache_config_info"]  # and vLLM's request histograms
    assert 0 < m["epserve:request_inference_time_seconds_count"] <= m["epserve:request_queue_time_seconds_count"]
    # (choices a stop string ended count only their queue and prefill time: no decode time from the engine)
    assert m["epserve:request_inference_time_seconds_sum"] <= 1e-6 + m["epserve:request_prefill_time_seconds_sum"] \
        + m["epserve:request_decode_time_seconds_sum"]
    assert m["epserve:iteration_tokens_total_sum"] >= m["epserve:generation_tokens_total"] > 0
    assert m["epserve:prompt_tokens_total"] > 0 and m["epserve:time_to_first_token_seconds_count"] > 0
    assert m["epserve:prefix_cache_hits_total"] <= m["epserve:prefix_cache_queries_total"]
    assert m["epserve:expert_load_imbalance"] >= 2.0  # two instances, each >= 1.0


def test_bench_client_against_the_server(server, tmp_path):
    out = tmp_path / "bench.json"
    from epserve.cli import main

    assert main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--dataset", "shared-prefix",
                 "--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len", "48", "--question-len", "8",
                 "--output-len", "4", "--max-concurrency", "2", "--json", str(out), "--disable-tqdm"]) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["cache_hit_rate"] > 0


def test_idle_server_does_not_spin(server):
    """With no requests, the ranks sleep on the doorbell and the router only polls loads once a second."""
    time.sleep(1.0)
    pids = sorted(server.proc.pids_seen)
    before = {p: harness.cpu_seconds(p) for p in pids}
    time.sleep(2.0)
    used = {p: harness.cpu_seconds(p) - before[p] for p in pids}
    assert max(used.values()) < 0.15, used


def test_shutdown_drains_and_leaves_no_process(server):
    """Last in this module: SIGTERM while a response streams; the response still completes (the router
    finishes open responses, the engines drain), then every process exits, code 0."""
    pids = set(server.proc.pids_seen)
    assert len(pids) >= 3  # two ranks and the router, at least
    body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:  # the drain starts mid-stream by construction, however fast 300 tokens are
                    server.proc.signal_while_frozen(server.ranks, signal.SIGTERM)
    assert chunks[-1]["usage"]["completion_tokens"] == 300
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert server.proc.wait(60) == 0, server.proc.output()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]
