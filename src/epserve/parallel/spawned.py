"""A spawned rank's side of ``parallel/launch.py``: where it sits (:class:`RankInfo`), the messages
between it and its parent, and its loop: build the handler with the entry function, then run the
parent's commands until told to shut down or the parent leaves.

Each command (a small frozen dataclass the handler knows) is answered with a :class:`Reply`,
:class:`Refused` (the handler raised :class:`CommandRefused`: bad input, refused alike by every rank
before any collective; the rank stays usable) or :class:`Failed` (anything else: the rank exits after
sending it). While a command runs the rank may tell its parent things over the same pipe
(:func:`notify_parent`: a :class:`Notice`).
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from epserve.parallel.process import exit_with_parent, name_process


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
class Notice:
    """Rank -> parent, while a command runs (:func:`notify_parent`): handed to the call's ``on_notice``;
    the call goes on waiting for the rank's reply."""

    value: Any


@dataclass(frozen=True)
class RankInfo:
    """Where one rank sits: its global rank, its index on this host, and the rendezvous."""

    rank: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


_parent: Connection | None = None  # a spawned rank's pipe to its parent
_parent_lock = threading.Lock()  # notices may come from any thread
_world_secret: bytes | None = None  # what the parent handed this rank to key the world with


def world_secret() -> bytes | None:
    """The random secret the parent handed this spawned rank for its world (it keys the doorbell,
    ``parallel/bell_wire.py``): the same for every rank of a world one parent spawns whole, never in
    the rendezvous store or the environment; None in a process no ``RankProcesses`` started, or
    whose parent spawned only a part of its world (the others are on other hosts)."""
    return _world_secret


def notify_parent(value: object) -> bool:
    """Send ``value`` to the parent as a :class:`Notice` while a command runs (a spawned rank); False in
    a process no ``RankProcesses`` started (one process, torchrun)."""
    if _parent is None:
        return False
    with _parent_lock:
        _parent.send(Notice(value))
    return True


def rank_main(entry: Callable[..., RankHandler], info: RankInfo, conn: Connection, args: tuple,
              environ: dict[str, str], watch: Connection, secret: bytes | None = None) -> None:
    """A spawned rank: build the handler, then run commands until Shutdown or the parent leaves.
    ``environ``: the parent's environment when it started the rank (a forkserver child has the server's);
    ``watch``: the pipe whose end tells that the parent is gone; ``secret``: :func:`world_secret`."""
    global _parent, _world_secret
    exit_with_parent(watch, f"epserve-rank{info.rank}")
    os.environ.clear()
    os.environ.update(environ)
    name_process(f"epserve-rank{info.rank}")
    _parent = conn
    _world_secret = secret
    try:
        handler = entry(info, *args)
        _send(conn, Reply())
    except BaseException:
        _send(conn, Failed(traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            os._exit(1)
        if isinstance(command, Shutdown):
            handler.close()
            _send(conn, Reply())
            return
        try:
            _send(conn, Reply(handler.handle(command)))
        except CommandRefused as e:
            _send(conn, Refused(str(e)))
        except BaseException:
            _send(conn, Failed(traceback.format_exc()))
            os._exit(1)


def _send(conn: Connection, message: object) -> None:
    with _parent_lock:
        conn.send(message)
