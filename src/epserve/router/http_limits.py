"""What one HTTP client may hold of the router: how big its request may be, how long its headers and
its body may take, and how many generations one request may fan out to.

- Headers: :func:`http_protocol` is uvicorn's h11 protocol with a deadline for the request headers,
  counted from the connection (or, on a kept-alive connection, from the next request's first byte):
  a connection still short of a complete request head then is closed. uvicorn has none of its own,
  so without it a client that sends half a request line holds its socket for ever.
- Body: :class:`RequestLimitsMiddleware` reads the whole body before the app runs: 413 when
  ``Content-Length`` or the bytes received (chunked) pass ``max_request_bytes``, 408 when the body is
  not complete ``body_timeout_s`` after the headers; a client that hangs up first is counted (499)
  and forgotten. It is also the catch-all for unexpected exceptions: a generic 500 whose id is in the
  log, never the exception's text, and the connection stays usable.

Plain ASGI: Starlette's BaseHTTPMiddleware would relay every streamed chunk through a memory stream.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from epserve.router.errors import APIError, internal_error, request_timeout, request_too_large

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HTTPLimits:
    max_request_bytes: int = 4 << 20
    max_choices_per_request: int = 256  # prompts x n
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # an idle kept-alive connection is closed after this

    def __post_init__(self) -> None:
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if self.max_choices_per_request < 1:
            raise ValueError(f"--max-choices-per-request must be at least 1, got {self.max_choices_per_request}")
        for flag, value in (("--header-timeout", self.header_timeout_s), ("--body-timeout", self.body_timeout_s),
                            ("--keep-alive-timeout", self.keep_alive_timeout_s)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")


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
        chunks: list[bytes] = []
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
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def http_protocol(header_timeout_s: float) -> type:
    """uvicorn's h11 protocol class (``uvicorn.Config(http=...)``) with a deadline for request heads."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # part of the next request head: its clock starts now
                if self._header_timer is None:
                    self._arm()
            elif self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("closing a connection from %s: no request head within %g s", self.client,
                             header_timeout_s)
                self.transport.close()

    return HeaderDeadlineH11
