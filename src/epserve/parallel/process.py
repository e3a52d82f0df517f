"""This process among its relatives (Linux ``prctl``; no-ops elsewhere): it dies with its parent (by
``PR_SET_PDEATHSIG``, or by a pipe whose other end only the parent holds, for a process whose parent
is not its starter, such as a forkserver's child), it carries a name ``ps`` shows, and a relative's
failure is reported in one line (:class:`RankFailure`). No torch here: the router process uses these too."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from multiprocessing.connection import Connection


class RankFailure(RuntimeError):
    """A rank process died or failed; the other ranks were stopped."""


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (our front end, or torchrun's agent) dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def exit_with_parent(watch: Connection, name: str) -> None:
    """A thread that blocks on ``watch``, a pipe end whose other end only the parent holds: when the
    pipe ends (the parent is gone, however it died) it exits this process at once, whatever it does."""

    def watch_parent() -> None:
        try:
            watch.recv_bytes()
        except (EOFError, OSError):
            pass
        os.write(2, f"{name}: the parent process is gone; exiting\n".encode())
        os._exit(1)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()


def name_process(name: str) -> None:
    """This process's name as ``ps -o comm``, ``top`` and psutil show it (``epserve-rank3``), at most 15
    characters (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def last_line(trace: str) -> str:
    """A failed rank's traceback -> ``failed: Kind: message``, from its last line."""
    lines = [line for line in trace.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "unknown error"
    kind, sep, text = last.partition(": ")
    if sep and "." in kind:  # epserve.engine.memory.OutOfMemoryError -> OutOfMemoryError
        last = kind.rsplit(".", 1)[1] + sep + text
    return "failed: " + last.split(". This is typically caused")[0]  # gloo's advice adds nothing here


def failure_message(failures: dict[int, str]) -> str:
    """``{rank: what happened}`` -> one line: deaths and stopped ranks first (the likely root cause),
    ranks with the same failure grouped."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(failures):
        by_text.setdefault(failures[rank], []).append(rank)
    parts = sorted(by_text.items(), key=lambda item: not item[0].startswith(("died", "was stopped")))
    return "; ".join(
        f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} {text}" for text, ranks in parts
    )


def process_state(pid: int) -> str:
    """A process's state letter as ``ps`` shows it (``T``: stopped), ``""`` when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def signal_name(exitcode: int | None) -> str:
    """`` (SIGKILL)`` for a process's exit code -9; ``""`` for an exit that no signal caused."""
    if exitcode is None or exitcode >= 0:
        return ""
    try:
        return f" ({signal.Signals(-exitcode).name})"
    except ValueError:
        return ""
