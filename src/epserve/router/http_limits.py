"""What one HTTP client may hold of the router: how big a request may be, how long its body may take,
how many generations one request may fan out to (:class:`HTTPLimits`), and what is refused from a
request's head alone (:class:`RequestGate`). The connections' side (how many may be open, the request
head's deadline, the gate asked before any body is read) is uvicorn's protocol in ``http_connections``.

- API key: a request without it gets the 401 from its head (:class:`RequestGate`) before any byte of
  its body is read (only requests with the key have a body read, so no client without it makes the
  router hold more than a request head); served by uvicorn, ``http_connections.http_protocol`` asks
  the gate, in process :class:`APIKeyMiddleware` does.
- Budget: the bytes of request bodies held at once, over all clients and for one client (a peer
  address), are bounded (``body_budget``; served by uvicorn, ``http_connections.http_protocol`` holds
  them from each request head, refusing what does not fit before any byte of its body is read).
- Body: :class:`RequestLimitsMiddleware` reads the whole body before the app runs: 413 when
  ``Content-Length`` or the bytes received (chunked) pass ``max_request_bytes``, 408 when the body is
  not complete ``body_timeout_s`` after the headers; a client that hangs up first is counted (499)
  and forgotten. It is also the catch-all for unexpected exceptions: a generic 500 whose id is in the
  log, never the exception's text, and the connection stays usable.

Plain ASGI: Starlette's BaseHTTPMiddleware would relay every streamed chunk through a memory stream.
"""
from __future__ import annotations

import asyncio
import hmac
import io
import logging
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from epserve.router.errors import (
    APIError,
    internal_error,
    request_timeout,
    request_too_large,
    unauthorized,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPLimits:
    max_request_bytes: int = 4 << 20
    max_choices_per_request: int = 256  # prompts x n
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 2048  # open at once; one more is answered 503 and closed
    max_body_bytes: int | None = None  # request bodies held at once, all clients (None: 16 x max_request_bytes)
    max_client_body_bytes: int | None = None  # ... one client's (a peer address; None: 8 x max_request_bytes)

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        total, per_client = self.body_budget
        if per_client < self.max_request_bytes:
            raise ValueError(f"--max-client-body-bytes ({per_client}) must be at least --max-request-bytes "
                             f"({self.max_request_bytes}): a body of the largest size would never fit")
        if total < per_client:
            raise ValueError(f"--max-body-bytes ({total}) must be at least --max-client-body-bytes ({per_client})")
        if self.max_choices_per_request < 1:
            raise ValueError(f"--max-choices-per-request must be at least 1, got {self.max_choices_per_request}")
        for flag, value in (("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s),
                            ("--keep-alive-timeout", self.keep_alive_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")

    @property
    def body_budget(self) -> tuple[int, int]:
        """The bytes of request bodies the router holds at once: (all clients, one client)."""
        return (16 * self.max_request_bytes if self.max_body_bytes is None else self.max_body_bytes,
                8 * self.max_request_bytes if self.max_client_body_bytes is None else self.max_client_body_bytes)


class _ClientGone(Exception):
    pass


class _ReplayBody:
    """The ``receive`` the app sees: the body already read, in one message, then the real ``receive``
    (which tells of a disconnect)."""

    def __init__(self, body: bytes, receive: Callable) -> None:
        self.message: dict[str, Any] | None = {"type": "http.request", "body": body, "more_body": False}
        self.receive = receive

    async def __call__(self) -> dict[str, Any]:
        if self.message is not None:
            message, self.message = self.message, None
            return message
        return await self.receive()


class RequestLimitsMiddleware:
    """Body size and time limits, and the catch-all 500 (see the module docstring). ``reject`` turns an
    APIError into the response (and counts it); ``on_disconnect`` counts a client gone before its body."""

    def __init__(self, app: Any, limits: HTTPLimits, reject: Callable[[APIError], Response],
                 on_disconnect: Callable[[], None]) -> None:
        self.app = app
        self.limits = limits
        self.reject = reject
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
        except _ClientGone:
            self.on_disconnect()
            logger.debug("client %s left before sending its whole request", scope.get("client"))
            return
        except APIError as e:
            response = self.reject(e)
            response.headers["connection"] = "close"  # the rest of the body is not read
            await response(scope, receive, send)
            return
        replay = _ReplayBody(body, receive)
        started = False

        async def send_tracking(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, replay, send_tracking)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("internal error %s in %s %s", error_id, scope.get("method"), scope.get("path"))
            if not started:  # else uvicorn closes the connection of the response cut short
                await self.reject(internal_error(error_id))(scope, replay, send)

    async def _read_body(self, scope: dict, receive: Callable) -> bytes:
        limit = self.limits.max_request_bytes
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise request_too_large(limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        buffer: io.BytesIO | None = None  # (grown in place: a list of chunks joined would be the body twice)
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise request_timeout(self.limits.body_timeout_s) from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise request_too_large(limit)
            more = message.get("more_body", False)
            if buffer is None:
                if not more:  # the whole body in one message
                    return chunk
                buffer = io.BytesIO()
            buffer.write(chunk)
            if not more:
                return buffer.getvalue()  # (its buffer, not a copy)


class RequestGate:
    """What is refused from a request's head alone, before any of its body is read. With an API key:
    a request for ``/v1/*`` or another path of ``KEYED_PATHS`` without ``Authorization: Bearer KEY``,
    and any request without it that carries a body (no open route takes one): 401. Open without the
    key: ``/health``, ``/metrics``, ``/expert_load``, ``/openapi.json``, ``/docs``.
    ``on_refused(status)`` counts each refusal made by ``http_connections.http_protocol`` (the ASGI middleware that
    also asks the gate counts its own)."""

    KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/version"})

    def __init__(self, api_key: str | None, on_refused: Callable[[int], None] = lambda status: None) -> None:
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.on_refused = on_refused

    def refusal(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> APIError | None:
        """The error to answer for this request head (lower-case header names), or None."""
        if self._expected is None:
            return None
        given, has_body = None, False
        for name, value in headers:
            if name == b"authorization" and given is None:
                given = value
            elif name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" 0")):
                has_body = True
        if given is not None and hmac.compare_digest(given, self._expected):
            return None
        if path.startswith("/v1") or path in self.KEYED_PATHS or has_body:
            return unauthorized("Invalid or missing API key (Authorization: Bearer ...)")
        return None


class APIKeyMiddleware:
    """``/v1/*``, and any request with a body, needs ``Authorization: Bearer KEY`` (``RequestGate``),
    answered before the body is read. Plain ASGI: Starlette's BaseHTTPMiddleware would relay every
    streamed chunk through a memory stream (a quarter of the router's CPU when streaming)."""

    def __init__(self, app: Any, gate: RequestGate, reject: Callable[[APIError], Response]) -> None:
        self.app = app
        self.gate = gate
        self.reject = reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and (error := self.gate.refusal(scope["path"], scope["headers"])) is not None:
            response = self.reject(error)
            response.headers["connection"] = "close"  # its body is not read
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
