"""How the CPU kernels share the cores with other work: their OpenMP threads' waits, switched at run time by
the load a monitor reads.

libgomp's threads spin (milliseconds) before they sleep, at every barrier and between parallel regions: on
cores of the process's own, that is what makes a decode step's hundreds of parallel regions cheap; beside
other busy processes a thread spins away the time its descheduled partner needed, at every barrier, and a
step costs ten times more. A monitor thread reads every :data:`PERIOD_S` how busy other processes keep this
process's cores (``/proc/stat``'s busy jiffies of those cores less this process's own, ``/proc/self/stat``:
:func:`read_sample`, :func:`others_busy`), and :func:`decide` switches the waits to brief ones while they
keep half a core busy or more (``cpu_threads.c``: libgomp spins briefly whenever it manages more threads
than there are cores), back to spinning once they drop under a quarter.

The kernels' thread count (:func:`threads`, passed to every kernel call, and rewritten in a recorded step's
calls at replay: ``kernels/cpu_graph.py``) stays the count torch's intra-op pool has on the calling thread:
brief waits on all of them beat fewer threads beside one or three busy Python or torch processes
(docs/benchmarks.md), and torch's own ops keep the thread count their results were checked with.
``EPSERVE_CPU_ADAPT=0``: no monitor, libgomp's waits always.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epserve import env

PERIOD_S = 0.15  # between the monitor's readings (each costs ~0.1 ms of Python)
BRIEF_FROM = 0.5  # cores' worth of other work from which the waits are brief
SPIN_BELOW = 0.25  # ... and under which they spin again (between the two: as they were)


@dataclass(frozen=True)
class CoreSample:
    """One reading: the jiffies this process's cores spent busy (all but idle and iowait) and in all, this
    process's own jiffies (every thread's user + system), and how many cores."""

    busy: int
    total: int
    own: int
    cores: int


def read_sample(cores: set[int] | None = None, stat: str | None = None, self_stat: str | None = None) -> CoreSample:
    """A reading of ``cores`` (default: this process's affinity) from ``/proc/stat`` and ``/proc/self/stat`` (or
    their texts, given)."""
    cores = os.sched_getaffinity(0) if cores is None else cores
    if stat is None:
        with open("/proc/stat") as f:
            stat = f.read()
    if self_stat is None:
        with open("/proc/self/stat") as f:
            self_stat = f.read()
    busy = total = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores):
            continue
        ticks = [int(v) for v in rest.split()]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle, iowait
        all_ = sum(ticks[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
        busy, total = busy + all_ - idle, total + all_
    fields = self_stat.rpartition(")")[2].split()  # after the command's name, which may hold spaces
    return CoreSample(busy, total, int(fields[11]) + int(fields[12]), len(cores))  # utime, stime


def others_busy(before: CoreSample, after: CoreSample) -> float:
    """How many cores' worth of work other processes did on these cores between two readings."""
    elapsed = (after.total - before.total) / max(after.cores, 1)  # jiffies per core
    if elapsed <= 0:
        return 0.0
    return max(0, (after.busy - before.busy) - (after.own - before.own)) / elapsed


def decide(others: float, brief: bool) -> bool:
    """Whether the waits should be brief, given the other work's cores' worth and whether they are now."""
    return others >= (SPIN_BELOW if brief else BRIEF_FROM)


class _Monitor(threading.Thread):
    """Reads the load every :data:`PERIOD_S` and switches the waits through ``waits`` when :func:`decide` says."""

    def __init__(self, waits: Callable[[bool], int]) -> None:
        super().__init__(name="epserve-cpu-threads", daemon=True)
        self.waits = waits
        self.brief = False
        self.others = 0.0
        self.stopped = threading.Event()

    def run(self) -> None:
        before = read_sample()
        while not self.stopped.wait(PERIOD_S):
            after = read_sample()
            self.others = others_busy(before, after)
            before = after
            brief = decide(self.others, self.brief)
            if brief != self.brief and self.waits(brief) >= 0:
                self.brief = brief


_lock = threading.Lock()
_monitor: _Monitor | None = None
_waits: Callable[[bool], int] | None = None  # cpu_threads.c's switch, handed over by kernels.cpu when it loads
_pending = True  # the monitor is yet to be started (or found switched off) by the next threads()


def use_waits(waits: Callable[[bool], int]) -> None:
    """``epserve_brief_waits`` of the loaded library (``kernels.cpu``); the monitor starts with the first
    :func:`threads` after it (unless ``EPSERVE_CPU_ADAPT=0``)."""
    global _waits
    _waits = waits


def _start() -> None:
    global _monitor, _pending
    with _lock:
        if _monitor is None and _waits is not None and env.cpu_adapt_enabled():
            _monitor = _Monitor(_waits)
            _monitor.start()
        _pending = _waits is None


def stop() -> None:
    """Stops the monitor (the waits spin again); a later :func:`threads` starts a new one (unless
    ``EPSERVE_CPU_ADAPT=0`` then)."""
    global _monitor, _pending
    with _lock:
        monitor, _monitor, _pending = _monitor, None, True
    if monitor is not None:
        monitor.stopped.set()
        monitor.join()
        if monitor.brief and _waits is not None:
            _waits(False)


def _forget_after_fork() -> None:  # a forked child has no monitor thread (fork copies only the caller)
    global _monitor, _lock, _pending
    _monitor, _lock, _pending = None, threading.Lock(), True


os.register_at_fork(after_in_child=_forget_after_fork)


def state() -> tuple[bool, float]:
    """(whether the waits are brief now, the last reading of other work in cores' worth)."""
    monitor = _monitor
    return (monitor.brief, monitor.others) if monitor is not None else (False, 0.0)


def threads() -> int:
    """The thread count of a kernel call made now on this thread (torch's intra-op count); starts the monitor
    on the first call."""
    if _pending:
        _start()
    return torch.get_num_threads()
