"""The gRPC engine service of a DP group's leader, in front of its step loop
(:mod:`epserve.engine.loop`): ``Generate`` checks a request (:meth:`LLMEngine.check_request`), queues
it for the step loop and streams what the loop delivers for it; a cancelled call (the client went
away) queues an abort, which frees the request's KV blocks. Only typed messages cross between the
step loop's thread and the service's asyncio loop. The rank around it: :mod:`.server`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2

from epserve.engine.loop import EngineLoop
from epserve.engine_server.kv_transport import (
    GrpcKVTransport,
    KVTransferError,
    KVTransferStats,
    KVTransport,
)
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.streams import ResponseStream, merge_responses
from epserve.messages.engine import AbortRequest, AddRequest, KVReceived, LoopOutput, RequestFailed
from epserve.messages.kv import KVTransferRole, KVWanted, PrefilledKV, PrefillJob
from epserve.rpc.convert import (
    SERVICE_NAME,
    expert_load_to_proto,
    generated_to_proto,
    layout_from_proto,
    layout_to_proto,
    load_to_proto,
    sampling_from_proto,
)
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc

__all__ = ["EngineService"]

logger = logging.getLogger(__name__)

# ABORTED is kept for "the prefill instance failed": the router retries the request on another one.
_STATUS = {"invalid": grpc.StatusCode.INVALID_ARGUMENT, "unavailable": grpc.StatusCode.UNAVAILABLE,
           "prefill": grpc.StatusCode.ABORTED}


class EngineService(pb_grpc.EngineServicer):
    """The gRPC methods (on the leader's asyncio loop) and the loop's :class:`Frontend`: ``deliver``
    and ``set_draining`` come from the step loop's thread and hop onto the asyncio loop."""

    def __init__(self, engine_loop: EngineLoop, options: ServeOptions, transport: KVTransport | None = None) -> None:
        self.engine_loop = engine_loop
        self.options = options
        self.streams: dict[str, ResponseStream] = {}  # the asyncio loop's only
        self.aio_loop: asyncio.AbstractEventLoop | None = None
        self.health = health.aio.HealthServicer()
        # Prefill/decode disaggregation: the transfer channel, this instance's KV layout, and on a decode
        # instance the requests whose prefill runs elsewhere (address, request) and their transfers.
        self.transport = transport if transport is not None else GrpcKVTransport(options.token)
        self.layout = engine_loop.engine.runner.kv_layout()
        self.kv_stats = KVTransferStats()
        self._remote: dict[str, tuple[str, AddRequest]] = {}
        self._fetches: dict[str, asyncio.Task] = {}

    # ---- the step loop's thread ----------------------------------------------------------------
    def deliver(self, outputs: list[LoopOutput]) -> None:
        if self.aio_loop is not None:
            try:
                self.aio_loop.call_soon_threadsafe(self._route, outputs)
            except RuntimeError:  # the gRPC loop is gone (shutting down)
                pass

    def set_draining(self) -> None:
        if self.aio_loop is not None:
            asyncio.run_coroutine_threadsafe(self.set_health(health_pb2.HealthCheckResponse.NOT_SERVING), self.aio_loop)

    # ---- the asyncio loop ----------------------------------------------------------------------
    def _route(self, outputs: list[LoopOutput]) -> None:
        for out in outputs:
            if isinstance(out, KVWanted):
                self._start_fetch(out)
                continue
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if isinstance(out, (RequestFailed, PrefilledKV)):
                del self.streams[out.request_id]
                stream.push(out)
                continue
            if out.finish_reason is not None:
                del self.streams[out.request_id]
            stream.push(generated_to_proto(out))

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

    async def _admit(self, rid: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse a call while the engine cannot take requests, or for an empty or running id."""
        loop = self.engine_loop
        if loop.draining or loop.stop_requested:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down")
        if loop.stalled:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is stalled (a rank hung or died)")
        if not rid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if rid in self.streams:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is already running")
        if rid in self.engine_loop.requests:  # its call ended, the loop has not stopped it yet
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request id {rid!r} is still being stopped")

    async def _start(self, rid: str, prompt: list[int], sampling: pb.SamplingParams, context: grpc.aio.ServicerContext,
                     kv_transfer: KVTransferRole | None = None, kv_first_block: int = 0,
                     ) -> tuple[AddRequest, ResponseStream]:
        """Check the request (INVALID_ARGUMENT with the reason), open its stream and queue it."""
        try:
            checked = self.engine_loop.engine.check_request(AddRequest(
                rid, tuple(prompt), sampling_from_proto(sampling), kv_transfer, kv_first_block))
        except ValueError as e:  # RequestError included
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stream = self.streams[rid] = ResponseStream()
        self.engine_loop.submit(checked)
        return checked, stream

    def _cancel(self, rid: str) -> None:
        """A call that ended before its request did (the caller went away or gave up): abort it."""
        self.streams.pop(rid, None)
        self.engine_loop.submit(AbortRequest(rid))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        rid, remote = request.request_id, request.prefill_address
        await self._admit(rid, context)
        role = self.options.role
        if role == "prefill" or (role == "decode" and not remote):
            why = ("a prefill instance only prefills for decode instances" if role == "prefill" else
                   "a decode instance decodes requests prefilled elsewhere: route through a router with --prefill")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        checked, stream = await self._start(rid, list(request.prompt_token_ids), request.sampling_params, context,
                                            kv_transfer="receive" if remote else None)
        if remote:  # (the loop's KVWanted for it reaches this asyncio loop after this line)
            self._remote[rid] = (remote, checked)
        finished = False
        try:
            while True:
                items = await stream.take()
                msgs = [i for i in items if isinstance(i, pb.GenerateResponse)]
                if msgs:
                    msg = msgs[0] if len(msgs) == 1 else merge_responses(msgs)
                    yield msg
                    if msg.finish_reason:
                        finished = True
                        return
                failure = next((i for i in items if isinstance(i, RequestFailed)), None)
                if failure is not None:
                    finished = True
                    await context.abort(_STATUS[failure.reason], failure.message)
        finally:
            self._remote.pop(rid, None)
            fetch = self._fetches.pop(rid, None)
            if fetch is not None:
                fetch.cancel()  # cancels the prefill instance's call too
            if not finished:  # cancelled: the client went away or gave up
                self._cancel(rid)

    # ---- prefill/decode disaggregation ---------------------------------------------------------
    def _start_fetch(self, wanted: KVWanted) -> None:
        """Decode side: the request's blocks are allocated; fetch its KV from its prefill instance."""
        remote = self._remote.get(wanted.request_id)
        if remote is None:  # its call ended meanwhile (the loop aborts the request)
            return
        address, request = remote
        job = PrefillJob(request.request_id, request.prompt_token_ids, request.params, wanted.first_block,
                         wanted.num_blocks, self.layout)
        self._fetches[request.request_id] = asyncio.ensure_future(self._fetch(address, job))

    async def _fetch(self, address: str, job: PrefillJob) -> None:
        rid, start, timeout = job.request_id, time.monotonic(), self.options.kv_transfer_timeout_s
        try:
            vocab = self.engine_loop.engine.config.model.vocab_size  # a peer's reply, checked like a client's
            arrival = await asyncio.wait_for(self.transport.receive_checked(address, job, vocab), timeout)
        except (KVTransferError, asyncio.TimeoutError) as e:
            why = str(e) if isinstance(e, KVTransferError) else f"the KV transfer took longer than {timeout:g} s"
            logger.warning("request %s: KV transfer from %s failed: %s", rid, address, why)
            self.kv_stats.failures += 1
            self._fetches.pop(rid, None)
            stream = self.streams.get(rid)
            if stream is not None:
                invalid = isinstance(e, KVTransferError) and e.invalid
                stream.push(RequestFailed(rid, "invalid" if invalid else "prefill", why))
            self._cancel(rid)  # frees its blocks
            return
        self._fetches.pop(rid, None)
        self.kv_stats.received(arrival.data.numel(), time.monotonic() - start)
        self.engine_loop.submit(KVReceived(arrival))

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        """Prefill side: run the prompt, then stream its blocks and first token to the decode instance."""
        rid = f"{request.request_id}@prefill" if request.request_id else ""
        await self._admit(rid, context)
        if self.options.role == "decode":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "a decode instance does not prefill for others")
        why = self.layout.mismatch(layout_from_proto(request.layout))
        if why is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        _, stream = await self._start(rid, list(request.prompt_token_ids), request.sampling_params, context,
                                      kv_transfer="send", kv_first_block=request.first_block)
        finished = False
        try:
            while not finished:
                for item in await stream.take():
                    if isinstance(item, PrefilledKV):
                        finished = True  # its blocks are free already: a cancelled send just drops the copy
                        self.kv_stats.bytes_sent += item.data.numel()  # before the last yield: the caller
                        for chunk in self.transport.send(item):     # may close the call on the last chunk
                            yield chunk
                        return
                    finished = True  # a failure, or its abort (a drain timeout)
                    reason = item.reason if isinstance(item, RequestFailed) else "unavailable"
                    message = item.message if isinstance(item, RequestFailed) else "the prefill was aborted"
                    await context.abort(_STATUS[reason], message)
        finally:
            if not finished:  # the decode instance went away or gave up
                self._cancel(rid)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        found = request.request_id in self.streams
        if found:
            self.engine_loop.submit(AbortRequest(request.request_id))
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:  # noqa: N802
        return load_to_proto(self.engine_loop.load(), **self.kv_stats.proto_fields())

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
            role=self.options.role, kv_layout=layout_to_proto(self.layout),
            cache_dtype=config.cache.kv_cache_dtype, enable_prefix_caching=config.cache.enable_prefix_caching,
        )
