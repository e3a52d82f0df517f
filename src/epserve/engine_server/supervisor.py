"""Keeping this host's engine ranks serving (``epserve serve``, ``epserve engine``).

:class:`EngineRanks` is one start of the ranks: spawned processes, each serving (the leaders over
gRPC). :class:`EngineSupervisor` watches them from the process the user started:

- a rank that **dies** or fails ends the ranks' serve call at once (``RankProcesses`` watches every
  rank's pipe and process);
- a rank that **hangs** (SIGSTOP, a wedged device) stalls its group's step in a collective: the
  leaders' step watchdogs report ``stalled`` in ``GetLoad`` (and the collectives give up after the
  collective timeout); a leader that hangs itself stops answering. The supervisor asks every local
  leader for ``GetLoad`` each second and acts on an instance that has been stalled or silent for
  the step timeout.

Either way it tears the whole group down (every rank killed, none orphaned) and starts it again with
the same configuration and the same gRPC ports, so routers find the instances where they were, up to
``max_restarts`` times; then, or with ``max_restarts=0`` (a world spread over hosts, which one host
cannot restart alone), it raises :class:`RankFailure` and the command exits non-zero for the host's
own supervisor (systemd, Kubernetes) to act on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import grpc

from epserve.config import EngineConfig
from epserve.engine.worker import EngineWorker, spawn_ranks, start_rank
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.service import EngineServer
from epserve.parallel.context import store_client
from epserve.parallel.launch import RankFailure, RankInfo
from epserve.parallel.process import name_process
from epserve.rpc.convert import GRPC_OPTIONS, auth_metadata
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


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
    """Entry of a spawned serving rank: the rank's worker, which serves on :class:`Serve`. A rank of a
    prefill or decode world says so in its name (``epserve-p-rank0``, ``epserve-d-rank0``)."""
    if options.role != "both":
        name_process(f"epserve-{options.role[0]}-rank{info.rank}")
    return ServingRank(start_rank(info, config, log_level), options)


class EngineRanks:
    """One start of this host's engine ranks, serving in the background."""

    def __init__(self, config: EngineConfig, options: ServeOptions) -> None:
        self.ranks = spawn_ranks(config, serving_rank, (options,))
        tp = config.parallel.tp
        self.master_addr, self.master_port = self.ranks.infos[0].master_addr, self.ranks.infos[0].master_port
        self.local_dp_ranks = sorted({info.rank // tp for info in self.ranks.infos if info.rank % tp == 0})
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="ranks", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.ranks.call(Serve())
        except BaseException as e:
            self.error = e

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def addresses(self, timeout_s: float = 120.0) -> list[str]:
        """The gRPC address of each local DP group's leader, once it listens."""
        store = store_client(self.master_addr, self.master_port, timeout_s)
        keys = [f"engines/{i}" for i in self.local_dp_ranks]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if not self.running:
                raise RankFailure(f"engine ranks stopped before serving: {self.error}")
            if time.monotonic() > deadline:
                raise RankFailure(f"engine instances did not start listening within {timeout_s:.0f} s")
            time.sleep(0.05)
        return [store.get(k).decode() for k in keys]

    def stop(self) -> None:
        """Ask every rank to drain and stop (SIGTERM)."""
        for pid in self.ranks.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def close(self) -> None:
        self.ranks.close(timeout=10.0)

    def kill(self) -> None:
        self.ranks.kill()
        self.join(10.0)


class EngineSupervisor:
    """This host's engine ranks, restarted when they die or hang (see the module's docstring).
    :meth:`check` is called from the command's loop; the rest of the command sees :attr:`ranks`."""

    def __init__(self, config: EngineConfig, options: ServeOptions, max_restarts: int) -> None:
        self.config = config
        self.options = options
        self.max_restarts = max_restarts
        self.restarts = 0
        self.ranks = EngineRanks(config, options)
        self.addresses: list[str] = []
        self._channels: list[grpc.Channel] = []
        self._silent_since: dict[int, float] = {}
        self._probed_at = 0.0

    @property
    def local_dp_ranks(self) -> list[int]:
        return self.ranks.local_dp_ranks

    def wait_serving(self, timeout_s: float = 120.0) -> list[str]:
        """The local leaders' gRPC addresses once they listen. Restarts reuse these ports."""
        self.addresses = self.ranks.addresses(timeout_s)
        ports = [0] * self.config.parallel.dp
        for dp_rank, address in zip(self.local_dp_ranks, self.addresses):
            ports[dp_rank] = int(address.rpartition(":")[2])
        self.options = dataclasses.replace(self.options, ports=tuple(ports))
        self._open_probes()
        return self.addresses

    def check(self) -> None:
        """Restart the group if it died or hung; RankFailure when no restart is left."""
        reason = self._failure()
        if reason is None:
            return
        if self.restarts >= self.max_restarts:
            self._close_probes()
            self.ranks.kill()  # a broken group is not drained: its hung ranks would never answer
            raise RankFailure(f"{reason} (restarts: {self.restarts} of --max-restarts {self.max_restarts})")
        self.restarts += 1
        logger.error("engine group failed: %s; restarting it (%d of %d)", reason, self.restarts, self.max_restarts)
        start = time.monotonic()
        self._close_probes()
        self.ranks.kill()
        self.ranks = EngineRanks(self.config, dataclasses.replace(self.options, restarts=self.restarts))
        addresses = self.ranks.addresses()
        if addresses != self.addresses:  # the same ports were asked for: a bind failure raises instead
            raise RankFailure(f"restarted engine instances listen on {addresses}, not {self.addresses}")
        self._open_probes()
        logger.info("engine group serving again after %.1f s (restart %d)", time.monotonic() - start, self.restarts)

    def _failure(self) -> str | None:
        if not self.ranks.running:
            return str(self.ranks.error) if self.ranks.error is not None else "the engine ranks stopped"
        now = time.monotonic()
        if now - self._probed_at < PROBE_INTERVAL_S:
            return None
        self._probed_at = now
        metadata = auth_metadata(self.options.token)
        calls = [pb_grpc.EngineStub(ch).GetLoad.future(pb.GetLoadRequest(), timeout=2.0, metadata=metadata)
                 for ch in self._channels]
        for dp_rank, address, call in zip(self.local_dp_ranks, self.addresses, calls):
            try:
                if call.result().stalled:  # its watchdog saw no step progress for the step timeout
                    return f"engine instance {dp_rank} at {address} stalled (a rank hung or died)"
                self._silent_since.pop(dp_rank, None)
            except grpc.RpcError as e:
                since = self._silent_since.setdefault(dp_rank, now)
                if time.monotonic() - since >= self.options.step_timeout_s:
                    return (f"engine instance {dp_rank} at {address} not answering "
                            f"({e.code().name}) for {time.monotonic() - since:.0f} s")  # type: ignore[attr-defined]
        return None

    def _open_probes(self) -> None:
        self._channels = [grpc.insecure_channel(a, options=GRPC_OPTIONS) for a in self.addresses]
        self._silent_since.clear()

    def _close_probes(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels = []

    def close(self) -> None:
        self._close_probes()
        self.ranks.close()
