"""A response's choices against its HTTP request: awaited until the client disconnects
(:func:`until_disconnect`), run together with the first failure raised as the client's error
(:func:`gather_or_raise`), and, streamed, the Server-Sent Events they become (:func:`sse`; a choice that
failed mid-stream as an error event, :func:`stream_error`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from typing import Any

from fastapi import Request

from epserve.router.engine_client import EngineRequestError, EngineUnavailable
from epserve.router.errors import ENGINE_LOST, APIError, unavailable

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
_START_BATCH = 16  # a request's choices start this many at a time, the loop serving its sockets in between


def stream_error(err: Exception, request_id: str) -> APIError:
    """The error event of a choice that failed mid-stream."""
    if isinstance(err, EngineUnavailable):
        logger.warning("request %s: %s", request_id, err)
        return unavailable(ENGINE_LOST)
    if isinstance(err, EngineRequestError):
        return APIError(str(err))
    logger.error("request %s failed mid-stream", request_id, exc_info=err)
    return APIError("Internal server error (the server's log has the details)", 500, "internal_server_error",
                    "internal_error")


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def start_in_batches(aws: list[Awaitable[Any]], tasks: list[asyncio.Future[Any]]) -> None:
    """Start ``aws`` as tasks, appended to ``tasks`` as they start, ``_START_BATCH`` a turn of the event
    loop (it serves its sockets in between: a request of 256 choices does not hold it while every one
    of them is routed and sent)."""
    for a in aws:
        if tasks and len(tasks) % _START_BATCH == 0:
            await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(a))


async def gather_or_raise(aws: list[Awaitable[Any]], request_id: str) -> None:
    """Await all (started in batches: ``start_in_batches``); the first failure cancels the rest and is
    raised as an APIError."""
    tasks: list[asyncio.Future[Any]] = []
    try:
        await start_in_batches(aws, tasks)
        await asyncio.gather(*tasks)
    except EngineUnavailable as e:
        logger.warning("request %s: %s", request_id, e)
        raise unavailable() from None
    except EngineRequestError as e:
        raise APIError(str(e)) from None
    finally:
        for t in tasks:
            t.cancel()
        for a in aws[len(tasks):]:  # (cancelled before they started)
            if asyncio.iscoroutine(a):
                a.close()


async def until_disconnect(raw: Request, aw: Awaitable[Any]) -> Any:
    """Await ``aw``, cancelling it if the HTTP client disconnects first."""
    task = asyncio.ensure_future(aw)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError("client disconnected", 499, "invalid_request_error", "client_closed_request")
