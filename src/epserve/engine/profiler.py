"""Per-op wall time of engine steps, for the stage breakdown benchmark (off unless enabled).

Each decoder layer times every op it runs (a ``*_send`` op is the time to start a transfer, a
``*_recv`` op the time spent waiting for it: what the overlap did not hide); the runner adds the
whole forward and the MTP passes, the engine the sampling, the step loop (:mod:`epserve.engine.loop`)
the whole step (scheduling, the step's all-reduce and batch broadcast included) through
:meth:`OpProfiler.time_step`. While profiling is off the runner holds :data:`UNTIMED`, the same calls
that time nothing (no ``None`` to test). One record per step that ran a forward, tagged with the step's
shape.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class StepRecord:
    num_tokens: int  # this rank's DP group
    num_seqs: int
    is_decode: bool  # every sequence is a decode (ScheduledChunk.is_decode)
    overlap: str
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class OpProfiler:
    enabled = True

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync  # e.g. torch.cuda.synchronize: make asynchronous kernels count where they run
        self.steps: list[StepRecord] = []
        self._current: StepRecord | None = None

    def begin_step(self, num_tokens: int, num_seqs: int, is_decode: bool, overlap: str) -> None:
        self._current = StepRecord(num_tokens, num_seqs, is_decode, overlap)
        self.steps.append(self._current)

    def now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def add(self, name: str, seconds: float) -> None:
        if self._current is not None:
            self._current.seconds[name] += seconds

    def timed(self, name: str, fn: Callable[..., object], *args: object) -> object:
        start = self.now()
        out = fn(*args)
        self.add(name, self.now() - start)
        return out

    def time_step(self, step: Callable[..., T], *args: object) -> T:
        """Run one engine step; if it ran a forward (its record began), the whole step's wall time
        joins that record as ``"step"``."""
        start, num_records = self.now(), len(self.steps)
        out = step(*args)
        if len(self.steps) > num_records:
            self.steps[-1].seconds["step"] = self.now() - start
        return out


class Untimed:
    """Profiling off: :class:`OpProfiler`'s calls, timing nothing and recording no step."""

    enabled = False
    steps: tuple[StepRecord, ...] = ()

    @staticmethod
    def begin_step(num_tokens: int, num_seqs: int, is_decode: bool, overlap: str) -> None:
        pass

    @staticmethod
    def timed(name: str, fn: Callable[..., T], *args: object) -> T:
        return fn(*args)

    @staticmethod
    def time_step(step: Callable[..., T], *args: object) -> T:
        return step(*args)


UNTIMED = Untimed()
