"""Rank processes: spawned on this host (``torch.multiprocessing``), or this process as one rank of a
``torchrun`` world.

A spawned rank runs an *entry* function ``entry(info, *args)`` that builds its handler (a
:class:`RankHandler`); the parent then drives the ranks SPMD-style: it sends every local rank the same
command (a small frozen dataclass the handler knows) over its pipe, each rank runs it (collectives
included) and replies with a :class:`Reply`, :class:`Refused` or :class:`Failed`. While a command runs a
rank may tell its parent things over the same pipe (:func:`notify_parent`: a :class:`Notice`, handed
to the call's ``on_notice``); the rank's side is ``parallel/spawned.py``. The parent watches every
rank's pipe and process sentinel at once, so a rank that dies or fails stops the others and the call
raises :class:`RankFailure` within moments instead of hanging; the report names the root cause (a rank
that died, before the peers whose collectives failed because of it). Closing joins (then kills) every
rank.

A rank lives no longer than its parent: besides its command pipe it holds the read end of a pipe whose
write end only the parent has, and a thread of the rank exits the process at once when that pipe
closes (the parent died, even by SIGKILL). ``PR_SET_PDEATHSIG`` could not do it for a rank forked by
the forkserver, whose parent is the forkserver; the forkserver and multiprocessing's resource tracker
exit by themselves once the parent and the ranks have closed their pipes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

from epserve import env
from epserve.parallel.process import RankFailure, failure_message, last_line, process_state, signal_name
from epserve.parallel.spawned import Failed, Notice, RankHandler, RankInfo, Refused, Shutdown, rank_main

__all__ = ["RankFailure", "RankProcesses", "free_port", "pin_to_cores", "threads_per_rank", "torchrun_rank",
           "wait_port_free"]

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A port free on loopback now, for a server about to listen on it (a rendezvous store, gloo's
    master, an HTTP server). Chosen below the kernel's ephemeral range where there is room: a client
    that retries connecting to a port in that range before its server listens can be given that same
    port as its own source port and connect to itself (TCP simultaneous open), then wait forever on
    a store that is not there, while the server cannot bind."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(_LISTEN_PORTS_FROM, low) if low - _LISTEN_PORTS_FROM >= 1024 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LISTEN_PORTS_FROM = 20000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def wait_port_free(host: str, port: int, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until ``host:port`` could be bound; whether it could."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            family, _, _, _, address = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
            with socket.create_server(address[:2], family=family):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def torchrun_rank() -> tuple[RankInfo, int] | None:
    """This process's place in a torchrun-style world (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` …
    in the environment) and the world size; None outside one."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    info = RankInfo(
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
    )
    return info, world


def threads_per_rank(local_world_size: int) -> int:
    """CPU threads each rank may use: ``EPSERVE_THREADS_PER_RANK``, else the host's cores shared out
    (oversubscribed OpenMP pools make every parallel region wait on the others)."""
    override = env.threads_per_rank_override()
    return override if override is not None else max(1, len(os.sched_getaffinity(0)) // local_world_size)


def pin_to_cores(local_rank: int, local_world_size: int) -> None:
    """Give this CPU rank its own share of the host's cores (rank i: the i-th block of
    ``cores / ranks``), so ranks stop migrating onto each other's cores; on 2 cores with 2 ranks that
    cut the time ranks wait for each other at collectives, 10-25% of a decode step
    (docs/benchmarks.md). No-op when there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = len(cores) // local_world_size
    if per_rank >= 1:
        os.sched_setaffinity(0, cores[local_rank * per_rank : (local_rank + 1) * per_rank])


class RankProcesses:
    """This host's ranks of a world, each running ``entry(RankInfo, *args)`` -> a :class:`RankHandler`
    to which the parent sends commands, to all of them at once, with :meth:`call`.

    ``start_method``: ``spawn`` (a fresh interpreter per rank), or ``forkserver``: ranks are forked from
    one server process that imported torch and the entry's module once (started with the first ranks,
    kept for later ones), which saves every rank that import. Only for ranks that have not touched CUDA
    before forking: the engine uses it on the CPU. ``wait=False``: return once the processes run, before
    their handlers are built; :meth:`wait_started` (or the first :meth:`call`) waits for that.
    ``whole_world``: these are all the world's ranks (one host): they get a random secret of their own
    over their pipes (``spawned.world_secret``), which keys their doorbell beside the engine token."""

    def __init__(self, entry: Callable[..., RankHandler], infos: list[RankInfo], args: tuple = (),
                 start_method: str = "spawn", wait: bool = True, whole_world: bool = False) -> None:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", entry.__module__])
        self.infos = list(infos)
        self.ranks = [info.rank for info in infos]
        self._conns: list[Connection] = []
        self._watches: list[Connection] = []  # write ends, held here only: closed, the ranks exit
        self._procs = []
        self._reaping = threading.Lock()  # a process's exit code is read once (the forkserver's pipe)
        self._closed = False
        self._started = False
        secret = os.urandom(32) if whole_world else None
        try:
            for info in infos:
                parent, child = ctx.Pipe()
                watch_r, watch_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=rank_main, args=(entry, info, child, args, dict(os.environ), watch_r, secret),
                    name=f"epserve-rank{info.rank}", daemon=True
                )
                self._watches.append(watch_w)
                proc.start()
                child.close()
                watch_r.close()
                self._conns.append(parent)
                self._procs.append(proc)
        except BaseException:
            self.kill()
            raise
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Wait until every rank has built its handler; RankFailure when one failed or died."""
        if not self._started:
            self._collect()
            self._started = True

    def call(self, command: object, on_notice: Callable[[Any], None] | None = None) -> Any:
        """Run ``handler.handle(command)`` on every local rank; returns the first local rank's result.
        ``on_notice(value)`` gets each :class:`Notice` a rank sends meanwhile (in this thread). Raises
        ValueError when the ranks refused the command (and stay usable), RankFailure when a rank failed
        or died (every rank is then stopped)."""
        if self._closed:
            raise RankFailure("the rank processes were shut down")
        self.wait_started()
        for conn in self._conns:
            try:
                conn.send(command)
            except (BrokenPipeError, OSError):
                pass  # its death is reported by _collect
        return self._collect(on_notice)

    def _collect(self, on_notice: Callable[[Any], None] | None = None) -> Any:
        """Every rank's answer. Once one has failed, wait briefly for every rank's fate (the root cause
        is often another rank that died, which its pipe's end tells at once and its sentinel a moment
        later, after its peers' collectives failed), so the report names it."""
        pending = {conn: i for i, conn in enumerate(self._conns)}  # no answer yet
        sentinels = {proc.sentinel: i for i, proc in enumerate(self._procs)}
        gone: set[int] = set()  # its pipe ended without a word: it died; the sentinel says how
        results: dict[int, Any] = {}
        refused: str | None = None
        failures: dict[int, str] = {}
        deadline = None
        while (pending or gone) and (deadline is None or time.monotonic() < deadline):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            for ready in wait([*pending, *sentinels], timeout):
                if ready in pending:
                    i = pending[ready]
                    try:
                        message = ready.recv()
                    except (EOFError, OSError):
                        del pending[ready]
                        gone.add(i)
                        failures.setdefault(i, "died")
                    else:
                        if isinstance(message, Notice):
                            self._notice(on_notice, i, message.value)
                            continue
                        del pending[ready]
                        if isinstance(message, Failed):
                            failures[i] = last_line(message.traceback)
                            logger.debug("rank %d failed:\n%s", self.ranks[i], message.traceback)
                        elif isinstance(message, Refused):
                            refused = message.message
                        else:
                            results[i] = message.value
                elif ready in sentinels:
                    i = sentinels[ready]
                    conn = self._conns[i]
                    if conn in pending and conn.poll():
                        continue  # read its last words first
                    del sentinels[ready]
                    pending.pop(conn, None)
                    gone.discard(i)
                    if failures.get(i, "died") == "died":  # not a rank that said why it failed
                        failures[i] = "died" + self._exit_status(i)
                if failures and deadline is None:
                    deadline = time.monotonic() + 2.0
        if failures:
            for i in pending.values():  # no word from it: a rank stopped (SIGSTOP) hangs its peers
                if process_state(self._procs[i].pid) == "T":
                    failures[i] = "was stopped (SIGSTOP)"
            message = failure_message({self.ranks[i]: text for i, text in failures.items()})
            logger.error("%s; stopping the other ranks", message)
            self.kill()  # the world is broken: the others wait in collectives that cannot complete
            raise RankFailure(message)
        if refused is not None:
            raise ValueError(refused)
        return results.get(0)

    def _notice(self, on_notice: Callable[[Any], None] | None, i: int, value: Any) -> None:
        if on_notice is None:
            logger.debug("rank %d: %r (nobody listens)", self.ranks[i], value)
        else:
            on_notice(value)

    def _exit_status(self, i: int) -> str:
        """`` with exit code -9 (SIGKILL)`` for a rank that exited, once it has (else ``""``)."""
        proc = self._procs[i]
        with self._reaping:
            proc.join(1.0)
        code = proc.exitcode
        return "" if code is None else f" with exit code {code}" + signal_name(code)

    def kill(self) -> None:
        """Kill every rank at once (a broken world: nothing to drain, and a hung rank would not answer
        a polite shutdown). Leaves no process behind."""
        self._closed = True
        with self._reaping:
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
            for proc in self._procs:
                proc.join(5)
        self._close_watches()

    def close(self, timeout: float = 30.0) -> None:
        """Shut every rank down: politely, then by signal. Leaves no process behind."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        with self._reaping:
            for conn, proc in zip(self._conns, self._procs):
                if proc.is_alive():
                    try:
                        conn.send(Shutdown())
                    except (BrokenPipeError, OSError):
                        pass
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
            for proc in self._procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        for conn in self._conns:
            conn.close()
        self._close_watches()

    def _close_watches(self) -> None:
        with self._reaping:  # (a failed call's thread and the supervisor may both kill at once)
            watches, self._watches = self._watches, []
        for watch in watches:
            with contextlib.suppress(OSError):
                watch.close()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]
