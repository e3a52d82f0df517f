"""The router's HTTP connections: :func:`http_protocol` is uvicorn's h11 protocol with

- a cap on open connections (``HTTPLimits.max_connections``): one past it is answered a 503
  ``too_many_connections`` as it opens, without reading anything from it, and closed;
- the API key checked from each request head (``http_limits.RequestGate``) before any byte of its body
  is read: a request without it gets the 401 at once and its body is never buffered;
- the bytes of request bodies held at once bounded over all clients and for each client (a peer
  address; ``body_budget``): a request's declared ``Content-Length`` is held from its head, a chunked
  body's chunks as they arrive, until its handler returns; a request that does not fit gets a 429 (its
  client holds too much) or 503 (the router does) ``too_many_request_bytes`` before any more of its
  body is read (a chunked one mid-body: its handler sees the client gone);
- a deadline for the request headers, counted from the connection (or, on a kept-alive connection,
  from the next request's first byte): a connection still short of a complete request head then is
  closed. uvicorn has none of its own, so without it a client that sends half a request line holds
  its socket for ever.

A refused connection is closed after a short lingering close: what its client still sends is read
and dropped for at most ``_LINGER_S`` and ``_LINGER_BYTES`` (so that the client, having finished
sending, reads the error rather than a reset), then it is closed. Refusals are counted (the metrics'
``request_errors_total``) and logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
import math
from typing import Any
from urllib.parse import unquote

from epserve.router.body_budget import BodyBudget, BodyHold
from epserve.router.errors import APIError, too_many_connections
from epserve.router.http_limits import HTTPLimits, RequestGate

logger = logging.getLogger(__name__)

_LINGER_S = 2.0  # a refused connection is closed this long after its answer at the latest ...
_LINGER_BYTES = 256 << 10  # ... or once its client has sent this much more (read and dropped)
_REPORT_EVERY_S = 60.0


def _raw_response(error: APIError, head_only: bool = False) -> bytes:
    """``error`` as a whole HTTP/1.1 response that closes the connection (as Starlette's JSONResponse
    would encode its body); a 429 or 503 tells the client to retry after a second."""
    body = json.dumps(error.body(), ensure_ascii=False, separators=(",", ":")).encode()
    retry = "retry-after: 1\r\n" if error.status in (429, 503) else ""
    head = (f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n").encode()
    return head if head_only else head + body


class _Refusals:
    """Refusals of one kind: logged once (``first``), then at most once a minute (``later``, formatted
    with their ``count``)."""

    def __init__(self, first: str, later: str) -> None:
        self.first, self.later = first, later
        self.unreported = 0
        self.last_report = -math.inf
        self.timer: asyncio.TimerHandle | None = None

    def add(self, loop: asyncio.AbstractEventLoop) -> None:
        self.unreported += 1
        if loop.time() - self.last_report >= _REPORT_EVERY_S:
            self.report(loop)
        elif self.timer is None:
            self.timer = loop.call_at(self.last_report + _REPORT_EVERY_S, self.report, loop)

    def report(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        if not self.unreported:
            return
        logger.warning(self.first if self.last_report == -math.inf else self.later.format(count=self.unreported))
        self.unreported, self.last_report = 0, loop.time()


def http_protocol(limits: HTTPLimits, gate: RequestGate | None = None) -> type:
    """uvicorn's h11 protocol class (``uvicorn.Config(http=...)``) with the router's connection cap,
    request-head check and header deadline (the module docstring)."""
    import h11
    from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
    from uvicorn.protocols.http.h11_impl import H11Protocol

    gate = gate or RequestGate(None)
    header_timeout_s, max_connections = limits.header_timeout_s, limits.max_connections
    over_cap = _raw_response(too_many_connections(max_connections))
    refusals = _Refusals(f"refusing connections: {max_connections} are open (--max-connections); refusals are "
                         "counted as request_errors_total{status=\"503\"} and logged at most once a minute",
                         f"refused {{count}} connection(s) over --max-connections {max_connections} in the last minute")
    budget = BodyBudget(*limits.body_budget)
    over_budget = _Refusals(f"refusing request bodies: clients hold {budget.total} bytes of them (--max-body-bytes), "
                            f"or one client {budget.per_client} (--max-client-body-bytes); refusals are counted "
                            "as request_errors_total{status=\"429\" or \"503\"} and logged at most once a minute",
                            "refused {count} request(s) over the request-body budget in the last minute")
    lingering_over_cap = [0]  # connections refused for the cap, still lingering (they hold a socket each)

    def check_head(event: h11.Request) -> tuple[APIError, bool] | None:
        path = unquote(event.target.partition(b"?")[0].decode("ascii"))  # as uvicorn makes scope["path"]
        error = gate.refusal(path, event.headers)  # (h11 gives lower-case names)
        return None if error is None else (error, event.method == b"HEAD")

    class CheckedConnection(h11.Connection):
        """h11's server side, which holds back a request head the gate refuses, or whose body does not
        fit the budget: uvicorn sees no request (and reads none of its body); the protocol answers it.
        Likewise a chunked body's chunk that does not fit: uvicorn gets no more of it."""

        refused: tuple[APIError, bool] | None = None
        hold: BodyHold | None = None  # the bytes held for the request whose body arrives now
        chunked = False  # ... taken as its chunks arrive (else its Content-Length was, from its head)

        def __init__(self, client: str, max_incomplete_event_size: int = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE) -> None:
            super().__init__(h11.SERVER, max_incomplete_event_size)
            self.client = client  # the peer address: whose budget its bodies count in

        def next_event(self) -> Any:
            if self.refused is not None:
                return h11.NEED_DATA
            event = super().next_event()
            if isinstance(event, h11.Request):
                refused = check_head(event)
                if refused is None and (error := self._hold_body(event.headers)) is not None:
                    refused = error, event.method == b"HEAD"
                if refused is not None:
                    self.refused = refused
                    return h11.NEED_DATA
            elif isinstance(event, h11.Data) and self.chunked and self.hold is not None:
                if (error := self.hold.take(len(event.data))) is not None:
                    over_budget.add(asyncio.get_running_loop())
                    self.hold.release()
                    self.refused = error, False
                    return h11.NEED_DATA
            return event

        def _hold_body(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
            """Hold the request's declared body (one past ``max_request_bytes``: none, the 413 reads none
            of it); the refusal when it does not fit."""
            length = next((int(v) for k, v in headers if k == b"content-length"), 0)  # (h11 checked it)
            self.chunked = any(k == b"transfer-encoding" for k, _ in headers)
            self.hold = budget.hold(self.client)
            error = self.hold.take(length if length <= limits.max_request_bytes else 0)
            if error is not None:
                over_budget.add(asyncio.get_running_loop())
                self.hold = None
            return error

    class RouterH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _lingering = False  # refused and answered: what the client still sends is dropped
        _linger_left = 0  # bytes more to drop before closing
        _over_cap = False  # refused as it opened (uvicorn never knew of it)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            size = self.config.h11_max_incomplete_event_size
            self._event_size = DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if size is None else size
            self.conn = CheckedConnection("", self._event_size)
            app = self.app

            async def held(scope: dict, receive: Any, send: Any) -> None:
                hold = self.conn.hold  # its request's (the next head is read only after its response)
                try:
                    await app(scope, receive, send)
                finally:
                    if hold is not None:
                        hold.release()

            self.app = held

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if len(self.connections) < max_connections:
                super().connection_made(transport)
                self.conn.client = self.client[0] if self.client else ""
                self._arm()
                return
            self.transport = transport
            gate.on_refused(503)
            refusals.add(self.loop)
            transport.write(over_cap)
            if lingering_over_cap[0] < max_connections:  # (each holds a socket meanwhile)
                lingering_over_cap[0] += 1
                self._over_cap = True
                self._linger()
            else:
                transport.close()

        def data_received(self, data: bytes) -> None:
            if self._lingering:
                self._linger_left -= len(data)
                if self._linger_left <= 0:
                    self.transport.close()
                return
            super().data_received(data)  # -> handle_events
            if self._lingering:
                return
            if self.conn.their_state is h11.IDLE:  # part of the next request head: its clock starts now
                if self._header_timer is None:
                    self._arm()
            else:
                self._cancel_header_timer()

        def handle_events(self) -> None:
            super().handle_events()
            if not self._lingering and self.conn.refused is not None:
                error, head_only = self.conn.refused
                gate.on_refused(error.status)
                self._unset_keepalive_if_required()
                self._cancel_header_timer()
                self.conn = CheckedConnection(self.conn.client, self._event_size)  # drops what h11 buffered
                cycle, self.cycle = self.cycle, None  # (before a refused head: complete; it held the old h11)
                if cycle is not None and not cycle.response_complete:  # a chunked body refused midway
                    cycle.disconnected = True  # its handler, waiting for the body, sees the client gone
                    cycle.message_event.set()
                    if cycle.response_started:  # (it was answering already: that answer is cut short)
                        self.transport.close()
                        return
                self.transport.write(_raw_response(error, head_only))
                self._linger()

        def _linger(self) -> None:
            self._lingering, self._linger_left = True, _LINGER_BYTES
            self._linger_timer = self.loop.call_later(_LINGER_S, self.transport.close)
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the answer, then EOF; a client that closes too ends it at once

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            if self._over_cap:
                lingering_over_cap[0] -= 1
            if self.flow is not None:  # (None: refused as it opened)
                super().connection_lost(exc)

        def shutdown(self) -> None:
            if self._lingering:
                self.transport.close()
            else:
                super().shutdown()

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.debug("closing a connection from %s: no request head within %g s", self.client,
                             header_timeout_s)
                self.transport.close()

    return RouterH11
