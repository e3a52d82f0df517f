"""Tests of ``epserve bench serve``: datasets, arrivals, SSE parsing, metrics, and the client end to end.

The end-to-end tests run the client against a small FastAPI server defined here (uvicorn in a background
thread): it streams a few chunks per request with usage, simulates a block prefix cache for
``cached_tokens``, answers 404 with an OpenAI error body for an unknown model, and fails every request of
more than one token for the model ``flaky``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from epserve.bench import cli as bench_cli
from epserve.bench.datasets import arrival_offsets, make_dataset, poisson_delays
from epserve.bench.metrics import BenchResult, RequestRecord, StreamAccumulator, format_result, summarize
from epserve.bench.serve import (
    SSEDecoder,
    StreamError,
    error_message,
    normalize_base_url,
    parse_sse_lines,
    run_bench,
)
from epserve.cli import main as cli_main

# --------------------------------------------------------------------------------------------- helpers


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "serve", *argv])


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------------- datasets


def test_random_dataset_lengths_and_determinism() -> None:
    reqs = make_dataset("random", vocab_size=100, max_model_len=4096, num_prompts=50, seed=3,
                        random_input_len=40, random_output_len=7)
    assert len(reqs) == 50
    assert all(len(r.prompt_token_ids) == 40 and r.output_len == 7 and r.group is None for r in reqs)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 50  # independent prompts
    assert max(common_prefix(reqs[0].prompt_token_ids, r.prompt_token_ids) for r in reqs[1:]) < 5
    same = make_dataset("random", vocab_size=100, max_model_len=4096, num_prompts=50, seed=3,
                        random_input_len=40, random_output_len=7)
    other = make_dataset("random", vocab_size=100, max_model_len=4096, num_prompts=50, seed=4,
                         random_input_len=40, random_output_len=7)
    assert [r.prompt_token_ids for r in same] == [r.prompt_token_ids for r in reqs]
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_random_range_ratio_bounds() -> None:
    reqs = make_dataset("random", vocab_size=50, max_model_len=4096, num_prompts=400, seed=0,
                        random_input_len=100, random_output_len=20, random_range_ratio=0.5)
    ins = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 50 <= min(ins) < 60 and 140 < max(ins) <= 150
    assert 10 <= min(outs) and max(outs) <= 30 and len(set(outs)) > 10
    assert make_dataset("random", vocab_size=50, max_model_len=4096, num_prompts=10,
                        random_input_len=3, random_range_ratio=1.0)  # lower bound kept >= 1


def test_default_num_prompts() -> None:
    assert len(make_dataset("random", vocab_size=10, max_model_len=4096, random_input_len=4)) == 128
    assert len(make_dataset("shared-prefix", vocab_size=10, max_model_len=4096, system_prompt_len=4,
                            question_len=2)) == 16 * 8


def test_shared_prefix_groups_share_exactly_system_prompt() -> None:
    reqs = make_dataset("shared-prefix", vocab_size=512, max_model_len=4096, seed=1, num_groups=5,
                        prompts_per_group=6, system_prompt_len=33, question_len=9, output_len=4)
    assert len(reqs) == 30
    assert all(len(r.prompt_token_ids) == 42 and r.output_len == 4 for r in reqs)
    by_group: dict[int, list[list[int]]] = {}
    for r in reqs:
        assert r.group is not None
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    assert sorted(by_group) == list(range(5)) and all(len(v) == 6 for v in by_group.values())
    for g, prompts in by_group.items():
        for i in range(len(prompts)):
            for j in range(i + 1, len(prompts)):
                assert common_prefix(prompts[i], prompts[j]) == 33  # the system prompt, not one token more
        for h, others in by_group.items():
            if h != g:
                assert common_prefix(prompts[0], others[0]) == 0
    again = make_dataset("shared-prefix", vocab_size=512, max_model_len=4096, seed=1, num_groups=5,
                         prompts_per_group=6, system_prompt_len=33, question_len=9, output_len=4)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]


def test_shared_prefix_shuffled_interleaves_groups() -> None:
    reqs = make_dataset("shared-prefix", vocab_size=512, max_model_len=4096, seed=0, num_groups=8,
                        prompts_per_group=8, system_prompt_len=4, question_len=2)
    groups = [r.group for r in reqs]
    assert groups != sorted(groups)  # type: ignore[type-var]
    changes = sum(a != b for a, b in zip(groups, groups[1:]))
    assert changes > 40  # grouped order would change only 7 times
    assert len(set(groups[:16])) >= 5


def test_shared_prefix_num_prompts_truncates_and_cycles() -> None:
    kw: dict[str, Any] = dict(vocab_size=512, max_model_len=4096, seed=2, num_groups=3, prompts_per_group=2,
                              system_prompt_len=5, question_len=3)
    full = make_dataset("shared-prefix", **kw)
    assert [r.prompt_token_ids for r in make_dataset("shared-prefix", num_prompts=4, **kw)] == \
        [r.prompt_token_ids for r in full[:4]]
    cycled = make_dataset("shared-prefix", num_prompts=14, **kw)
    assert [r.prompt_token_ids for r in cycled] == [full[i % 6].prompt_token_ids for i in range(14)]


def test_clamping_to_max_model_len(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="epserve.bench.serve"):
        reqs = make_dataset("random", vocab_size=50, max_model_len=64, num_prompts=20,
                            random_input_len=60, random_output_len=10, random_range_ratio=0.2)
    assert all(len(r.prompt_token_ids) + r.output_len <= 64 for r in reqs)
    assert len([rec for rec in caplog.records if "clamped" in rec.message]) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epserve.bench.serve"):
        reqs = make_dataset("shared-prefix", vocab_size=50, max_model_len=64, num_groups=2,
                            prompts_per_group=3, system_prompt_len=50, question_len=20, output_len=8)
    assert all(len(r.prompt_token_ids) == 56 and r.output_len == 8 for r in reqs)  # question shrinks first
    a, b = [r.prompt_token_ids for r in reqs if r.group == 0][:2]
    assert common_prefix(a, b) == 50
    assert len([rec for rec in caplog.records if "clamped" in rec.message]) == 1
    tiny = make_dataset("shared-prefix", vocab_size=50, max_model_len=10, num_groups=1, prompts_per_group=2,
                        system_prompt_len=50, question_len=20, output_len=50)
    assert all(len(r.prompt_token_ids) + r.output_len <= 10 and r.output_len >= 1 for r in tiny)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epserve.bench.serve"):
        make_dataset("random", vocab_size=50, max_model_len=4096, num_prompts=5, random_input_len=10)
    assert not caplog.records


@pytest.mark.parametrize(("kwargs", "option"), [
    (dict(dataset="nope"), "--dataset"),
    (dict(num_prompts=0), "--num-prompts"),
    (dict(vocab_size=0), "--vocab-size"),
    (dict(random_input_len=0), "--random-input-len"),
    (dict(random_range_ratio=1.5), "--random-range-ratio"),
    (dict(dataset="shared-prefix", num_groups=0), "--num-groups"),
    (dict(dataset="shared-prefix", output_len=0), "--output-len"),
    (dict(dataset="shared-prefix", system_prompt_len=0, question_len=0), "--system-prompt-len"),
])
def test_dataset_validation_names_the_option(kwargs: dict[str, Any], option: str) -> None:
    kw: dict[str, Any] = dict(dataset="random", vocab_size=10, max_model_len=100)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=option):
        make_dataset(kw.pop("dataset"), **kw)


# --------------------------------------------------------------------------------------------- arrivals


def test_poisson_delays() -> None:
    d = poisson_delays(20.0, 20000, seed=0)
    assert len(d) == 20000 and min(d) >= 0
    assert sum(d) / len(d) == pytest.approx(1 / 20.0, rel=0.03)
    var = sum((x - 0.05) ** 2 for x in d) / len(d)
    assert math.sqrt(var) == pytest.approx(0.05, rel=0.05)  # exponential: std == mean
    assert poisson_delays(20.0, 100, seed=1) == poisson_delays(20.0, 100, seed=1)
    assert poisson_delays(20.0, 100, seed=1) != poisson_delays(20.0, 100, seed=2)
    assert poisson_delays(math.inf, 5) == [0.0] * 5
    with pytest.raises(ValueError, match="--request-rate"):
        poisson_delays(0.0, 3)
    assert arrival_offsets([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]
    assert arrival_offsets([]) == []


# --------------------------------------------------------------------------------------------- metrics


def rec(ttft: float, e2e: float, out: int, itl: list[float], prompt: int = 100, cached: int = 0,
        ok: bool = True, error: str = "") -> RequestRecord:
    return RequestRecord(success=ok, prompt_len=prompt, output_tokens=out, cached_tokens=cached, ttft=ttft,
                         itl=itl, e2e=e2e, error=error)


def test_summarize_math() -> None:
    records = [
        rec(0.1, 1.1, 11, [0.1] * 10, prompt=100, cached=50),
        rec(0.3, 0.7, 5, [0.1] * 4, prompt=200, cached=0),
        rec(0.2, 0.2, 1, [], prompt=100, cached=100),
        rec(9.0, 99.0, 0, [], prompt=1000, ok=False, error="HTTP 500: boom"),
        rec(9.0, 99.0, 0, [], prompt=1000, ok=False, error="HTTP 500: boom"),
        rec(9.0, 99.0, 0, [], prompt=1000, ok=False, error="ReadTimeout"),
    ]
    r = summarize(records, 2.0, max_concurrency=4, request_rate=10.0)
    assert (r.completed, r.failed) == (3, 3)
    assert (r.total_input_tokens, r.total_output_tokens, r.total_cached_tokens) == (400, 17, 150)
    assert r.request_throughput == pytest.approx(1.5)
    assert r.input_token_throughput == pytest.approx(200.0)
    assert r.output_token_throughput == pytest.approx(8.5)
    assert r.total_token_throughput == pytest.approx(208.5)
    assert r.cache_hit_rate == pytest.approx(150 / 400)
    assert r.mean_ttft_ms == pytest.approx(200.0) and r.median_ttft_ms == pytest.approx(200.0)
    assert r.p99_ttft_ms == pytest.approx(100 + 200 * 0.99 * 1)  # numpy linear interpolation: 0.1..0.3
    # tpot only for > 1 output token: (1.1 - 0.1) / 10 = 100 ms, (0.7 - 0.3) / 4 = 100 ms
    assert r.mean_tpot_ms == pytest.approx(100.0) and r.p99_tpot_ms == pytest.approx(100.0)
    assert r.mean_itl_ms == pytest.approx(100.0) and r.median_itl_ms == pytest.approx(100.0)
    assert r.mean_e2e_ms == pytest.approx(2000 / 3) and r.median_e2e_ms == pytest.approx(700.0)
    assert r.p99_e2e_ms == pytest.approx(700 + 400 * 0.98)
    assert r.errors == ["HTTP 500: boom (x2)", "ReadTimeout"]
    d = r.to_dict()
    assert d["max_concurrency"] == 4 and d["request_rate"] == 10.0
    json.dumps(d, allow_nan=False)
    table = format_result(r, label="x", model="m")
    assert "Serving Benchmark Result" in table and "HTTP 500: boom (x2)" in table and "37.50" in table


def test_summarize_percentiles_and_empty() -> None:
    records = [rec(i / 1000, 1.0, 2, [i / 1000]) for i in range(1, 101)]
    r = summarize(records, 10.0)
    assert r.median_ttft_ms == pytest.approx(50.5) and r.p99_ttft_ms == pytest.approx(99.01)
    assert r.median_itl_ms == pytest.approx(50.5)
    none = summarize([rec(0, 0, 0, [], ok=False, error="e")], 0.0)
    assert (none.completed, none.failed, none.request_throughput) == (0, 1, 0.0)
    assert none.mean_ttft_ms is None and none.cache_hit_rate is None and none.p99_e2e_ms is None
    d = none.to_dict()
    assert d["request_rate"] == "inf"
    json.dumps(d, allow_nan=False)
    assert "n/a" in format_result(none)
    assert summarize([rec(0.1, 0.2, 1, [])], 1.0).mean_tpot_ms is None  # one output token: no tpot


# --------------------------------------------------------------------------------------------- SSE


def chunk(text: str | None, finish: str | None = None, usage: dict[str, Any] | None = None) -> str:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                       "choices": choices, "usage": usage})


USAGE = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 4}}


def test_parse_sse_multi_chunk_usage_done() -> None:
    body = (f"data: {chunk('a')}\n\n: keep-alive\n\ndata: {chunk('')}\n\ndata:{chunk('bc')}\r\n\r\n"
            f"data: {chunk('d', 'length')}\n\ndata: {chunk(None, usage=USAGE)}\n\ndata: [DONE]\n\n"
            f"data: {chunk('after done')}\n\n")
    chunks, done = parse_sse_lines(body.splitlines())
    assert done
    assert [c["choices"][0]["text"] for c in chunks[:4]] == ["a", "", "bc", "d"]
    assert chunks[3]["choices"][0]["finish_reason"] == "length"
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["prompt_tokens_details"]["cached_tokens"] == 4

    chunks, done = parse_sse_lines([f"data: {chunk('x')}", "", f"data: {chunk('y')}"])  # no [DONE], no blank
    assert not done and len(chunks) == 2

    dec = SSEDecoder()  # an event's data split over several data lines is joined with newlines
    assert dec.feed('data: {"a":') is None and dec.feed("data: 1}") is None
    assert json.loads(dec.feed("") or "") == {"a": 1}
    assert dec.feed("") is None and dec.flush() is None


def test_stream_errors_and_error_bodies() -> None:
    err = json.dumps({"error": {"message": "engine died", "type": "internal_error", "code": 500}})
    with pytest.raises(StreamError, match="engine died"):
        parse_sse_lines([f"data: {chunk('a')}", "", f"data: {err}", ""])
    with pytest.raises(StreamError, match="bad JSON"):
        parse_sse_lines(["data: {not json", ""])
    body = json.dumps({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                 "code": 404}}).encode()
    assert error_message(404, body) == "HTTP 404: The model `x` does not exist. (NotFoundError)"
    detail = json.dumps({"detail": [{"loc": ["body"], "msg": "bad"}]})
    assert error_message(422, detail).startswith("HTTP 422: [")
    assert error_message(502, b"<html>Bad Gateway</html>") == "HTTP 502: <html>Bad Gateway</html>"
    assert error_message(500, b"") == "HTTP 500: (empty body)"


def test_stream_accumulator() -> None:
    acc = StreamAccumulator(start=10.0, prompt_len=7)
    for t, text in ((10.5, "a"), (10.6, ""), (10.8, "bc")):
        acc.add(json.loads(chunk(text)), t)
    acc.add(json.loads(chunk(None, usage=USAGE)), 10.9)
    r = acc.finish(11.0, done=True)
    assert r.success and r.ttft == pytest.approx(0.5) and r.e2e == pytest.approx(1.0)
    assert r.itl == pytest.approx([0.1, 0.2])
    assert (r.prompt_len, r.output_tokens, r.cached_tokens) == (7, 5, 4)  # usage wins over the chunk count

    acc = StreamAccumulator(start=0.0, prompt_len=3)  # no usage: count the chunks
    for t in (0.1, 0.2, 0.3):
        acc.add(json.loads(chunk("t")), t)
    r = acc.finish(0.3, done=True)
    assert r.success and (r.prompt_len, r.output_tokens, r.cached_tokens) == (3, 3, 0)

    assert "[DONE]" in StreamAccumulator(0.0, 3).finish(1.0, done=False).error
    assert not StreamAccumulator(0.0, 3).finish(1.0, done=True).success


# --------------------------------------------------------------------------------------------- CLI


def test_cli_defaults_and_validation() -> None:
    args = parse([])
    assert args.func is bench_cli.run
    assert (args.base_url, args.dataset, args.request_rate, args.max_concurrency) == \
        ("http://127.0.0.1:8000", "random", math.inf, None)
    assert (args.random_input_len, args.random_output_len, args.num_groups, args.prompts_per_group,
            args.system_prompt_len, args.question_len, args.output_len, args.seed) == \
        (256, 32, 16, 8, 512, 64, 32, 0)
    for argv, option in ((["--request-rate", "0"], "--request-rate"),
                         (["--max-concurrency", "0"], "--max-concurrency"),
                         (["--num-prompts", "-1"], "--num-prompts"),
                         (["--base-url", "localhost:8000"], "--base-url"),
                         (["--vocab-size", "0"], "--vocab-size"), (["--temperature", "-1"], "--temperature"), (["--seed", "-1"], "--seed"),
                         (["--random-input-len", "0"], "--random-input-len"),
                         (["--dataset", "shared-prefix", "--question-len", "-1"], "--question-len"),
                         (["--json", "/nonexistent/dir/out.json"], "--json")):
        with pytest.raises(ValueError, match=option):
            run_bench(parse(argv))
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"


# --------------------------------------------------------------------------------------------- test server

BLOCK = 4  # the fake prefix cache's block size
MAX_MODEL_LEN = 256
VOCAB = 1000
SERVER_APPS: dict[str, FastAPI] = {}


def make_app() -> FastAPI:
    app = FastAPI()
    app.state.auth = set()  # the Authorization headers seen
    seen_blocks: set[tuple[int, ...]] = set()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": "tiny", "object": "model", "max_model_len": MAX_MODEL_LEN, "vocab_size": VOCAB},
            {"id": "flaky", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        app.state.auth.add(request.headers.get("authorization"))
        body = await request.json()
        model, prompt, max_tokens = body["model"], body["prompt"], body["max_tokens"]
        if model not in ("tiny", "flaky"):
            return JSONResponse(status_code=404, content={"error": {
                "message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}})
        if model == "flaky" and max_tokens > 1:
            return JSONResponse(status_code=500, content={"error": {
                "message": "flaky engine", "type": "InternalServerError", "code": 500}})
        assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
        cached = 0  # the longest run of leading full blocks seen before (registered at arrival)
        while cached + BLOCK <= len(prompt) - 1 and tuple(prompt[:cached + BLOCK]) in seen_blocks:
            cached += BLOCK
        seen_blocks.update(tuple(prompt[:i]) for i in range(BLOCK, len(prompt), BLOCK))

        async def stream() -> Any:
            # chunk sizes 1, 2, 1, 2, ...; the first chunk's text is held back (""), as a detokenizer may
            sent, step = 0, 0
            while sent < max_tokens:
                n = min(1 + step % 2, max_tokens - sent)
                sent += n
                text = "" if step == 0 else "t" * n
                finish = "length" if sent == max_tokens else None
                yield f"data: {chunk(text, finish)}\n\n"
                step += 1
                await asyncio.sleep(0.002)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                     "total_tokens": len(prompt) + max_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield f"data: {chunk(None, usage=usage)}\n\ndata: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = make_app()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    SERVER_APPS[f"http://127.0.0.1:{port}"] = app
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(5)
    sock.close()


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def test_end_to_end_shared_prefix(server_url: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.json"
    args = parse(["--base-url", server_url + "/v1", "--dataset", "shared-prefix", "--num-groups", "3",
                  "--prompts-per-group", "4", "--system-prompt-len", "20", "--question-len", "5",
                  "--output-len", "6", "--max-concurrency", "4", "--disable-tqdm", "--label", "e2e",
                  "--json", str(out)])
    result = run_bench(args)
    assert isinstance(result, BenchResult)
    assert (result.completed, result.failed, result.errors) == (12, 0, [])
    assert result.total_input_tokens == 12 * 25 and result.total_output_tokens == 12 * 6
    # every prompt but each group's first hits the system prompt
    assert result.total_cached_tokens == 3 * 3 * 20
    assert result.cache_hit_rate == pytest.approx(180 / 300)
    assert 0 < result.mean_ttft_ms <= result.mean_e2e_ms and result.p99_ttft_ms <= result.p99_e2e_ms
    assert result.mean_itl_ms > 0 and result.mean_tpot_ms > 0 and result.max_concurrency == 4
    assert result.output_token_throughput == pytest.approx(72 / result.duration_s)
    captured = capsys.readouterr()
    assert "Serving Benchmark Result" in captured.out and "e2e" in captured.out
    saved = json.loads(out.read_text())
    assert saved["completed"] == 12 and saved["model"] == "tiny" and saved["label"] == "e2e"
    assert saved["args"]["dataset"] == "shared-prefix" and saved["args"]["request_rate"] == "inf"
    assert "api_key" not in saved["args"] and saved["max_model_len"] == MAX_MODEL_LEN


def test_end_to_end_random_poisson_json_stdout(server_url: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    args = parse(["--base-url", server_url, "--num-prompts", "10", "--random-input-len", "300",
                  "--random-output-len", "3", "--request-rate", "200", "--json", "-", "--disable-tqdm"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    saved = json.loads(captured.out)  # stdout holds only the JSON
    assert "Serving Benchmark Result" in captured.err and "sk-secret" not in captured.out
    assert saved["completed"] == 10 and saved["request_rate"] == 200.0
    assert saved["total_input_tokens"] == 10 * (MAX_MODEL_LEN - 3)  # clamped to the server's max_model_len
    assert saved["total_output_tokens"] == 30 and saved["total_cached_tokens"] == 0
    assert "Bearer sk-secret" in SERVER_APPS[server_url].state.auth


def test_bad_model_is_reported(server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"HTTP 404: The model `nope` does not exist.*tiny, flaky"):
        run_bench(parse(["--base-url", server_url, "--model", "nope", "--disable-tqdm"]))
    argv = ["bench", "serve", "--base-url", server_url, "--model", "nope", "--disable-tqdm"]
    assert cli_main(argv) == 2
    assert "epserve: error: the test request" in capsys.readouterr().err


def test_every_request_failing_exits_1(server_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["--base-url", server_url, "--model", "flaky", "--num-prompts", "5",
                  "--random-input-len", "8", "--disable-tqdm"])
    assert args.func(args) == 1
    out = capsys.readouterr().out
    assert "HTTP 500: flaky engine (InternalServerError) (x5)" in out
    assert "Failed requests:" in out


def test_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    with pytest.raises(ValueError, match=f"cannot reach the server at {url}"):
        run_bench(parse(["--base-url", url, "--disable-tqdm"]))
    assert cli_main(["bench", "serve", "--base-url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("epserve: error: cannot reach the server") and "Traceback" not in err
