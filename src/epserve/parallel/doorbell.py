"""How idle ranks sleep until there is work, without spinning (docs/architecture.md, "One step", 4).

When the step's all-reduce says that no rank has work, every rank of the EP group blocks on the
same key of the rendezvous store, ``wake/<epoch>``. A leader that receives a request (or a rank
asked to stop) sets that key, which wakes every rank at once; they step again, and the epoch
advances. Every rank sleeps and wakes at the same steps, so their epochs agree.

A ring and the epoch advance share a lock: a request pushed to the inbox before the advance is
seen by the step that follows the wake; one pushed after it rings the next epoch (at worst one
spurious wake, never a lost one). Rings and waits use separate store connections, because a
client blocked in ``wait`` holds its socket.
"""

from __future__ import annotations

import datetime
import threading

import torch.distributed as dist

from epserve.parallel.context import store_client

# An idle server may sleep for days; a dead store (its host rank died) still ends the wait at once.
_FOREVER = datetime.timedelta(days=365)


class Doorbell:
    def __init__(self, host: str, port: int, timeout_s: float = 600.0) -> None:
        self._waiter = store_client(host, port, timeout_s)
        self._ringer = store_client(host, port, timeout_s)
        self._lock = threading.Lock()
        self.epoch = 0
        self._collected = 0  # keys of epochs below this are deleted

    @staticmethod
    def _key(epoch: int) -> str:
        return f"doorbell/wake/{epoch}"

    def ring(self) -> None:
        """Wake every rank sleeping in (or about to enter) the current epoch's :meth:`wait`.
        Thread-safe; call it after queueing the work it announces."""
        with self._lock:
            self._ringer.set(self._key(self.epoch), b"1")

    def wait(self) -> None:
        """Block until some rank rings this epoch, then move to the next one. Every rank calls it
        at the same step."""
        self._waiter.wait([self._key(self.epoch)], _FOREVER)
        with self._lock:
            self.epoch += 1

    def collect(self) -> None:
        """Delete the previous epoch's key; call it (on one rank) only after a collective that
        every rank reached after waking, so nobody still waits on it."""
        while self._collected < self.epoch:  # nothing to do (no store round trip) unless ranks woke
            try:
                self._ringer.delete_key(self._key(self._collected))
            except (RuntimeError, dist.DistError):  # already gone
                pass
            self._collected += 1


class LocalDoorbell:
    """The same contract for a one-rank world in one process (no store)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()

    def ring(self) -> None:
        with self._lock:
            self._event.set()

    def wait(self) -> None:
        self._event.wait()
        with self._lock:
            self._event.clear()

    def collect(self) -> None:
        pass
