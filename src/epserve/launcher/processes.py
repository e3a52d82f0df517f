"""Processes of a deployment: ``epserve serve`` (engine ranks + router on one host), ``epserve engine``
(this host's engine ranks, one of several hosts) and ``epserve router`` (the router alone).

The supervisor (the process the user started) spawns the rank processes, asks each to serve, learns
the leaders' gRPC addresses from the rendezvous store, starts the router process, and then waits.
SIGINT/SIGTERM (Ctrl-C) is passed on as SIGTERM: the router stops taking connections and finishes its
responses, the ranks drain their running requests and stop together; a second Ctrl-C kills at once.
A rank that dies or hangs gets the engine group torn down and started again (``supervisor``), up to
``--max-restarts`` times, while the router keeps serving; the router dying stops everything, and the
command exits non-zero.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import time
import urllib.error
import urllib.request
from multiprocessing.connection import wait

from epserve import env
from epserve.config import EngineConfig
from epserve.engine.worker import join_torchrun
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.service import EngineServer
from epserve.engine_server.signals import StopSignals
from epserve.engine_server.supervisor import EngineSupervisor
from epserve.parallel.launch import (
    RankFailure,
    torchrun_rank,
)
from epserve.router.server import RouterOptions, check_port_free, router_main, router_parts

logger = logging.getLogger(__name__)

def _wait_http_ok(url: str, proc: mp.Process, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.is_alive():
            raise RankFailure(f"the router exited with code {proc.exitcode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise RankFailure(f"the router did not become healthy at {url} within {timeout_s:.0f} s")


def serve(groups: list[tuple[EngineConfig, ServeOptions]], router_options: RouterOptions,
          log_level: str = "INFO", max_restarts: int = 3) -> int:
    """``epserve serve``: engine ranks and the router on this host until Ctrl-C/SIGTERM. ``groups``: one
    engine world, or (``--disaggregate``) a world of prefill instances and one of decode instances, each
    with its own layout (``ServeOptions.role``). A group is restarted up to ``max_restarts`` times when
    a rank dies or hangs (the router stays)."""
    check_port_free(router_options.host, router_options.port)
    router_parts(router_options)  # the router process's checks, before the ranks load
    signals = StopSignals()
    engines: list[EngineSupervisor] = []
    router = None
    if len(groups) > 1 and all(config.device == "cpu" for config, _ in groups):
        env.share_cores(sum(config.parallel.dp * config.parallel.tp for config, _ in groups))
    try:
        for config, engine_options in groups:  # every world loads at once
            engines.append(EngineSupervisor(config, engine_options, max_restarts))
        by_role: dict[str, list[str]] = {"both": [], "prefill": [], "decode": []}
        for supervisor in engines:
            by_role[supervisor.options.role].extend(supervisor.wait_serving())
        addresses = [a for supervisor in engines for a in supervisor.addresses]
        options = dataclasses.replace(router_options, engines=tuple(by_role["both"]), prefill=tuple(by_role["prefill"]),
                                      decode=tuple(by_role["decode"]), engine_token=groups[0][1].token)
        router = mp.get_context("spawn").Process(target=router_main, args=(options, log_level),
                                                 name="epserve-router", daemon=True)
        router.start()
        _wait_http_ok(f"http://{options.host}:{options.port}/health", router, 120.0)
        logger.info("serving %r on http://%s:%d/v1 (engines: %s)", options.model_name, options.host,
                    options.port, ", ".join(addresses))
        while not signals.stopping:
            wait([router.sentinel], timeout=0.5)
            if signals.stopping:
                break
            if not router.is_alive():
                raise RankFailure(f"the router exited with code {router.exitcode}")
            for supervisor in engines:
                supervisor.check()
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
            EngineServer(worker, options).serve()
        finally:
            worker.close()
        return 0
    signals = StopSignals()
    engines = EngineSupervisor(config, options, max_restarts if config.parallel.nnodes == 1 else 0)
    try:
        for i, address in zip(engines.local_dp_ranks, engines.wait_serving()):
            print(f"engine instance {i} listening on {address}", flush=True)
        while not signals.stopping:
            time.sleep(0.5)
            if not signals.stopping:
                engines.check()
    finally:
        _shutdown([engines], None, signals, options.drain_timeout_s)
    return 0


def _shutdown(engines: list[EngineSupervisor], router: mp.Process | None, signals: StopSignals,
              drain_timeout_s: float) -> None:
    """Stop the router (it finishes open responses) and the ranks (they drain), then reap everything."""
    if signals.stopping:
        logger.info("stop requested: draining and stopping (again to stop at once)")
    if router is not None and router.is_alive():
        router.terminate()
    for supervisor in engines:
        supervisor.ranks.stop()
    deadline = time.monotonic() + drain_timeout_s + 30.0
    for ranks in [supervisor.ranks for supervisor in engines]:
        while ranks.running and time.monotonic() < deadline and signals.count < 2:
            ranks.join(0.2)
    if router is not None:
        while router.is_alive() and time.monotonic() < deadline and signals.count < 2:
            router.join(0.2)
        if router.is_alive():
            router.kill()
        router.join(5.0)
    for supervisor in engines:
        supervisor.close()
        if supervisor.ranks.error is not None and not isinstance(supervisor.ranks.error, RankFailure):
            logger.error("engine ranks failed: %s", supervisor.ranks.error)
