"""The leader's gRPC engine service: the methods (on the gRPC asyncio loop) and the per-call streams
the step loop fills (see :mod:`epserve.serve.engine_server`)."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

import grpc

from epserve.engine.request import Request
from epserve.serve.proto import engine_pb2 as pb
from epserve.serve.proto import engine_pb2_grpc as pb_grpc
from epserve.serve.rpc import sampling_from_proto

if TYPE_CHECKING:
    from epserve.serve.engine_server import EngineServer


class Failure:
    __slots__ = ("code", "message")

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


class ResponseStream:
    """One Generate call: what the step loop produced for it and not yet sent (read on the gRPC loop;
    a reader that fell behind takes everything at once and sends it as one message)."""

    __slots__ = ("items", "ready", "loop", "request", "want_logprobs")

    def __init__(self, loop: asyncio.AbstractEventLoop, want_logprobs: bool) -> None:
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()
        self.loop = loop
        self.request: Request | None = None
        self.want_logprobs = want_logprobs

    def push(self, item: object) -> None:
        """On the gRPC loop."""
        self.items.append(item)
        self.ready.set()

    def put(self, item: object) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self.push, item)
        except RuntimeError:  # the gRPC loop is gone (shutting down)
            pass

    async def take(self) -> list:
        await self.ready.wait()
        self.ready.clear()
        items = list(self.items)
        self.items.clear()
        return items


def deliver(items: list[tuple[ResponseStream, pb.GenerateResponse]]) -> None:
    for stream, msg in items:
        stream.push(msg)


def _merge(msgs: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """Messages a slow reader let pile up, as one (tokens and logprobs in order, the latest counts)."""
    merged = pb.GenerateResponse()
    merged.CopyFrom(msgs[-1])
    del merged.token_ids[:]
    del merged.logprobs[:]
    for m in msgs:
        merged.token_ids.extend(m.token_ids)
        merged.logprobs.extend(m.logprobs)
    return merged


class EngineService(pb_grpc.EngineServicer):
    """The gRPC methods; they run on the leader's asyncio loop and only queue work for the step
    loop (requests are checked here, so a bad one fails its call without touching the loop)."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        server = self.server
        if server.draining or server.stop_requested:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if rid in server.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        token_ids = list(request.prompt_token_ids)
        try:
            params = sampling_from_proto(request.sampling_params)
            server.engine.check_request(rid, token_ids, params)
        except ValueError as e:  # RequestError included
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = ResponseStream(asyncio.get_running_loop(), params.logprobs is not None)
        server.submit(rid, token_ids, params, stream)
        finished = False
        try:
            while True:
                items = await stream.take()
                msgs = [i for i in items if not isinstance(i, Failure)]
                if msgs:
                    msg = msgs[0] if len(msgs) == 1 else _merge(msgs)
                    yield msg
                    if msg.finish_reason:
                        finished = True
                        return
                failure = next((i for i in items if isinstance(i, Failure)), None)
                if failure is not None:
                    finished = True
                    await context.abort(failure.code, failure.message)
        finally:
            if not finished:  # cancelled: the client went away or gave up
                server.streams.pop(rid, None)
                server.abort(rid)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        found = request.request_id in self.server.streams
        if found:
            self.server.abort(request.request_id)
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:  # noqa: N802
        return self.server.load()

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:  # noqa: N802
        return self.server.info()
