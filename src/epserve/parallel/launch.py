"""Rank processes: spawned on this host (``torch.multiprocessing``), or this process as one rank of a
``torchrun`` world.

A spawned rank runs an *entry* function ``entry(info, *args)`` that builds its handler (a
:class:`RankHandler`); the parent then drives the ranks SPMD-style: it sends every local rank the same
command (a small frozen dataclass the handler knows) over its pipe, each rank runs it (collectives
included) and replies with a :class:`Reply`, :class:`Refused` or :class:`Failed`. The parent watches
every rank's pipe and process sentinel at once, so a rank that dies or fails stops the others and the
call raises :class:`RankFailure` within moments instead of hanging; closing joins (then kills) every rank.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

import torch.multiprocessing as mp

from epserve import env
from epserve.parallel.process import RankFailure, name_process

logger = logging.getLogger(__name__)


class CommandRefused(ValueError):
    """A command every rank refused alike, before any collective (bad input): the ranks stay usable
    and the caller gets a ValueError. Handlers raise subclasses of it."""


class RankHandler(Protocol):
    """What a rank's entry function returns: it runs the parent's commands, then closes."""

    def handle(self, command: object) -> object: ...

    def close(self) -> None: ...


# ---- messages between the parent and a spawned rank ---------------------------------------------
@dataclass(frozen=True)
class Shutdown:
    """Parent -> rank: close the handler and exit."""


@dataclass(frozen=True)
class Reply:
    """Rank -> parent: the command ran (or, first of all, the handler was built)."""

    value: Any = None


@dataclass(frozen=True)
class Refused:
    """Rank -> parent: the handler raised :class:`CommandRefused`; the rank stays usable."""

    message: str


@dataclass(frozen=True)
class Failed:
    """Rank -> parent: anything else went wrong; the rank exits after sending it."""

    traceback: str


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: its global rank, its index on this host, and the rendezvous."""

    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def _rank_main(entry: Callable[..., RankHandler], info: RankInfo, conn: Connection, args: tuple,
               environ: dict[str, str]) -> None:
    """A spawned rank: build the handler, then run commands until Shutdown or the parent leaves.
    ``environ``: the parent's environment when it started the rank (a forkserver child has the server's)."""
    os.environ.clear()
    os.environ.update(environ)
    name_process(f"epserve-rank{info.rank}")
    try:
        handler = entry(info, *args)
        conn.send(Reply())
    except BaseException:
        conn.send(Failed(traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            os._exit(1)
        if isinstance(command, Shutdown):
            handler.close()
            conn.send(Reply())
            return
        try:
            conn.send(Reply(handler.handle(command)))
        except CommandRefused as e:
            conn.send(Refused(str(e)))
        except BaseException:
            conn.send(Failed(traceback.format_exc()))
            os._exit(1)


def _last_line(trace: str) -> str:
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "unknown error"
    kind, sep, text = last.partition(": ")
    if sep and "." in kind:  # epserve.engine.memory.OutOfMemoryError -> OutOfMemoryError
        last = kind.rsplit(".", 1)[1] + sep + text
    return "failed: " + last.split(". This is typically caused")[0]  # gloo's advice adds nothing here


def _failure_message(failures: dict[int, str]) -> str:
    """``{rank: what happened}`` -> one line: deaths first (the likely root cause), ranks with the
    same failure grouped."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(failures):
        by_text.setdefault(failures[rank], []).append(rank)
    parts = sorted(by_text.items(), key=lambda item: not item[0].startswith("died"))
    return "; ".join(
        f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} {text}" for text, ranks in parts
    )


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        return ""


class RankProcesses:
    """This host's ranks of a world, each running ``entry(RankInfo, *args)`` -> a :class:`RankHandler`
    to which the parent sends commands, to all of them at once, with :meth:`call`.

    ``start_method``: ``spawn`` (a fresh interpreter per rank), or ``forkserver``: ranks are forked from
    one server process that imported torch and the entry's module once (started with the first ranks,
    kept for later ones), which saves every rank that import. Only for ranks that have not touched CUDA
    before forking: the engine uses it on the CPU."""

    def __init__(self, entry: Callable[..., RankHandler], infos: list[RankInfo], args: tuple = (),
                 start_method: str = "spawn") -> None:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(["torch", entry.__module__])
        self.infos = list(infos)
        self.ranks = [info.rank for info in infos]
        self._conns: list[Connection] = []
        self._procs = []
        for info in infos:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main, args=(entry, info, child, args, dict(os.environ)), name=f"epserve-rank{info.rank}",
                daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._closed = False
        self._collect()

    def call(self, command: object) -> Any:
        """Run ``handler.handle(command)`` on every local rank; returns the first local rank's result.
        Raises ValueError when the ranks refused the command (and stay usable), RankFailure when a
        rank failed or died (every rank is then stopped)."""
        if self._closed:
            raise RankFailure("the rank processes were shut down")
        for conn in self._conns:
            try:
                conn.send(command)
            except (BrokenPipeError, OSError):
                pass  # its death is reported by _collect
        return self._collect()

    def _collect(self) -> Any:
        pending = dict(zip(self._conns, range(len(self._conns))))
        sentinels = {proc.sentinel: i for i, proc in enumerate(self._procs)}
        results: dict[int, Any] = {}
        refused: str | None = None
        failures: dict[int, str] = {}
        deadline = None  # once a rank fails, wait briefly for the root cause (often another rank died)
        while pending and (deadline is None or time.monotonic() < deadline):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            for ready in wait([*pending, *sentinels], timeout):
                i = pending.get(ready, sentinels.get(ready))  # type: ignore[arg-type]
                if ready in pending:
                    try:
                        message = ready.recv()
                    except (EOFError, OSError):
                        del pending[ready]  # it died; its sentinel says how
                        continue
                    del pending[ready]
                    if isinstance(message, Failed):
                        failures[i] = _last_line(message.traceback)
                        logger.debug("rank %d failed:\n%s", self.ranks[i], message.traceback)
                    elif isinstance(message, Refused):
                        refused = message.message
                    else:
                        results[i] = message.value
                elif i not in failures:
                    conn = self._conns[i]
                    if conn in pending and conn.poll():
                        continue  # read its last words first
                    pending.pop(conn, None)
                    del sentinels[ready]
                    proc = self._procs[i]
                    proc.join(1.0)
                    failures[i] = f"died with exit code {proc.exitcode}" + _signal_name(proc.exitcode)
                if failures and deadline is None:
                    deadline = time.monotonic() + 2.0
        if failures:
            message = _failure_message({self.ranks[i]: text for i, text in failures.items()})
            logger.error("%s; stopping the other ranks", message)
            self.kill()  # the world is broken: the others wait in collectives that cannot complete
            raise RankFailure(message)
        if refused is not None:
            raise ValueError(refused)
        return results.get(0)

    def kill(self) -> None:
        """Kill every rank at once (a broken world: nothing to drain, and a hung rank would not answer
        a polite shutdown). Leaves no process behind."""
        self._closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()  # SIGKILL ends a stopped (SIGSTOP) process too
        for proc in self._procs:
            proc.join(5)

    def close(self, timeout: float = 30.0) -> None:
        """Shut every rank down: politely, then by signal. Leaves no process behind."""
        if self._closed:
            return
        self._closed = True
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(Shutdown())
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]
