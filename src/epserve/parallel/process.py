"""This process among its relatives (Linux ``prctl``; no-ops elsewhere): it dies with its parent, and
it carries a name ``ps`` shows. No torch here: the router process uses these too."""

from __future__ import annotations

import ctypes
import signal


class RankFailure(RuntimeError):
    """A rank process died or failed; the other ranks were stopped."""


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent (our front end, or torchrun's agent) dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def name_process(name: str) -> None:
    """This process's name as ``ps -o comm``, ``top`` and psutil show it (``epserve-rank3``), at most 15
    characters (Linux; a no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
