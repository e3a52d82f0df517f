"""Processes of a deployment: ``epserve serve`` (engine ranks + router on one host), ``epserve engine``
(this host's engine ranks, one of several hosts) and ``epserve router`` (the router alone).

The supervisor (the process the user started) spawns the rank processes, asks each to serve, learns
the leaders' gRPC addresses from the rendezvous store, starts the router process, and then waits.
SIGINT/SIGTERM (Ctrl-C) is passed on as SIGTERM: the router stops taking connections and finishes its
responses, the ranks drain their running requests and stop together; a second Ctrl-C kills at once.
If any process dies, the others are stopped and the command exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

from epserve import env
from epserve.config import EngineConfig
from epserve.engine.worker import join_torchrun, spawn_ranks
from epserve.parallel.context import store_client
from epserve.parallel.launch import (
    RankFailure,
    die_with_parent,
    torchrun_rank,
)
from epserve.serve.engine_server import EngineServer, Serve, ServeOptions, serving_rank
from epserve.serve.signals import StopSignals

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "epserve-tiny"


@dataclass(frozen=True)
class RouterOptions:
    model: str | None  # checkpoint directory (tokenizer); None = the built-in tiny model
    engines: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    served_model_name: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 22
    refresh_interval_s: float = 1.0
    log_level: str = "INFO"

    @property
    def model_name(self) -> str:
        return self.served_model_name or (self.model if self.model is not None else BUILTIN_MODEL_NAME)


def router_parts(options: RouterOptions):
    """The policy and the tokenizer (None if the model directory has none); ValueError for bad options."""
    from epserve.serve.policy import make_policy
    from epserve.tokenizer import load_tokenizer

    policy = make_policy(
        options.policy, cache_threshold=options.cache_threshold, balance_abs_threshold=options.balance_abs_threshold,
        balance_rel_threshold=options.balance_rel_threshold, max_tree_tokens=options.max_tree_tokens,
    )
    if options.model is None:
        from epserve.presets import default_model_path

        path = Path(default_model_path())
    else:
        path = Path(options.model)
        if not path.is_dir():
            raise ValueError(f"model directory {options.model} does not exist (the router reads its tokenizer)")
    return policy, load_tokenizer(path)


def build_router(options: RouterOptions, api_key: str | None = None):
    """The router's ASGI server object (an OpenAIServer); ValueError for bad options."""
    from epserve.serve.openai_api import OpenAIServer
    from epserve.serve.router import Router

    policy, tokenizer = router_parts(options)
    router = Router(list(options.engines), policy, options.refresh_interval_s)
    return OpenAIServer(router, tokenizer, options.model_name, api_key)


def check_port_free(host: str, port: int) -> None:
    """ValueError naming the address when the HTTP port cannot be bound (before anything starts)."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}") from None


def run_router(options: RouterOptions, api_key: str | None = None) -> None:
    """Serve the OpenAI API until SIGINT/SIGTERM (uvicorn finishes open responses first)."""
    import uvicorn

    check_port_free(options.host, options.port)
    server = build_router(options, api_key)
    logger.info("router on http://%s:%d/v1 (model %r, policy %s) over engines %s", options.host, options.port,
                options.model_name, options.policy, ", ".join(options.engines))
    config = uvicorn.Config(server.app, host=options.host, port=options.port, log_level=options.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=60, log_config=None)  # our log format
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found;
    # make that handler a no-op so a clean stop exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.Server(config).run()


def _router_process(options: RouterOptions, log_level: str) -> None:
    die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    run_router(options, env.api_key())


class EngineRanks:
    """This host's engine ranks, serving in the background."""

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

    def addresses(self, dp_ranks: list[int], timeout_s: float = 120.0) -> list[str]:
        """The gRPC address of each listed DP group's leader, once it listens."""
        store = store_client(self.master_addr, self.master_port, timeout_s)
        keys = [f"engines/{i}" for i in dp_ranks]
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


def serve(config: EngineConfig, engine_options: ServeOptions, router_options: RouterOptions,
          log_level: str = "INFO") -> int:
    """``epserve serve``: engine ranks and the router on this host until Ctrl-C/SIGTERM."""
    check_port_free(router_options.host, router_options.port)
    router_parts(router_options)  # the router process's checks, before the ranks load
    signals = StopSignals()
    ranks = EngineRanks(config, engine_options)
    router = None
    try:
        addresses = ranks.addresses(list(range(config.parallel.dp)))
        options = RouterOptions(**{**router_options.__dict__, "engines": tuple(addresses)})
        router = mp.get_context("spawn").Process(target=_router_process, args=(options, log_level),
                                                 name="epserve-router", daemon=True)
        router.start()
        _wait_http_ok(f"http://{options.host}:{options.port}/health", router, 120.0)
        logger.info("serving %r on http://%s:%d/v1 (engines: %s)", options.model_name, options.host,
                    options.port, ", ".join(addresses))
        while not signals.event.is_set():
            wait([router.sentinel], timeout=0.5)
            if signals.event.is_set():
                break
            if not router.is_alive():
                raise RankFailure(f"the router exited with code {router.exitcode}")
            if not ranks.running:
                raise ranks.error or RankFailure("the engine ranks stopped")
    finally:
        _shutdown(ranks, router, signals, engine_options.drain_timeout_s)
    return 0


def run_engine(config: EngineConfig, options: ServeOptions) -> int:
    """``epserve engine``: this host's ranks of a multi-host deployment (or this process, as one rank
    under torchrun), serving gRPC until SIGINT/SIGTERM."""
    torchrun = torchrun_rank()
    if torchrun is not None:
        worker = join_torchrun(config, *torchrun)
        try:
            EngineServer(worker, options).serve()
        finally:
            worker.close()
        return 0
    signals = StopSignals()
    ranks = EngineRanks(config, options)
    try:
        for i, address in zip(ranks.local_dp_ranks, ranks.addresses(ranks.local_dp_ranks)):
            print(f"engine instance {i} listening on {address}", flush=True)
        while not signals.event.is_set() and ranks.running:
            signals.event.wait(0.5)
        if not signals.event.is_set():
            raise ranks.error or RankFailure("the engine ranks stopped")
    finally:
        _shutdown(ranks, None, signals, options.drain_timeout_s)
    return 0


def _shutdown(ranks: EngineRanks, router: mp.Process | None, signals: StopSignals, drain_timeout_s: float) -> None:
    """Stop the router (it finishes open responses) and the ranks (they drain), then reap everything."""
    if router is not None and router.is_alive():
        router.terminate()
    ranks.stop()
    deadline = time.monotonic() + drain_timeout_s + 30.0
    while ranks.running and time.monotonic() < deadline and signals.count < 2:
        ranks.join(0.2)
    if router is not None:
        while router.is_alive() and time.monotonic() < deadline and signals.count < 2:
            router.join(0.2)
        if router.is_alive():
            router.kill()
        router.join(5.0)
    ranks.close()
    if ranks.error is not None and not isinstance(ranks.error, RankFailure):
        logger.error("engine ranks failed: %s", ranks.error)
