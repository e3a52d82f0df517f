"""How many bytes of request bodies the router holds at once: at most ``total`` over every client and
``per_client`` for one client (a peer address), so that no client, and no crowd of them, makes the
router buffer more than that, whether or not an API key is set (key holders included).

A request's :class:`BodyHold` takes its bytes before any of its body is read: the whole declared
``Content-Length`` from its head, or, for a chunked body, each chunk as it arrives; a request that does
not fit is refused (``http_connections``: 429 ``too_many_request_bytes`` when its client holds too
much, 503 when the router as a whole does) and its body is never buffered. The bytes are given back
when the request's handler has returned (its response sent: the body is garbage by then).

Memory given back by the router is returned to the system (glibc; elsewhere nothing is done):
:func:`map_large_buffers` keeps every buffer of ``LARGE_BUFFER`` bytes or more in a mapping of its
own, unmapped when freed (glibc would otherwise raise its mmap threshold to the largest buffer freed,
up to 32 MiB, and serve the next bodies from the heap, where they stay), and once many bytes have been
given back the heap's free pages are returned too (``malloc_trim``, half a second later: the chunks a
body is read in are smaller, and what they leave free inside the heap would otherwise stay the
router's).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging

from epserve.router.errors import APIError

logger = logging.getLogger(__name__)

LARGE_BUFFER = 512 << 10  # (above a socket read's 256 KiB, so reads stay in the heap)
TRIM_AFTER_BYTES = 32 << 20  # given back since the last trim: worth returning to the system ...
TRIM_DELAY_S = 0.5  # ... this long after (the bodies given back meanwhile trimmed at once)


def client_over_budget(limit: int) -> APIError:
    return APIError(f"This client's requests in flight hold the most request-body bytes this server allows one "
                    f"client ({limit} bytes); retry when some of them have finished", 429, "rate_limit_error",
                    "too_many_request_bytes")


def server_over_budget(limit: int) -> APIError:
    return APIError(f"This server holds the most request-body bytes it allows at once ({limit} bytes); "
                    "try again later", 503, "service_unavailable_error", "too_many_request_bytes")


class BodyBudget:
    """The bytes of bodies held (module docstring); ``hold(client)`` for each request."""

    def __init__(self, total: int, per_client: int) -> None:
        if not 0 < per_client <= total:
            raise ValueError(f"the per-client body budget ({per_client}) must be > 0 and at most the total ({total})")
        self.total, self.per_client = total, per_client
        self.used = 0
        self.by_client: dict[str, int] = {}
        self._freed = 0  # bytes given back since the last trim
        self._trim = _malloc_trim()
        self._trim_due: asyncio.TimerHandle | None = None

    def hold(self, client: str) -> BodyHold:
        return BodyHold(self, client)

    def take(self, client: str, n: int) -> APIError | None:
        """Hold ``n`` more bytes for ``client``; the error to answer, holding nothing more, if they do not fit."""
        held = self.by_client.get(client, 0)
        if held + n > self.per_client:
            return client_over_budget(self.per_client)
        if self.used + n > self.total:
            return server_over_budget(self.total)
        if n:
            self.by_client[client] = held + n
            self.used += n
        return None

    def give_back(self, client: str, n: int) -> None:
        if not n:
            return
        left = self.by_client[client] - n
        if left:
            self.by_client[client] = left
        else:
            del self.by_client[client]
        self.used -= n
        self._freed += n
        if self._freed >= TRIM_AFTER_BYTES and self._trim is not None and self._trim_due is None:
            self._trim_due = asyncio.get_running_loop().call_later(TRIM_DELAY_S, self._trim_now)

    def _trim_now(self) -> None:
        self._trim_due, self._freed = None, 0
        self._trim(0)  # type: ignore[misc]


class BodyHold:
    """One request's bytes held: :meth:`take` more, :meth:`release` them all. Once released it holds
    nothing more (what a client sends after its answer is read and dropped)."""

    __slots__ = ("budget", "client", "held", "released")

    def __init__(self, budget: BodyBudget, client: str) -> None:
        self.budget, self.client, self.held, self.released = budget, client, 0, False

    def take(self, n: int) -> APIError | None:
        if self.released:
            return None
        error = self.budget.take(self.client, n)
        if error is None:
            self.held += n
        return error

    def release(self) -> None:
        held, self.held, self.released = self.held, 0, True
        self.budget.give_back(self.client, held)


def map_large_buffers() -> None:
    """Have glibc map every allocation of ``LARGE_BUFFER`` bytes or more on its own, unmapped when it is
    freed (a fixed mmap threshold: see the module docstring). For the router process, at its start."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        mallopt(-3, LARGE_BUFFER)  # M_MMAP_THRESHOLD


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere: musl, macOS)."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _libc(function: str):
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None
