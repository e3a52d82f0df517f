"""The router's HTTP side under abuse, against a real ``epserve serve --dp 1`` (API key from a file,
short header and body timeouts): half-sent requests are cut off and do not hold the server, bodies
over the cap get 413, a client gone before its body is a counted 499 without a traceback, maximal
requests do not stall /health or a small stream, the OpenAPI document describes the bodies and every
answer (a schemathesis fuzz run finds no 5xx and nothing off the document), and a request the engine
aborts ends as an OpenAI error, never as ``finish_reason: "abort"``."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time

import httpx
import pytest
from starlette.responses import JSONResponse

from epserve.cli import main
from epserve.parallel.launch import free_port
from epserve.router.errors import APIError
from epserve.router.http_limits import HTTPLimits, RequestLimitsMiddleware
from epserve.tokenizer import CHAT_TEMPLATE
from tests.serve_harness import Proc, metric, wait_http_ok

pytestmark = pytest.mark.slow

API_KEY = "sk-from-a-file"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 3.0, 5.0
CAP = HTTPLimits().max_request_bytes  # the default --max-request-bytes
MAX_MODEL_LEN = 128  # keeps every fuzzed generation short


class Server:
    def __init__(self, proc: Proc, url: str, port: int) -> None:
        self.proc, self.url, self.port = proc, url, port

    def errors(self, status: int) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        return metric(text, "epserve:request_errors_total", status=str(status))

    def raw(self, data: bytes) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(data)
        return sock


@pytest.fixture(scope="module")
def server(make_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    (tmp / "key").write_text(API_KEY + "\n")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE + "{% if flag is defined %}[flag]{% endif %}")
    yield from _serving(make_ckpt, tmp, "--chat-template", str(tmp / "chat.jinja"), "--header-timeout",
                        str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S), "--num-blocks", "64",
                        "--max-model-len", str(MAX_MODEL_LEN))


def _serving(make_ckpt, tmp, *options: str):  # noqa: ANN001, ANN202
    """``epserve serve`` on the tiny preset (fp32) with the API key in ``tmp``, until the generator closes."""
    port = free_port()
    proc = Proc(["serve", str(make_ckpt("tiny", dtype="float32")), "--dp", "1", "--port", str(port),
                 "--api-key-file", str(tmp / "key"), "--drain-timeout", "0", "--dtype", "float32", *options],
                tmp / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        yield Server(proc, url, port)
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\nConnection: close\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _reply(sock: socket.socket, wait_s: float) -> bytes:
    """All the server sends on ``sock`` until it closes it (TimeoutError if not within ``wait_s``)."""
    sock.settimeout(wait_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _is_closed(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closed ``sock`` (after any response it sent) within ``wait_s``."""
    sock.settimeout(wait_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_api_key_from_a_file(server):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]


def test_the_chat_template_option_reaches_the_router(server):
    """``--chat-template FILE`` travels with the router's options: its variable shows in /tokenize."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"flag": 1}}
    tokens = httpx.post(f"{server.url}/tokenize", headers=AUTH, json=body).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", headers=AUTH, json={"tokens": tokens}).json()["prompt"]
    assert text.endswith("<｜User｜>hi<｜Assistant｜>[flag]")


def test_unreadable_key_files_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "empty").write_text("\n")
    for path, why in [(tmp_path / "missing", "cannot read it (No such file or directory)"),
                      (tmp_path / "empty", "is empty"), (tmp_path, "cannot read it (Is a directory)")]:
        assert main(["router", "--engine", "127.0.0.1:1", "--api-key-file", str(path)]) == 2
        assert f"epserve: error: --api-key-file {path}" in (err := capsys.readouterr().err) and why in err, err


def test_half_sent_requests_are_cut_off_and_do_not_hold_the_server(server):
    """200 connections that stop inside their request head: /health and a completion still answer at
    once, and the server closes every one of them after --header-timeout (not before)."""
    # one completion first: what is timed below is the half-sent heads' effect, not a first request's warm-up
    assert httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "hi", "max_tokens": 4}).status_code == 200
    start = time.monotonic()
    heads = [b"GET /hea", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"]
    socks = [server.raw(heads[i % 2]) for i in range(200)]
    t = time.monotonic()
    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30, json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200 and time.monotonic() - t < HEADER_TIMEOUT_S
    assert not _is_closed(socks[0], 0.2) and time.monotonic() - start < HEADER_TIMEOUT_S  # still open
    closed = [_is_closed(s, HEADER_TIMEOUT_S + 5) for s in socks]
    assert all(closed) and time.monotonic() - start < HEADER_TIMEOUT_S + 5
    for s in socks:
        s.close()


def test_a_body_that_stops_gets_408_then_the_connection_closes(server):
    start = time.monotonic()
    reply = _reply(server.raw(_head("/v1/completions", 100) + b'{"prompt": '), BODY_TIMEOUT_S + 5)
    assert reply.startswith(b"HTTP/1.1 408 ") and time.monotonic() - start > BODY_TIMEOUT_S - 1
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_bodies_over_the_cap_get_413(server):
    reply = _reply(server.raw(_head("/v1/completions", CAP + 1)), 10)  # refused on Content-Length alone
    assert reply.startswith(b"HTTP/1.1 413 ") and b'"request_too_large"' in reply

    def chunks():  # chunked: no Content-Length, counted as it arrives
        for _ in range(CAP // 65536 + 2):
            yield b" " * 65536

    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    at_the_cap = b'{"prompt": "x", "max_tokens": 1}'.ljust(CAP)  # JSON allows trailing spaces
    assert httpx.post(f"{server.url}/v1/completions", headers=AUTH, content=at_the_cap).status_code == 200


def test_a_client_gone_before_its_body_is_counted_not_logged_as_an_error(server):
    before = server.errors(499)
    for _ in range(5):
        server.raw(_head("/v1/completions", 100) + b'{"prompt').close()
    deadline = time.monotonic() + 10
    while server.errors(499) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.errors(499) == before + 5
    log = server.proc.output()
    assert "Traceback" not in log and "Exception in ASGI" not in log and " 500" not in log


def test_maximal_requests_do_not_stall_health_or_a_small_stream(server):
    """Six bodies just under the cap (a million token ids each) and one of 256 text prompts (the most
    one request may ask for) are parsed and tokenized off the event loop: meanwhile /health answers
    at once (median; the worst wait is one JSON parse holding the GIL) and a small stream completes."""
    ids = b'{"max_tokens": 1, "prompt": [' + b",".join([b"511"] * ((CAP - 100) // 4)) + b"]}"
    texts = json.dumps({"prompt": ["the quick brown fox " * 180] * 256, "max_tokens": 1}).encode()
    replies: list[bytes] = []

    def send(body: bytes) -> None:
        with server.raw(_head("/v1/completions", len(body)) + body) as sock:
            replies.append(_reply(sock, 60))

    senders = [threading.Thread(target=send, args=(b,)) for b in [ids] * 6 + [texts]]
    for t in senders:
        t.start()
    latencies, stream = [], {}

    def small_stream() -> None:
        t = time.monotonic()
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "hi", "max_tokens": 8, "stream": True}) as r:
            stream["lines"] = [line for line in r.iter_lines() if line]
        stream["s"] = time.monotonic() - t

    streamer = threading.Thread(target=small_stream)
    streamer.start()
    with httpx.Client(base_url=server.url) as client:
        while any(t.is_alive() for t in senders):
            t = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.02)
    streamer.join(60)
    assert len(replies) == 7 and all(b" 400 " in r and b"context_length_exceeded" in r for r in replies), replies
    # parsed on the event loop, these bodies hold /health for ~0.4 s each time (median), once ~1 s
    assert len(latencies) >= 5 and statistics.median(latencies) < 0.2 and max(latencies) < 1.5, latencies
    assert stream["lines"][-1] == "data: [DONE]" and stream["s"] < 10, stream


def test_the_500_handler_tells_nothing_and_keeps_serving(caplog):
    """In-process: an unexpected exception in the app is a generic 500 whose id is in the log, with
    none of the exception's text."""
    async def app(scope, receive, send):
        raise RuntimeError("/secret/path at 10.0.0.7:50051")

    counted = []

    def reject(e: APIError) -> JSONResponse:
        counted.append(e.status)
        return JSONResponse(e.body(), status_code=e.status)

    limits = RequestLimitsMiddleware(app, HTTPLimits(), reject=reject, on_disconnect=lambda: None)

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=limits), base_url="http://x") as client:
            return await client.post("/v1/completions", content=b"{}")

    r = asyncio.run(call())
    assert r.status_code == 500 and counted == [500]
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "secret" not in r.text and "10.0.0.7" not in r.text
    error_id = err["message"].split("id ")[1].split(";")[0]
    assert error_id in caplog.text and "/secret/path" in caplog.text


def test_openapi_document_describes_bodies_and_errors(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")]:
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert {"200", "400", "401", "404", "413", "503"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert (props["top_k"]["maximum"], props["n"]["maximum"]) == (2**31 - 1, 16)
    assert {"type": "null"} in props["temperature"]["anyOf"]  # null means the default


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_get_no_5xx_and_answers_match_the_document(server, mode):
    """schemathesis sends requests generated from /openapi.json (negative: ones the document forbids):
    no 5xx, every status documented, every body as its schema says. Bounded: a few dozen examples per
    operation, every generation at most MAX_MODEL_LEN tokens."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import checks

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    generation = schemathesis.GenerationMode.POSITIVE if mode == "positive" else schemathesis.GenerationMode.NEGATIVE
    run_checks = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
                  checks.response_schema_conformance]
    statuses: dict[int, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if mode == "negative" and op.method.upper() == "GET":
            continue  # nothing to get wrong

        @settings(max_examples=25 if op.method.upper() == "POST" else 1, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=generation))
        def fuzz(case) -> None:
            response = case.call(base_url=server.url, headers=AUTH, timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=run_checks)

        fuzz()
    assert statuses.get(400, 0) > 0 and not [s for s in statuses if s >= 500], statuses
    if mode == "positive":
        assert statuses.get(200, 0) > 10, statuses


@pytest.fixture
def long_server(make_ckpt, tmp_path):
    """A server of its own for the abort test (which stops it), whose requests may be long: 2,000 tokens
    keep five sequences running together for seconds even on a fast host, where the module server's 120
    took a few tens of milliseconds (the CPU's recorded decode steps)."""
    (tmp_path / "key").write_text(API_KEY + "\n")
    yield from _serving(make_ckpt, tmp_path, "--num-blocks", "700", "--max-model-len", str(LONG_MODEL_LEN))


LONG_MODEL_LEN = 2048  # the tiny preset's positions


def test_a_request_the_engine_aborts_ends_as_an_error_not_as_abort(long_server):
    """SIGTERM with --drain-timeout 0 aborts what the engine runs. A stream gets an OpenAI error event and
    ``data: [DONE]``; a whole response is a 503 error body; ``"abort"`` is sent nowhere.

    The requests are held open by construction, not by racing them (2,000 tokens each, so the five
    sequences run together for seconds): once all five run, the rank is frozen (SIGSTOP), so no token is
    produced while ``epserve serve`` notices the signal and passes it on; the rank runs again only once
    that SIGTERM is pending for it, and then aborts within a step or two. (Frozen for a second or two: far
    under the default --step-timeout of 60 s, so no watchdog or supervisor probe counts it as hung.)"""
    server = long_server
    body = {"prompt": "once", "max_tokens": LONG_MODEL_LEN - 8, "ignore_eos": True}
    whole: dict = {}
    [rank] = server.proc.ranks()

    def complete() -> None:
        r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60, json={**body, "n": 4})
        whole.update(status=r.status_code, text=r.text)

    events = []
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as r:
        lines = r.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: {")))
        worker = threading.Thread(target=complete)
        worker.start()
        deadline = time.monotonic() + 30  # the whole request's 4 choices run too
        while metric(httpx.get(f"{server.url}/metrics", timeout=10).text, "epserve:num_requests_running") < 5:
            assert time.monotonic() < deadline and worker.is_alive(), "the five sequences never ran together"
            time.sleep(0.01)
        server.proc.signal_while_frozen([rank])  # no token is produced until the rank has its SIGTERM
        events += [line for line in lines if line]
    worker.join(60)
    assert events[-1] == "data: [DONE]"
    errors = [json.loads(e[6:])["error"] for e in events if e.startswith('data: {"error"')]
    assert [e["code"] for e in errors] == ["engine_unavailable"], events
    assert "stopped this request before it finished" in errors[0]["message"]
    assert whole["status"] == 503 and json.loads(whole["text"])["error"]["code"] == "engine_unavailable", whole
    assert '"abort"' not in "".join(events) + whole["text"]
    assert server.proc.wait(60) == 0
