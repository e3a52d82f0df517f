"""One rank serving online: the lockstep step loop, and on a DP group's leader the gRPC engine service.

Threads of a rank process:

- the **step loop** (the main thread): the leader moves new requests and aborts from the inbox into
  its scheduler, then every rank runs :meth:`LLMEngine.step` together; the leader hands each step's
  new tokens to the gRPC loop. When the step's all-reduce says nobody has work, every rank sleeps
  on the :class:`~epserve.parallel.doorbell.Doorbell` (no spinning) until a leader rings it;
- on leaders, the **gRPC server** (an asyncio loop in a thread): ``Generate`` checks a request,
  queues it, rings, and streams what the step loop produced for it; a cancelled call (the client
  went away) queues an abort, which frees the request's KV blocks;
- a **signal watcher**: SIGTERM/SIGINT make the rank vote to stop in the next all-reduce (ringing
  the doorbell if everyone sleeps), so every leader stops taking requests (UNAVAILABLE, health
  NOT_SERVING), the running ones finish (or are aborted after ``drain_timeout_s``), and all ranks
  leave together.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from epserve.engine.request import SamplingParams
from epserve.engine.scheduler import RequestUpdate
from epserve.engine.worker import EngineWorker
from epserve.moe.stats import ExpertLoad
from epserve.parallel.comm import gather_objects
from epserve.parallel.context import store_client
from epserve.parallel.doorbell import Doorbell, LocalDoorbell
from epserve.serve.engine_service import EngineService, Failure, ResponseStream, deliver
from epserve.serve.proto import engine_pb2 as pb
from epserve.serve.proto import engine_pb2_grpc as pb_grpc
from epserve.serve.rpc import GRPC_OPTIONS, SERVICE_NAME
from epserve.serve.signals import SignalWatcher

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"  # where leaders listen for gRPC
    port: int = 0  # the leader of DP group i listens on port + i; 0 = any free port
    drain_timeout_s: float = 30.0  # after a stop, running requests get this long before they are aborted
    stats_every: int = 64  # forward steps between expert-load gathers (also gathered when going idle)


def advertised_host(host: str) -> str:
    return socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host


class EngineServer:
    def __init__(self, worker: EngineWorker, options: ServeOptions) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.ctx = worker.ctx
        self.options = options
        if worker.rendezvous is not None:
            self.doorbell: Doorbell | LocalDoorbell = Doorbell(*worker.rendezvous)
            self._store = store_client(*worker.rendezvous)
        else:
            self.doorbell, self._store = LocalDoorbell(), None
        self.inbox: collections.deque = collections.deque()
        self.streams: dict[str, ResponseStream] = {}
        self.stop_requested = False  # this rank's vote
        self.draining = False  # some rank voted: take no new requests
        self.address: str | None = None  # host:port of the gRPC service (leaders)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.expert_imbalance = 1.0
        self._stats_at = 0
        self._drain_deadline: float | None = None
        self._error: BaseException | None = None
        self._grpc_loop: asyncio.AbstractEventLoop | None = None
        self._grpc_stop: asyncio.Event | None = None
        self._grpc_thread: threading.Thread | None = None
        self._health: health.aio.HealthServicer | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Run the step loop in this thread (the main thread of a rank process: a forward in another
        thread ran 1.5x slower on CPU, its OpenMP team performing worse than one thread) until every
        rank has stopped."""
        signals = SignalWatcher(self.request_stop) if threading.current_thread() is threading.main_thread() else None
        try:
            if self.ctx.is_leader:
                self._start_grpc()
                logger.info("engine instance %d serving gRPC on %s", self.ctx.dp_rank, self.address)
            self._run_loop()
        finally:
            self._stop_grpc()
            if signals is not None:
                signals.close()
        if self._error is not None:
            raise self._error
        logger.info("rank %d stopped serving", self.ctx.rank)

    def request_stop(self) -> None:
        """Vote to drain and stop (signal handlers call this); wakes sleeping ranks."""
        if not self.stop_requested:
            logger.info("rank %d: stop requested; draining", self.ctx.rank)
        self.stop_requested = True
        self.doorbell.ring()

    # ---- step loop ---------------------------------------------------------------------------
    def _run_loop(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)
        try:
            self._loop()
        except BaseException as e:
            self._error = e
            logger.error("rank %d: step loop failed: %s", self.ctx.rank, e)
            for stream in list(self.streams.values()):
                stream.put(Failure(grpc.StatusCode.UNAVAILABLE, f"engine failed: {e}"))
            self.streams.clear()

    def _loop(self) -> None:
        engine, leader = self.engine, self.ctx.is_leader
        while True:
            if leader:
                self._take_inbox()
                if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                    self._abort_all("drain timeout")
            updates = engine.step(stopping=self.stop_requested)
            if leader:
                self._publish(updates)
            if self.ctx.rank == 0:
                self.doorbell.collect()  # every rank passed the all-reduce, so none waits on the old key
            if engine.anybody_stopping and not self.draining:
                self._start_draining()
            if not engine.anybody_unfinished:
                if engine.num_forwards != self._stats_at:
                    self._gather_stats()
                if engine.anybody_stopping:
                    return
                self.doorbell.wait()
            elif engine.num_forwards - self._stats_at >= self.options.stats_every:
                self._gather_stats()

    def _take_inbox(self) -> None:
        while True:
            try:
                kind, rid, payload = self.inbox.popleft()
            except IndexError:
                return
            if kind == "abort":
                self.engine.abort_request(rid)
                continue
            token_ids, params, stream = payload
            if self.draining:
                self.streams.pop(rid, None)
                stream.put(Failure(grpc.StatusCode.UNAVAILABLE, "the engine is shutting down"))
                continue
            try:
                stream.request = self.engine.add_request(rid, token_ids, params)
            except ValueError as e:  # RequestError, or an id the scheduler already has
                self.streams.pop(rid, None)
                stream.put(Failure(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
                continue
            self.prompt_tokens_total += len(token_ids)

    def _publish(self, updates: list[RequestUpdate]) -> None:
        """Each request's new tokens to its Generate call: one hand-over to the gRPC loop per step
        (not one per request), which saves the loop a wake-up per message."""
        out: list[tuple[ResponseStream, pb.GenerateResponse]] = []
        for update in updates:
            stream = self.streams.get(update.request_id)
            if stream is None or stream.request is None:
                continue
            request = stream.request
            new = update.new_token_ids
            msg = pb.GenerateResponse(
                token_ids=new,
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                num_output_tokens=request.num_output_tokens,
                finish_reason=update.finish_reason or "",  # set only on the last update
            )
            if stream.want_logprobs and new:
                for lp in request.output_logprobs[-len(new):]:
                    msg.logprobs.add(
                        logprob=lp.logprob,  # type: ignore[attr-defined]
                        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],  # type: ignore[attr-defined]
                    )
            self.generation_tokens_total += len(new)
            if update.finished:
                self.streams.pop(update.request_id, None)
            out.append((stream, msg))
        if out and self._grpc_loop is not None:
            try:
                self._grpc_loop.call_soon_threadsafe(deliver, out)
            except RuntimeError:  # the gRPC loop is gone (shutting down)
                pass

    def _abort_all(self, why: str) -> None:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        ids = [r.request_id for r in (*scheduler.running, *scheduler.waiting)]
        if ids:
            logger.warning("aborting %d requests: %s", len(ids), why)
        for rid in ids:
            self.engine.abort_request(rid)

    def _start_draining(self) -> None:
        self.draining = True
        self._drain_deadline = time.monotonic() + self.options.drain_timeout_s
        if self._grpc_loop is not None:
            asyncio.run_coroutine_threadsafe(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING),
                                             self._grpc_loop)

    def _gather_stats(self) -> None:
        """Expert load over the whole EP group (a collective: every rank calls it at the same step)."""
        runner = self.engine.runner
        loads = gather_objects(runner.expert_load(), self.ctx)
        moe_layers = self.engine.config.model.moe_layer_ids
        self.expert_imbalance = ExpertLoad.from_ranks(moe_layers, loads, runner.placement).imbalance  # type: ignore[arg-type]
        self._stats_at = self.engine.num_forwards

    # ---- gRPC side (leaders) ------------------------------------------------------------------
    def submit(self, rid: str, token_ids: list[int], params: SamplingParams, stream: ResponseStream) -> None:
        self.streams[rid] = stream
        self.inbox.append(("add", rid, (token_ids, params, stream)))
        self.doorbell.ring()

    def abort(self, rid: str) -> None:
        self.inbox.append(("abort", rid, None))
        self.doorbell.ring()

    def load(self) -> pb.GetLoadResponse:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        kv = scheduler.kv_manager
        return pb.GetLoadResponse(
            dp_rank=self.ctx.dp_rank,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + sum(1 for kind, _, _ in list(self.inbox) if kind == "add"),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_query_tokens=kv.num_prefix_query_tokens,
            prefix_hit_tokens=kv.num_prefix_hit_tokens,
            expert_imbalance=self.expert_imbalance,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions_total=scheduler.num_preemptions_total,
            draining=self.draining,
        )

    def info(self) -> pb.GetInfoResponse:
        config = self.engine.config
        return pb.GetInfoResponse(
            model_path=config.model_path,
            max_model_len=config.max_model_len,
            vocab_size=config.model.vocab_size,
            dp_rank=self.ctx.dp_rank,
            dp=self.ctx.dp,
            tp=self.ctx.tp,
            block_size=self.engine.runner.block_size,
            num_blocks=self.engine.runner.num_blocks,
            eos_token_ids=list(config.model.eos_token_ids),
        )

    def _start_grpc(self) -> None:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._grpc_main(ready))
            except BaseException as e:
                failure.append(e)
                ready.set()
            finally:
                loop.close()

        self._grpc_thread = threading.Thread(target=run, name="grpc", daemon=True)
        self._grpc_thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"gRPC server of engine instance {self.ctx.dp_rank} failed to start: {failure[0]}")
        if self._store is not None:
            self._store.set(f"engines/{self.ctx.dp_rank}", self.address.encode())  # type: ignore[union-attr]

    async def _grpc_main(self, ready: threading.Event) -> None:
        self._grpc_loop = asyncio.get_running_loop()
        self._grpc_stop = asyncio.Event()
        server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_EngineServicer_to_server(EngineService(self), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        port = self.options.port + self.ctx.dp_rank if self.options.port else 0
        try:
            bound = server.add_insecure_port(f"{self.options.host}:{port}")
        except RuntimeError as e:
            raise RuntimeError(f"cannot listen on {self.options.host}:{port}: {e}") from None
        await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{advertised_host(self.options.host)}:{bound}"
        ready.set()
        await self._grpc_stop.wait()
        await server.stop(grace=2.0)

    async def _set_health(self, status: int) -> None:
        """The standard health status of the server as a whole and of the engine service."""
        if self._health is not None:
            for name in ("", SERVICE_NAME):
                await self._health.set(name, status)

    def _stop_grpc(self) -> None:
        if self._grpc_loop is None or self._grpc_stop is None or self._grpc_thread is None:
            return
        try:
            self._grpc_loop.call_soon_threadsafe(self._grpc_stop.set)
        except RuntimeError:
            pass
        self._grpc_thread.join(10.0)
