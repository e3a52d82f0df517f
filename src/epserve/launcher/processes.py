"""Processes of a deployment: ``epserve serve`` (engine ranks + router on one host), ``epserve engine``
(this host's engine ranks, one of several hosts) and ``epserve router`` (the router alone).

The supervisor (the process the user started) spawns the rank processes and asks each to serve; the
leaders tell it over their ranks' pipes where they listen (never through the rendezvous store). It
then starts the router process with those addresses and watches everything:

- a rank that dies or hangs gets its engine group torn down and started again (``launcher.supervisor``), up to
  ``--max-restarts`` times, while the router keeps serving; a restarted leader whose old port was
  taken meanwhile listens on a fresh one and the router is told over its pipe (``EngineMoved``);
- the router is asked for ``/health`` each second: one that died, or gave no answer for the step
  timeout (hung), is killed and started again on the same HTTP port with the engines' current
  addresses, up to ``--max-restarts`` times too;
- past the limit the command exits non-zero with one line naming what failed.

Everything it starts dies with it, even when it is SIGKILLed: the router by ``PR_SET_PDEATHSIG`` and
its pipe's end, the ranks by their pipes' ends (``parallel.launch``), the forkserver and the resource
tracker once those have gone. SIGINT/SIGTERM (Ctrl-C) is passed on as SIGTERM: the router stops
taking connections and finishes its responses, the ranks drain their running requests and stop
together; a second Ctrl-C kills at once.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import multiprocessing as mp
import threading
import time
import urllib.error
import urllib.request
from multiprocessing.connection import wait

from epserve import env
from epserve.config import EngineConfig
from epserve.engine.worker import join_torchrun
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.server import EngineServer
from epserve.engine_server.signals import StopSignals
from epserve.launcher.supervisor import START_TIMEOUT_S, EngineSupervisor
from epserve.parallel.launch import (
    RankFailure,
    torchrun_rank,
)
from epserve.router.instances import EngineMoved
from epserve.router.server import RouterOptions, check_port_free, router_main, router_parts

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0


class HealthWatch:
    """A thread asking ``url`` (the router's ``/health``) each second: when it last answered at all (a
    503 too: it is alive, its engines are not) and whether that answer was 200."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.answered_at: float | None = None
        self.healthy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="router-health", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            except (urllib.error.URLError, OSError):  # not listening yet, or no answer in time
                status = None
            if status is not None:
                self.answered_at, self.healthy = time.monotonic(), status == 200
            self._stop.wait(max(0.0, HEALTH_INTERVAL_S - (time.monotonic() - asked)))

    def silent_for(self) -> float:
        """Seconds since its last answer (since the watch began, before the first)."""
        return time.monotonic() - (self.answered_at if self.answered_at is not None else self.started_at)

    def stop(self) -> None:
        self._stop.set()


class RouterProcess:
    """The router process of ``epserve serve``, restarted when it dies or hangs (see the module's
    docstring): :meth:`check` from the command's loop, :meth:`tell` to pass it a message."""

    def __init__(self, options: RouterOptions, log_level: str, step_timeout_s: float, max_restarts: int,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.options = options
        self.log_level = log_level
        self.step_timeout_s = step_timeout_s
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._restarted_at: float | None = None  # until the restarted router is healthy
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        reader, self._control = ctx.Pipe(duplex=False)  # its write end only here: the router's lifeline
        # (started on the command's main thread, which PR_SET_PDEATHSIG ties the router to)
        self.proc = ctx.Process(target=router_main, args=(self.options, self.log_level, reader),
                                name="epserve-router", daemon=True)
        self.proc.start()
        reader.close()
        self.health = HealthWatch(f"http://{self.options.host}:{self.options.port}/health",
                                  max(1.0, self.step_timeout_s))

    @property
    def url(self) -> str:
        return self.health.url

    def tell(self, message: object) -> None:
        try:
            self._control.send(message)
        except (BrokenPipeError, OSError):
            pass  # it died: check() restarts it with the current addresses

    def check(self, options: RouterOptions) -> bool:
        """Restart the router (with ``options``: the engines' current addresses) if it died or hangs;
        whether it did. RankFailure naming the router when no restart is left."""
        reason = self._failure()
        if reason is None:
            if self._restarted_at is not None and self.health.healthy:
                logger.info("the router serving again after %.1f s (restart %d)",
                            time.monotonic() - self._restarted_at, self.restarts)
                self._restarted_at = None
            return False
        if self.restarts >= self.max_restarts:
            self.kill()
            raise RankFailure(f"the router {reason} (restarts: {self.restarts} of --max-restarts {self.max_restarts})")
        self.restarts += 1
        logger.error("the router %s; restarting it (%d of %d)", reason, self.restarts, self.max_restarts)
        self.kill()
        self.options = options
        self._restarted_at = time.monotonic()
        self._start()
        return True

    def _failure(self) -> str | None:
        if not self.proc.is_alive():
            return f"exited with code {self.proc.exitcode}"
        silent = self.health.silent_for()
        if self.health.answered_at is None:
            if silent > self.start_timeout_s:
                return f"did not answer {self.url} within {self.start_timeout_s:.0f} s of its start"
        elif silent > self.step_timeout_s:
            return f"has not answered {self.url} for {silent:.0f} s (hung)"
        return None

    def kill(self) -> None:
        """Kill it (SIGKILL ends a stopped process too) and let it go."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.close()

    def close(self) -> None:
        self.health.stop()
        self._control.close()


def _by_role(engines: list[EngineSupervisor]) -> dict[str, tuple[str, ...]]:
    """The instances' addresses by role, in the router's order (engines, prefill, then decode instances)."""
    return {role: tuple(a for s in engines if s.options.role == role for a in s.addresses)
            for role in ("both", "prefill", "decode")}


def _router_addresses(engines: list[EngineSupervisor]) -> list[str]:
    """Every instance's address as the router numbers them."""
    return [a for addresses in _by_role(engines).values() for a in addresses]


def _with_engines(options: RouterOptions, engines: list[EngineSupervisor]) -> RouterOptions:
    by_role = _by_role(engines)
    return dataclasses.replace(options, engines=by_role["both"], prefill=by_role["prefill"], decode=by_role["decode"])


def _wait_serving(engines: list[EngineSupervisor], signals: StopSignals) -> bool:
    """Until every group's leaders listen (False: a stop was asked for first); RankFailure when a first
    start fails."""
    while not all(supervisor.serving for supervisor in engines):
        if signals.stopping:
            return False
        for supervisor in engines:
            supervisor.check()
        time.sleep(0.05)
    return True


def serve(groups: list[tuple[EngineConfig, ServeOptions]], router_options: RouterOptions,
          log_level: str = "INFO", max_restarts: int = 3) -> int:
    """``epserve serve``: engine ranks and the router on this host until Ctrl-C/SIGTERM. ``groups``: one
    engine world, or (``--disaggregate``) a world of prefill instances and one of decode instances, each
    with its own layout (``ServeOptions.role``). A group is restarted up to ``max_restarts`` times when
    a rank dies or hangs, the router as often when it dies or hangs."""
    check_port_free(router_options.host, router_options.port)
    router_parts(router_options)  # the router process's checks, before the ranks load
    if (key := env.take_api_key()) is not None and router_options.api_key is None:  # (no process inherits it)
        router_options = dataclasses.replace(router_options, api_key=key)
    signals = StopSignals()
    engines: list[EngineSupervisor] = []
    router: RouterProcess | None = None
    if len(groups) > 1 and all(config.device == "cpu" for config, _ in groups):
        env.share_cores(sum(config.parallel.dp * config.parallel.tp for config, _ in groups))
    try:
        for config, engine_options in groups:  # every world loads at once
            engines.append(EngineSupervisor(config, engine_options, max_restarts))
        if not _wait_serving(engines, signals):
            return 0
        base = dataclasses.replace(router_options, engine_token=groups[0][1].token)
        router = RouterProcess(_with_engines(base, engines), log_level, groups[0][1].step_timeout_s, max_restarts)
        known = _router_addresses(engines)
        announced = False
        waiting_since = time.monotonic()  # for the router to become healthy, while everything else runs
        while not signals.stopping:
            wait([router.proc.sentinel], timeout=0.5)
            if signals.stopping:
                break
            for supervisor in engines:
                supervisor.check()
            current = _router_addresses(engines)
            for index, (old, new) in enumerate(zip(known, current)):
                if old != new:
                    router.tell(EngineMoved(index, new))
            known = current
            if router.check(_with_engines(base, engines)) or not all(s.serving for s in engines):
                waiting_since = time.monotonic()
            if not announced and router.health.healthy:
                announced = True
                logger.info("serving %r on http://%s:%d/v1 (engines: %s)", base.model_name, base.host, base.port,
                            ", ".join(current))
            elif not announced and time.monotonic() - waiting_since > START_TIMEOUT_S:
                raise RankFailure(f"the router did not become healthy at {router.url} within {START_TIMEOUT_S:.0f} s")
    finally:
        _shutdown(engines, router, signals, groups[0][1].drain_timeout_s)
    return 0


def run_engine(config: EngineConfig, options: ServeOptions, max_restarts: int = 3) -> int:
    """``epserve engine``: this host's ranks of a deployment (or this process, as one rank under
    torchrun), serving gRPC until SIGINT/SIGTERM. One host's world is restarted up to
    ``max_restarts`` times when a rank dies or hangs; a world over several hosts is not (one host
    cannot restart it alone): the command exits non-zero for the host's own supervisor."""
    torchrun = torchrun_rank()
    if torchrun is not None:
        worker = join_torchrun(config, *torchrun)
        try:
            EngineServer(worker, options).serve()  # (no parent pipe: the leaders log their addresses)
        finally:
            worker.close()
            del worker
            gc.collect()  # gloo's threads end with the groups' last references: here, not in Python's shutdown
        return 0
    signals = StopSignals()
    env.take_api_key()  # (the engines have no use for a router's key; their processes do not inherit it)
    engines = EngineSupervisor(config, options, max_restarts if config.parallel.nnodes == 1 else 0)
    try:
        if not _wait_serving([engines], signals):
            return 0
        announced = list(engines.addresses)
        for i, address in zip(engines.local_dp_ranks, announced):
            print(f"engine instance {i} listening on {address}", flush=True)
        while not signals.stopping:
            time.sleep(0.5)
            if signals.stopping:
                break
            engines.check()
            for i, old, new in zip(engines.local_dp_ranks, announced, engines.addresses):
                if old != new:  # routers that were given the old address will not find it
                    print(f"engine instance {i} listening on {new} (moved from {old}: its port was taken)", flush=True)
            announced = list(engines.addresses)
    finally:
        _shutdown([engines], None, signals, options.drain_timeout_s)
    return 0


def _shutdown(engines: list[EngineSupervisor], router: RouterProcess | None, signals: StopSignals,
              drain_timeout_s: float) -> None:
    """Stop the router (it finishes open responses) and the ranks (they drain), then reap everything."""
    if signals.stopping:
        logger.info("stop requested: draining and stopping (again to stop at once)")
    proc = router.proc if router is not None else None
    if proc is not None and proc.is_alive():
        proc.terminate()
    for supervisor in engines:
        supervisor.ranks.stop()
    deadline = time.monotonic() + drain_timeout_s + 30.0
    for ranks in [supervisor.ranks for supervisor in engines]:
        while ranks.running and time.monotonic() < deadline and signals.count < 2:
            ranks.join(0.2)
    if router is not None and proc is not None:
        while proc.is_alive() and time.monotonic() < deadline and signals.count < 2:
            proc.join(0.2)
        router.kill()
    for supervisor in engines:
        supervisor.close()
        if supervisor.ranks.error is not None and not isinstance(supervisor.ranks.error, RankFailure):
            logger.error("engine ranks failed: %s", supervisor.ranks.error)
