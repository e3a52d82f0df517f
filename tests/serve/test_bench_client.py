"""Tests of ``epserve bench serve``'s client: SSE parsing, stream accumulation, the CLI, and end to end.

The end-to-end tests run the client against a small FastAPI server defined here (uvicorn in a background
thread): it streams a few chunks per request with usage, simulates a block prefix cache for
``cached_tokens``, answers 404 with an OpenAI error body for an unknown model, and fails every request of
more than one token for the model ``flaky``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from epserve.bench.metrics import BenchResult, StreamAccumulator
from epserve.bench.serve import normalize_base_url, run_bench
from epserve.bench.sse import SSEDecoder, StreamError, error_message, parse_sse_lines
from epserve.cli import main as cli_main

# --------------------------------------------------------------------------------------------- helpers


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="epserve")
    bench_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "serve", *argv])


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
                         (["--vocab-size", "0"], "--vocab-size"), (["--temperature", "-1"], "--temperature"),
                         (["--seed", "-1"], "--seed"),
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
