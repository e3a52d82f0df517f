"""A rank serving online: its step loop (:mod:`epserve.serve.engine_loop`) and, on a DP group's
leader, the gRPC engine service in front of it.

Threads of a rank process:

- the **step loop** on the main thread (a forward in another thread ran 1.5x slower on CPU, its
  OpenMP team performing worse than one thread);
- on leaders, the **gRPC server**: an asyncio loop in a thread of its own. ``Generate`` checks a
  request (:meth:`LLMEngine.make_request`), queues it for the step loop and streams what the loop
  delivers for it; a cancelled call (the client went away) queues an abort, which frees the
  request's KV blocks. Only typed messages cross between the two threads;
- a **signal watcher**: SIGTERM/SIGINT make the rank vote to stop (``EngineLoop.request_stop``).

:func:`serving_rank` is the entry of a spawned serving rank (``spawn_ranks(config, serving_rank, ...)``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import socket
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epserve.config import EngineConfig
from epserve.engine.worker import EngineWorker, start_rank
from epserve.parallel.context import set_collective_timeout, store_client
from epserve.parallel.launch import RankInfo
from epserve.serve.engine_auth import TokenCheck
from epserve.serve.engine_loop import (
    AbortRequest,
    AddRequest,
    EngineLoop,
    GeneratedTokens,
    RequestFailed,
    ServeOptions,
)
from epserve.serve.proto import engine_pb2 as pb
from epserve.serve.proto import engine_pb2_grpc as pb_grpc
from epserve.serve.rpc import GRPC_OPTIONS, SERVICE_NAME, expert_load_to_proto, sampling_from_proto
from epserve.serve.signals import SignalWatcher

__all__ = ["EngineServer", "ServeOptions", "Serve", "serving_rank"]

logger = logging.getLogger(__name__)

_STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "unavailable": grpc.StatusCode.UNAVAILABLE}


def advertised_host(host: str) -> str:
    return socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host


class ResponseStream:
    """One Generate call's messages not yet sent (on the gRPC loop only; a reader that fell behind
    takes everything at once and sends it as one message)."""

    __slots__ = ("items", "ready")

    def __init__(self) -> None:
        self.items: collections.deque[pb.GenerateResponse | RequestFailed] = collections.deque()
        self.ready = asyncio.Event()

    def push(self, item: pb.GenerateResponse | RequestFailed) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[pb.GenerateResponse | RequestFailed]:
        await self.ready.wait()
        self.ready.clear()
        items = list(self.items)
        self.items.clear()
        return items


def _to_proto(out: GeneratedTokens) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        token_ids=out.token_ids, num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens, finish_reason=out.finish_reason or "",
    )
    for lp in out.logprobs:
        msg.logprobs.add(logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    return msg


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
    """The gRPC methods (on the leader's asyncio loop) and the loop's :class:`Frontend`: ``deliver``
    and ``set_draining`` come from the step loop's thread and hop onto the asyncio loop."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self.engine_loop = engine_loop
        self.streams: dict[str, ResponseStream] = {}  # the asyncio loop's only
        self.aio_loop: asyncio.AbstractEventLoop | None = None
        self.health = health.aio.HealthServicer()

    # ---- the step loop's thread ----------------------------------------------------------------
    def deliver(self, outputs: list[GeneratedTokens | RequestFailed]) -> None:
        if self.aio_loop is not None:
            try:
                self.aio_loop.call_soon_threadsafe(self._route, outputs)
            except RuntimeError:  # the gRPC loop is gone (shutting down)
                pass

    def set_draining(self) -> None:
        if self.aio_loop is not None:
            asyncio.run_coroutine_threadsafe(self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING), self.aio_loop)

    # ---- the asyncio loop ----------------------------------------------------------------------
    def _route(self, outputs: list[GeneratedTokens | RequestFailed]) -> None:
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if isinstance(out, RequestFailed):
                del self.streams[out.request_id]
                stream.push(out)
                continue
            if out.finish_reason is not None:
                del self.streams[out.request_id]
            stream.push(_to_proto(out))

    async def watch(self, step_timeout_s: float) -> None:
        """The step watchdog: when the loop's current pass has run past ``step_timeout_s`` (a rank hung
        or died, and the step waits on it in a collective), the instance reports NOT_SERVING (health,
        ``GetLoad.stalled``), every stream in flight ends as unavailable, and new calls are refused,
        until the loop moves again. Runs on the gRPC loop, which a stalled step loop does not block."""
        loop, stalled = self.engine_loop, False
        while True:
            await asyncio.sleep(min(1.0, step_timeout_s / 4))
            now = loop.stalled
            if now and not stalled:
                logger.error("engine instance %d: no step progress for %.0f s (a rank hung or died); not serving",
                             loop.ctx.dp_rank, loop.stalled_for())
                await self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                self._fail_all(f"the engine stalled: a step made no progress for {step_timeout_s:g} s")
            elif stalled and not now:
                logger.warning("engine instance %d: steps progress again", loop.ctx.dp_rank)
                if not (loop.draining or loop.stop_requested):
                    await self.set_health(health_pb2.HealthCheckResponse.SERVING)
            stalled = now

    def _fail_all(self, message: str) -> None:
        """End every stream as unavailable; the loop aborts their requests when it moves again."""
        for rid, stream in list(self.streams.items()):
            del self.streams[rid]
            stream.push(RequestFailed(rid, "unavailable", message))
            self.engine_loop.submit(AbortRequest(rid), ring=False)  # the loop is busy: no ring needed

    async def set_health(self, status: int) -> None:
        """The standard health status of the server as a whole and of the engine service."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        loop = self.engine_loop
        if loop.draining or loop.stop_requested:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        if loop.stalled:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is stalled (a rank hung or died)")
        rid = request.request_id
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if rid in self.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        try:
            params = sampling_from_proto(request.sampling_params)
            checked = loop.engine.make_request(rid, list(request.prompt_token_ids), params)
        except ValueError as e:  # RequestError included
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = self.streams[rid] = ResponseStream()
        loop.submit(AddRequest(checked))
        finished = False
        try:
            while True:
                items = await stream.take()
                msgs = [i for i in items if isinstance(i, pb.GenerateResponse)]
                if msgs:
                    msg = msgs[0] if len(msgs) == 1 else _merge(msgs)
                    yield msg
                    if msg.finish_reason:
                        finished = True
                        return
                failure = next((i for i in items if isinstance(i, RequestFailed)), None)
                if failure is not None:
                    finished = True
                    await context.abort(_STATUS[failure.reason], failure.message)
        finally:
            if not finished:  # cancelled: the client went away or gave up
                self.streams.pop(rid, None)
                loop.submit(AbortRequest(rid))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        found = request.request_id in self.streams
        if found:
            self.engine_loop.submit(AbortRequest(request.request_id))
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:  # noqa: N802
        return pb.GetLoadResponse(**dataclasses.asdict(self.engine_loop.load()))

    async def GetExpertLoad(self, request: pb.GetExpertLoadRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext) -> pb.GetExpertLoadResponse:
        load = self.engine_loop.expert_load_total
        return expert_load_to_proto(load) if load is not None else pb.GetExpertLoadResponse()

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.GetInfoResponse:  # noqa: N802
        engine, ctx = self.engine_loop.engine, self.engine_loop.ctx
        config = engine.config
        return pb.GetInfoResponse(
            model_path=config.model_path, max_model_len=config.max_model_len, vocab_size=config.model.vocab_size,
            dp_rank=ctx.dp_rank, dp=ctx.dp, tp=ctx.tp, block_size=engine.runner.block_size,
            num_blocks=engine.runner.num_blocks, eos_token_ids=list(config.model.eos_token_ids),
        )


class EngineServer:
    """One rank serving: the step loop in the calling thread, and on a leader the gRPC service in a
    thread of its own, until every rank has stopped."""

    def __init__(self, worker: EngineWorker, options: ServeOptions) -> None:
        self.loop = EngineLoop(worker, options)
        self.ctx = worker.ctx
        self.options = options
        self.rendezvous = worker.rendezvous
        self.address: str | None = None  # host:port of the gRPC service (leaders), once it listens
        self._service: EngineService | None = None
        self._grpc_stop: asyncio.Event | None = None
        self._grpc_thread: threading.Thread | None = None

    @property
    def draining(self) -> bool:
        return self.loop.draining

    def request_stop(self) -> None:
        self.loop.request_stop()

    def serve(self) -> None:
        signals = SignalWatcher(self.loop.request_stop) if threading.current_thread() is threading.main_thread() else None
        try:
            if self.ctx.is_leader:
                self._service = EngineService(self.loop)
                self._start_grpc(self._service)
                logger.info("engine instance %d serving gRPC on %s", self.ctx.dp_rank, self.address)
            set_collective_timeout(self.ctx, self.options.collective_timeout_s)  # start-up had longer
            self.loop.run(self._service)
        finally:
            self._stop_grpc()
            if signals is not None:
                signals.close()
        logger.info("rank %d stopped serving", self.ctx.rank)

    def _start_grpc(self, service: EngineService) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            aio_loop = asyncio.new_event_loop()
            asyncio.set_event_loop(aio_loop)
            try:
                aio_loop.run_until_complete(self._grpc_main(service, ready))
            except BaseException as e:
                failure.append(e)
                ready.set()
            finally:
                aio_loop.close()

        self._grpc_thread = threading.Thread(target=run, name="grpc", daemon=True)
        self._grpc_thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"gRPC server of engine instance {self.ctx.dp_rank} failed to start: {failure[0]}")
        if self.rendezvous is not None:  # how `epserve serve` learns where the leaders listen
            store_client(*self.rendezvous).set(f"engines/{self.ctx.dp_rank}", self.address.encode())  # type: ignore[union-attr]

    async def _grpc_main(self, service: EngineService, ready: threading.Event) -> None:
        service.aio_loop = asyncio.get_running_loop()
        self._grpc_stop = asyncio.Event()
        token = self.options.token
        server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=[TokenCheck(token)] if token else None)
        pb_grpc.add_EngineServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
        port = self.options.port_of(self.ctx.dp_rank)
        try:
            bound = server.add_insecure_port(f"{self.options.host}:{port}")
        except RuntimeError as e:
            raise RuntimeError(f"cannot listen on {self.options.host}:{port}: {e}") from None
        await server.start()
        await service.set_health(health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{advertised_host(self.options.host)}:{bound}"
        watchdog = asyncio.create_task(service.watch(self.options.step_timeout_s))
        ready.set()
        await self._grpc_stop.wait()
        watchdog.cancel()
        await server.stop(grace=2.0)

    def _stop_grpc(self) -> None:
        service, thread = self._service, self._grpc_thread
        if service is None or service.aio_loop is None or self._grpc_stop is None or thread is None:
            return
        try:
            service.aio_loop.call_soon_threadsafe(self._grpc_stop.set)
        except RuntimeError:
            pass
        thread.join(10.0)


# ---- a spawned serving rank -------------------------------------------------------------------------
@dataclass(frozen=True)
class Serve:
    """The one command of a serving rank: serve until every rank has stopped."""


class ServingRank:
    def __init__(self, worker: EngineWorker, options: ServeOptions) -> None:
        self.worker = worker
        self.options = options

    def handle(self, command: Serve) -> None:
        if not isinstance(command, Serve):
            raise TypeError(f"a serving rank takes Serve, not {command!r}")
        EngineServer(self.worker, self.options).serve()

    def close(self) -> None:
        self.worker.close()


def serving_rank(info: RankInfo, config: EngineConfig, log_level: int, options: ServeOptions) -> ServingRank:
    """Entry of a spawned serving rank: the rank's worker, which serves on :class:`Serve`."""
    return ServingRank(start_rank(info, config, log_level), options)
