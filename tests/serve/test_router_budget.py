"""A real ``epserve router --api-key K`` (no engine token) in front of a listening socket that records
what the router sends its "engine".

Issue 45 (5): the bytes of request bodies the router holds at once are bounded, for each client (its
address) and over all of them, for key holders as for everyone without a key set (the budget is asked
after the key): ``--max-request-bytes 1 MiB``, four of them per client and eight in all. Requests that
do not fit are refused from their head (429 for the client's share, 503 for the router's) before their
body is read, a chunked body as soon as a chunk does not fit; the router's memory stays bounded while
far more is sent to it; the bytes are given back when a request ends. Every request is held open by
construction: a held body has been accepted (the router answered ``100 Continue``, so its bytes are
held) and is one byte short; the refused ones are answered before they finish sending.

Issue 45 (6): the API key is not the engine token: the router calls its engine in plaintext gRPC, as a
token-less engine speaks (it used to open TLS under a token derived from the key)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from epserve.parallel.launch import free_port
from epserve.router.body_budget import BodyBudget
from epserve.router.http_limits import HTTPLimits
from tests.serve_harness import Proc, metric

MIB = 1 << 20
BODY = 1 * MIB  # --max-request-bytes: a client may hold 4 of them, the router 8
HOLD_S = 60.0  # header, body and keep-alive timeouts: nothing here waits on them
API_KEY = "sk-issue-45"
H2C_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # what a plaintext gRPC call opens with (TLS: b"\x16\x03")


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


class Engine:
    """A listening socket: the first bytes the router sends on its first connection."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.first = b""
        self.called = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
            conn.settimeout(30)
            while len(self.first) < len(H2C_PREFACE) and (chunk := conn.recv(4096)):
                self.first += chunk
        except OSError:
            pass
        self.called.set()


class Router:
    def __init__(self, proc: Proc, port: int, engine: Engine) -> None:
        self.proc, self.port, self.url, self.engine = proc, port, f"http://127.0.0.1:{port}", engine

    def connect(self, client: str) -> socket.socket:
        sock = socket.socket()
        sock.settimeout(30)
        sock.bind((client, 0))
        sock.connect(("127.0.0.1", self.port))
        return sock

    def head(self, size: int | None, expect: bool = True) -> bytes:
        length = "Transfer-Encoding: chunked" if size is None else f"Content-Length: {size}"
        return (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                f"Content-Type: application/json\r\n{length}\r\n"
                + ("Expect: 100-continue\r\n" if expect else "") + "\r\n").encode()

    def held(self, client: str, size: int = BODY) -> socket.socket:
        """A request the router has taken (it answered ``100 Continue``) with all of its body but the last byte."""
        sock = self.connect(client)
        sock.sendall(self.head(size))
        assert _read_head(sock).startswith(b"HTTP/1.1 100 "), "the router did not take the request"
        sock.sendall(b"x" * (size - 1))
        return sock

    def errors(self, status: int) -> float:
        return metric(httpx.get(f"{self.url}/metrics", timeout=30).text, "epserve:request_errors_total",
                      status=str(status))


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _reply(sock: socket.socket) -> bytes:
    """A whole response (a 100 Continue before it skipped), read until it is complete or the router closes."""
    data = b""
    try:
        while True:
            head, sep, body = data.partition(b"\r\n\r\n")
            if sep and head.startswith(b"HTTP/1.1 100 "):
                data = body
                continue
            length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                      if line.startswith(b"content-length:")]
            if sep and length and len(body) >= length[0]:
                return data
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk
    except ConnectionResetError:  # (after its answer: the answer stays readable)
        return data


def _error(reply: bytes, status: int) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), reply[:300]
    return json.loads(body)["error"]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("budget")
    port, engine = free_port(), Engine()
    proc = Proc(["router", "--engine", f"127.0.0.1:{engine.port}", "--port", str(port), "--api-key", API_KEY,
                 "--max-request-bytes", str(BODY), "--max-client-body-bytes", str(4 * BODY),
                 "--max-body-bytes", str(8 * BODY),
                 "--header-timeout", str(HOLD_S), "--body-timeout", str(HOLD_S), "--keep-alive-timeout", str(HOLD_S)],
                tmp / "router.log")
    deadline = time.monotonic() + 120
    while True:  # (no engine: /health answers 503)
        assert proc.proc.poll() is None and time.monotonic() < deadline, proc.output()[-3000:]
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield Router(proc, port, engine)
    finally:
        proc.kill_all()
        engine.sock.close()


def test_router_api_key_is_not_the_engine_token(router):
    assert router.engine.called.wait(60)
    assert router.engine.first.startswith(H2C_PREFACE), \
        f"the router did not call its engine in plaintext: {router.engine.first[:8]!r}"
    assert httpx.get(f"{router.url}/v1/models", timeout=30).status_code == 401  # the key still guards /v1


def test_body_budget_refuses_before_reading_and_gives_back(router):
    held = [router.held("127.0.0.1") for _ in range(4)]  # client 127.0.0.1's whole share
    idle = rss_mib(router.proc.pid)  # (the router has taken those four: their bytes are held)
    try:  # the peak (VmHWM) from now on, where the kernel allows resetting it (else: since the start)
        with open(f"/proc/{router.proc.pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass

    async def flood(n: int) -> list[bytes]:
        """``n`` more 1 MiB bodies from 127.0.0.1 at once, each sent whole but its last byte."""
        loop = asyncio.get_running_loop()

        async def one() -> bytes:
            sock = socket.socket()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", router.port))
            try:
                await asyncio.wait_for(loop.sock_sendall(sock, router.head(BODY, expect=False) + b"x" * (BODY - 1)),
                                       10)
            except (OSError, TimeoutError):
                pass  # refused: the router stopped reading it
            sock.setblocking(True)
            sock.settimeout(30)
            with sock:
                return await loop.run_in_executor(None, _reply, sock)

        return await asyncio.gather(*(one() for _ in range(n)))

    for reply in asyncio.run(flood(48)):
        error = _error(reply, 429)
        assert error["code"] == "too_many_request_bytes" and error["type"] == "rate_limit_error"
        assert b"retry-after: 1" in reply.lower()
    assert rss_mib(router.proc.pid, "VmHWM") - idle < 40, "the refused bodies were buffered"

    held += [router.held("127.0.0.2") for _ in range(4)]  # another client: the router's 8 MiB in all
    sock = router.connect("127.0.0.3")
    sock.sendall(router.head(BODY))  # a third client fits its own share, not the router's
    error = _error(_reply(sock), 503)
    assert error["code"] == "too_many_request_bytes" and error["type"] == "service_unavailable_error"
    sock.close()
    chunked = router.connect("127.0.0.3")  # chunked: held chunk by chunk, refused at the first
    chunked.sendall(router.head(None))
    assert _read_head(chunked).startswith(b"HTTP/1.1 100 ")
    chunked.sendall(b"10000\r\n" + b"x" * 0x10000 + b"\r\n")
    assert _error(_reply(chunked), 503)["code"] == "too_many_request_bytes"
    chunked.close()

    for sock in held:  # each ends (a 400: not JSON) and gives its bytes back ...
        sock.sendall(b"x")
        assert _error(_reply(sock), 400)["code"] == "invalid_json"
        sock.close()
    again = [router.held("127.0.0.1") for _ in range(4)]  # ... so the client's whole share fits again
    for sock in again:
        sock.sendall(b"x")
        assert _error(_reply(sock), 400)["code"] == "invalid_json"
        sock.close()
    assert router.errors(429) >= 48 and router.errors(503) >= 2


def test_body_budget_arithmetic():
    budget = BodyBudget(total=10, per_client=6)
    a, b = budget.hold("a"), budget.hold("b")
    assert a.take(6) is None and a.take(1).status == 429  # a's share
    assert b.take(4) is None and b.take(1).status == 503  # the router's
    assert budget.used == 10 and budget.by_client == {"a": 6, "b": 4}
    a.release()
    assert budget.used == 4 and budget.by_client == {"b": 4}  # (a client holding nothing is forgotten)
    assert a.take(5) is None and budget.used == 4  # released: it holds nothing more
    b.release()
    b.release()
    assert budget.used == 0 and budget.by_client == {}
    assert HTTPLimits(max_request_bytes=MIB).body_budget == (16 * MIB, 8 * MIB)
    with pytest.raises(ValueError, match="--max-client-body-bytes"):
        HTTPLimits(max_request_bytes=MIB, max_client_body_bytes=MIB - 1)
    with pytest.raises(ValueError, match="--max-body-bytes"):
        HTTPLimits(max_request_bytes=MIB, max_body_bytes=2 * MIB, max_client_body_bytes=3 * MIB)
