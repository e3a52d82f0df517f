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
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

import torch.multiprocessing as mp

from epserve import env
from epserve.config import EngineConfig
from epserve.engine.worker import join_torchrun
from epserve.parallel.launch import (
    RankFailure,
    die_with_parent,
    name_process,
    torchrun_rank,
)
from epserve.serve.engine_server import EngineServer, ServeOptions
from epserve.serve.signals import StopSignals
from epserve.serve.supervisor import EngineSupervisor

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "epserve-tiny"


@dataclass(frozen=True)
class RouterOptions:
    model: str | None  # checkpoint directory (tokenizer); None = the built-in tiny model
    engines: tuple[str, ...]
    prefill: tuple[str, ...] = ()  # disaggregation: prefill instances ...
    decode: tuple[str, ...] = ()  # ... and decode instances (instead of engines)
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    served_model_name: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 22
    refresh_interval_s: float = 1.0
    engine_wait_s: float = 20.0  # a request not yet started waits this long for a healthy instance
    log_level: str = "INFO"
    max_request_bytes: int = 4 << 20
    max_choices_per_request: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    engine_token: str | None = field(default=None, repr=False)  # sent to the engines (None: the API key, if any)

    def __post_init__(self) -> None:
        _ = self.limits  # ValueError for bad limits, as soon as the options are made

    @property
    def model_name(self) -> str:
        return self.served_model_name or (self.model if self.model is not None else BUILTIN_MODEL_NAME)

    @property
    def limits(self):
        """The HTTP limits (an ``HTTPLimits``); ValueError for bad values."""
        from epserve.serve.http_limits import HTTPLimits

        return HTTPLimits(
            max_request_bytes=self.max_request_bytes, max_choices_per_request=self.max_choices_per_request,
            header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
            keep_alive_timeout_s=self.keep_alive_timeout_s,
        )


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
    router = Router(options.engines, policy, options.refresh_interval_s, token=options.engine_token or api_key,
                    engine_wait_s=options.engine_wait_s, prefill=options.prefill, decode=options.decode)
    return OpenAIServer(router, tokenizer, options.model_name, api_key, options.limits)


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
    over = (f"engines {', '.join(options.engines)}" if options.engines else
            f"prefill instances {', '.join(options.prefill)} and decode instances {', '.join(options.decode)}")
    logger.info("router on http://%s:%d/v1 (model %r, policy %s) over %s", options.host, options.port,
                options.model_name, options.policy, over)
    from epserve.serve.http_limits import http_protocol

    limits = server.limits
    config = uvicorn.Config(server.app, host=options.host, port=options.port, log_level=options.log_level.lower(),
                            access_log=False, timeout_graceful_shutdown=60, log_config=None,  # our log format
                            http=http_protocol(limits.header_timeout_s), ws="none", server_header=False,
                            timeout_keep_alive=limits.keep_alive_timeout_s)  # type: ignore[arg-type]
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler it found;
    # make that handler a no-op so a clean stop exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: None)
    uvicorn.Server(config).run()


def _router_process(options: RouterOptions, log_level: str) -> None:
    die_with_parent()
    name_process("epserve-router")
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s router %(name)s: %(message)s")
    run_router(options, env.api_key())


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
        router = mp.get_context("spawn").Process(target=_router_process, args=(options, log_level),
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
