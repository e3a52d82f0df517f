"""A rank serving online: its step loop (:mod:`epserve.engine.loop`) and, on a DP group's leader,
the gRPC engine service in front of it (:mod:`.service`).

Threads of a rank process:

- the **step loop** on the main thread (a forward in another thread ran 1.5x slower on CPU, its
  OpenMP team performing worse than one thread);
- on leaders, the **gRPC server**: an asyncio loop in a thread of its own;
- the **doorbell's reader** (``parallel/doorbell.py``): wakes and the world's heartbeat;
- a **signal watcher**: SIGTERM/SIGINT make the rank vote to stop (``EngineLoop.request_stop``).

:func:`serving_rank` is the entry of a spawned serving rank (the launcher's ``EngineRanks`` spawns them):
it serves on :class:`Serve` and tells the launcher where a leader listens (:class:`Listening`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epserve.config import EngineConfig
from epserve.engine.loop import EngineLoop
from epserve.engine.worker import EngineWorker, start_rank
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.service import EngineService
from epserve.engine_server.signals import SignalWatcher
from epserve.parallel.context import set_collective_timeout
from epserve.parallel.doorbell import Doorbell
from epserve.parallel.launch import wait_port_free
from epserve.parallel.process import name_process
from epserve.parallel.spawned import RankInfo, notify_parent
from epserve.rpc.convert import GRPC_OPTIONS
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import listen

__all__ = ["EngineServer", "Listening", "Serve", "serving_rank"]

logger = logging.getLogger(__name__)


def advertised_host(host: str) -> str:
    return socket.getfqdn() if host in ("", "0.0.0.0", "::", "[::]") else host


class EngineServer:
    """One rank serving: the step loop in the calling thread, and on a leader the gRPC service in a
    thread of its own, until every rank has stopped; ``on_listening(dp_rank, address)`` once a leader
    listens (a spawned rank tells its supervisor; under torchrun the address is only logged)."""

    def __init__(self, worker: EngineWorker, options: ServeOptions,
                 on_listening: Callable[[int, str], None] = lambda dp_rank, address: None) -> None:
        bell = (Doorbell(*worker.rendezvous, worker.ctx.rank, options.token, heartbeat_timeout_s=options.step_timeout_s)
                if worker.rendezvous is not None else None)
        self.loop = EngineLoop(worker.engine, options.loop_options(), bell)
        self.ctx = worker.ctx
        self.options = options
        self.on_listening = on_listening
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
        on_main = threading.current_thread() is threading.main_thread()
        signals = SignalWatcher(self.loop.request_stop) if on_main else None
        try:
            if self.ctx.is_leader:
                self._service = EngineService(self.loop, self.options)
                self._start_grpc(self._service)
                logger.info("engine instance %d serving gRPC on %s", self.ctx.dp_rank, self.address)
                self.on_listening(self.ctx.dp_rank, self.address)  # type: ignore[arg-type]
            set_collective_timeout(self.ctx, self.options.collective_timeout_s)  # start-up had longer
            self.loop.run(self._service)
        finally:
            self._stop_grpc()
            self.loop.doorbell.close()
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

    async def _grpc_main(self, service: EngineService, ready: threading.Event) -> None:
        service.aio_loop = asyncio.get_running_loop()
        self._grpc_stop = asyncio.Event()
        server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_EngineServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
        port = self.options.port_of(self.ctx.dp_rank)
        if again := bool(self.options.ports and port):  # a restart's old port (not one the user asked for),
            wait_port_free(self.options.host, port, timeout_s=0.5)  # held a moment by its closing connections
        try:
            bound = listen(server, f"{self.options.host}:{port}", self.options.token)
        except RuntimeError as e:
            if not again:
                raise RuntimeError(f"cannot listen on {self.options.host}:{port}: {e}") from None
            logger.warning("engine instance %d: its old port %d is taken; listening on a fresh one (the "
                           "supervisor tells the router)", self.ctx.dp_rank, port)
            bound = listen(server, f"{self.options.host}:0", self.options.token)
        await server.start()
        await service.set_health(health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{advertised_host(self.options.host)}:{bound}"
        watchdog = asyncio.create_task(service.watch(self.options.step_timeout_s))
        ready.set()
        await self._grpc_stop.wait()
        watchdog.cancel()
        await service.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # routers stop sending first
        await server.stop(grace=2.0)
        await service.transport.close()

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


@dataclass(frozen=True)
class Listening:
    """A serving leader -> its supervisor (a notice over the rank's pipe): its gRPC service listens."""

    dp_rank: int
    address: str


class ServingRank:
    def __init__(self, worker: EngineWorker, options: ServeOptions) -> None:
        self.worker = worker
        self.options = options

    def handle(self, command: Serve) -> None:
        if not isinstance(command, Serve):
            raise TypeError(f"a serving rank takes Serve, not {command!r}")
        EngineServer(self.worker, self.options, on_listening=_tell_supervisor).serve()

    def close(self) -> None:
        self.worker.close()


def _tell_supervisor(dp_rank: int, address: str) -> None:
    notify_parent(Listening(dp_rank, address))


def serving_rank(info: RankInfo, config: EngineConfig, log_level: int, options: ServeOptions) -> ServingRank:
    """Entry of a spawned serving rank: the rank's worker, which serves on :class:`Serve`. A rank of a
    prefill or decode world says so in its name (``epserve-p-rank0``, ``epserve-d-rank0``)."""
    if options.role != "both":
        name_process(f"epserve-{options.role[0]}-rank{info.rank}")
    return ServingRank(start_rank(info, config, log_level), options)
