"""Keeping this host's engine ranks serving (``epserve serve``, ``epserve engine``).

:class:`EngineRanks` is one start of the ranks: spawned processes, each serving (the leaders over
gRPC). A leader tells the supervisor where it listens over its rank's pipe (a :class:`Listening` notice:
the ranks run ``engine_server.server.serving_rank``), never through the rendezvous store, which any
local process could write to.
:class:`EngineSupervisor` watches them from the process the user started:

- a rank that **dies** or fails ends the ranks' serve call at once (``RankProcesses`` watches every
  rank's pipe and process);
- a rank that **hangs** (SIGSTOP, a wedged device) stalls its group's step in a collective: the
  leaders' step watchdogs report ``stalled`` in ``GetLoad`` (and the collectives give up after the
  collective timeout); a leader that hangs itself stops answering. The supervisor asks every local
  leader for ``GetLoad`` each half second (:class:`LeaderProbes`) and acts on an instance that is
  stalled or has been silent for the step timeout.

Either way it tears the whole group down (every rank killed, none orphaned) and starts it again with
the same configuration, up to ``max_restarts`` times. A restarted leader listens on its old gRPC port
if it can, else (something took the port meanwhile) on a fresh one: :attr:`EngineSupervisor.addresses`
then changes, and ``epserve serve`` tells its router. A restart that fails in turn (a rank dying
while it starts, a port or the store it cannot bind, no leader listening within the start timeout)
counts as another failure. Once no restart is left, or with ``max_restarts=0`` (a world spread over
hosts, which one host cannot restart alone), :meth:`EngineSupervisor.check` raises
:class:`RankFailure` and the command exits non-zero for the host's own supervisor (systemd,
Kubernetes) to act on. A first start that fails before every leader listens (a bad checkpoint, too
little memory) is not retried: it would fail again.

Restarts never block: :meth:`EngineSupervisor.check` starts the new ranks and returns, and a later
call sees them listening, so the command's loop goes on watching everything else meanwhile.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

import grpc

from epserve.config import EngineConfig
from epserve.engine.worker import spawn_ranks
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.server import Listening, Serve, serving_rank
from epserve.parallel.launch import RankFailure, RankProcesses
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import engine_channel

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # (the command's loop looks each half second)
PROBE_TIMEOUT_S = 2.0  # a probe waits this long for an answer at most (less: see LeaderProbes)
_DEADLINE_SLACK_S = 0.05  # (a call's deadline may fire this much before the monotonic clock's)
START_TIMEOUT_S = 120.0  # a start (or restart) whose leaders do not all listen by then failed


class EngineRanks:
    """One start of this host's engine ranks, serving in the background: the processes are started
    here, and a thread waits for their entries and runs the serve call (whose notices say where the
    leaders listen). Never raises: a start that fails shows as :attr:`error`, with :attr:`running`
    false."""

    def __init__(self, config: EngineConfig, options: ServeOptions) -> None:
        pc = config.parallel
        local = range(pc.node_rank * pc.local_world_size, (pc.node_rank + 1) * pc.local_world_size)
        self.local_dp_ranks = sorted({rank // pc.tp for rank in local if rank % pc.tp == 0})
        self.error: BaseException | None = None
        self.started_at = time.monotonic()
        self._listening: dict[int, str] = {}
        self._lock = threading.Lock()
        self.ranks: RankProcesses | None = None
        try:
            self.ranks = spawn_ranks(config, serving_rank, (options,), wait=False)
        except Exception as e:  # the processes could not even start
            self.error = e
        # (spawned here, on the caller's thread: a rank's PR_SET_PDEATHSIG follows the thread that
        # started it, and this thread ends with the serve call)
        self._thread = threading.Thread(target=self._serve, name="ranks", daemon=True)
        if self.ranks is not None:
            self._thread.start()

    def _serve(self) -> None:
        try:
            self.ranks.call(Serve(), on_notice=self._notice)  # type: ignore[union-attr]
        except BaseException as e:
            self.error = e

    def _notice(self, notice: object) -> None:
        if isinstance(notice, Listening) and notice.dp_rank in self.local_dp_ranks:
            with self._lock:
                self._listening[notice.dp_rank] = notice.address

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def addresses(self) -> list[str] | None:
        """The gRPC address of each local DP group's leader once every one of them has listened
        (even if the ranks stopped since); None until then."""
        with self._lock:
            if len(self._listening) < len(self.local_dp_ranks):
                return None
            return [self._listening[i] for i in self.local_dp_ranks]

    @property
    def pids(self) -> list[int]:
        return self.ranks.pids if self.ranks is not None else []

    def stop(self) -> None:
        """Ask every rank to drain and stop (SIGTERM)."""
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def close(self) -> None:
        if self.ranks is not None:
            self.ranks.close(timeout=10.0)

    def kill(self) -> None:
        if self.ranks is not None:
            self.ranks.kill()
        self.join(10.0)


class LeaderProbes:
    """``GetLoad`` asked of this host's leaders (a channel each): :meth:`probe` gives the verdict on an
    instance whose watchdog reports it stalled, or that has not answered for the step timeout, counted
    from the first probe it left unanswered (never from before: a leader held still for less than the
    step timeout is not failed). A probe waits for an answer only until that silence reaches the step
    timeout, and the first one no longer than the step timeout: the verdict comes at the step timeout
    after the first unanswered probe, half a second at most after the leader hung (it used to wait for
    whole 2 s probes: a leader frozen at once was seen 2.5 s past a 5 s timeout)."""

    def __init__(self, dp_ranks: list[int], addresses: list[str], token: str | None, step_timeout_s: float) -> None:
        self.dp_ranks, self.addresses, self.step_timeout_s = dp_ranks, addresses, step_timeout_s
        self._channels = [engine_channel(a, token) for a in addresses]
        self._silent_since: dict[int, float] = {}  # leaders that left a probe unanswered: its start

    def probe(self) -> str | None:
        """Ask every leader at once; why the group must be restarted, or None."""
        now = time.monotonic()
        calls = [pb_grpc.EngineStub(channel).GetLoad.future(pb.GetLoadRequest(), timeout=self._wait(dp_rank, now))
                 for dp_rank, channel in zip(self.dp_ranks, self._channels)]
        for dp_rank, address, call in zip(self.dp_ranks, self.addresses, calls):
            try:
                if call.result().stalled:  # its watchdog saw no step progress for the step timeout
                    return f"engine instance {dp_rank} at {address} stalled (a rank hung or died)"
                self._silent_since.pop(dp_rank, None)
            except grpc.RpcError as e:
                silent = time.monotonic() - self._silent_since.setdefault(dp_rank, now)
                if silent >= self.step_timeout_s - _DEADLINE_SLACK_S:
                    return (f"engine instance {dp_rank} at {address} not answering "
                            f"({e.code().name}) for {silent:.1f} s")  # type: ignore[attr-defined]
        return None

    def _wait(self, dp_rank: int, now: float) -> float:
        """How long a probe made ``now`` waits for the leader's answer: ``PROBE_TIMEOUT_S`` at most, no
        longer than the step timeout, and for a silent leader until its silence reaches the step timeout
        when that comes before the next probe could wait for it."""
        since = self._silent_since.get(dp_rank)
        if since is None:
            return min(PROBE_TIMEOUT_S, self.step_timeout_s)
        left = since + self.step_timeout_s - now
        return max(0.05, left) if left <= PROBE_TIMEOUT_S + 1.0 else PROBE_TIMEOUT_S

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels = []


class EngineSupervisor:
    """This host's engine ranks, restarted when they die or hang (see the module's docstring).
    :meth:`check` is called from the command's loop; the rest of the command sees :attr:`ranks`,
    :attr:`serving` and :attr:`addresses`."""

    def __init__(self, config: EngineConfig, options: ServeOptions, max_restarts: int,
                 start_timeout_s: float | None = None) -> None:
        self.config = config
        self.options = options
        self.max_restarts = max_restarts
        # (a start loads the checkpoint: a large one takes minutes, as long as the world's start-up timeout)
        self.start_timeout_s = start_timeout_s or max(START_TIMEOUT_S, config.parallel.timeout_s)
        self.restarts = 0
        self.addresses: list[str] = []  # where the local leaders listen (the latest start's), once they do
        self.serving = False  # the current start's leaders all listen
        self.ranks = EngineRanks(config, options)
        self._probes: LeaderProbes | None = None
        self._probed_at = 0.0

    @property
    def local_dp_ranks(self) -> list[int]:
        return self.ranks.local_dp_ranks

    def check(self) -> None:
        """One look: a start whose leaders all listen now serves; a group that died or hung is
        restarted (the restart goes on in the background). RankFailure when the first start failed
        before serving, or no restart is left."""
        if not self.serving:
            self._check_start()
            return
        reason = self._failure()
        if reason is not None:
            self._restart(reason)

    def _check_start(self) -> None:
        addresses = self.ranks.addresses()
        if addresses is not None:
            self._serve_at(addresses)
            return
        if self.ranks.running and time.monotonic() - self.ranks.started_at < self.start_timeout_s:
            return
        if self.ranks.running:
            reason = f"engine instances did not start listening within {self.start_timeout_s:.0f} s"
        else:
            reason = self._stopped()
        if not self.addresses:  # the first start: what failed it would fail the next one too
            self.ranks.kill()
            raise RankFailure(f"engine ranks stopped before serving: {reason}")
        self._restart(f"restart {self.restarts} failed: {reason}")

    def _serve_at(self, addresses: list[str]) -> None:
        """The current start serves: its ports become the ones the next restart asks for."""
        first = not self.addresses
        for dp_rank, old, new in zip(self.local_dp_ranks, self.addresses, addresses):
            if old != new:
                logger.warning("engine instance %d moved from %s to %s (its old port was taken)", dp_rank, old, new)
        self.addresses = addresses
        ports = list(self.options.ports) or [0] * self.config.parallel.dp
        for dp_rank, address in zip(self.local_dp_ranks, addresses):
            ports[dp_rank] = int(address.rpartition(":")[2])
        self.options = dataclasses.replace(self.options, ports=tuple(ports))
        self.serving = True
        self._open_probes()
        if not first:
            logger.info("engine group serving again after %.1f s (restart %d)",
                        time.monotonic() - self.ranks.started_at, self.restarts)

    def _restart(self, reason: str) -> None:
        self._close_probes()
        self.serving = False
        if self.restarts >= self.max_restarts:
            self.ranks.kill()  # a broken group is not drained: its hung ranks would never answer
            raise RankFailure(f"{reason} (restarts: {self.restarts} of --max-restarts {self.max_restarts})")
        self.restarts += 1
        logger.error("engine group failed: %s; restarting it (%d of %d)", reason, self.restarts, self.max_restarts)
        self.ranks.kill()
        self.ranks = EngineRanks(self.config, dataclasses.replace(self.options, restarts=self.restarts))

    def _failure(self) -> str | None:
        """Why the group must be restarted (None: it serves): its ranks stopped (how, as RankProcesses
        says: a rank that died first), or an instance stalled or stayed silent for the step timeout."""
        if not self.ranks.running:
            return self._stopped()
        now = time.monotonic()
        if now - self._probed_at < PROBE_INTERVAL_S:
            return None
        self._probed_at = now
        verdict = self._probes.probe() if self._probes is not None else None
        if verdict is not None and not self.ranks.running:  # a rank died meanwhile: that is the cause
            return self._stopped()
        return verdict

    def _stopped(self) -> str:
        return str(self.ranks.error) if self.ranks.error is not None else "the engine ranks stopped"

    def _open_probes(self) -> None:
        self._probes = LeaderProbes(self.local_dp_ranks, self.addresses, self.options.token,
                                    self.options.step_timeout_s)

    def _close_probes(self) -> None:
        if self._probes is not None:
            self._probes.close()
            self._probes = None

    def close(self) -> None:
        self._close_probes()
        self.ranks.close()
