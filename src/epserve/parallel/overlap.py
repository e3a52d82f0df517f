"""Run decoder layers with one micro-batch, or two interleaved (BRIEF.md, "Overlap").

A layer's forward is a generator that yields at the end of every stage of the micro-batch schedule
(``stages.moe_layer_schedule("microbatch")``) and returns its output. With one micro-batch the
generator is simply drained. With two, micro-batch A runs ``offset`` stages ahead, then A and B
alternate one stage each, so the transfer one half started (dispatch or combine send) is in flight
while the other half computes.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

from epserve.config import OVERLAP_CHOICES, OVERLAP_MODES, OverlapMode, OverlapSetting

A = TypeVar("A")
B = TypeVar("B")
Stages = Generator[None, None, A]  # a forward that yields at its stage ends and returns its output


def run_in_order(stages: Stages[A]) -> A:
    """Drain ``stages``; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def run_interleaved(first: Stages[A], second: Stages[B], offset: int) -> tuple[A, B]:
    """Two micro-batches' forwards, ``first`` leading by ``offset`` stages, then alternating."""
    results: dict[int, object] = {}
    active = {0: first, 1: second}

    def advance(i: int) -> None:
        try:
            next(active[i])
        except StopIteration as done:
            results[i] = done.value
            del active[i]

    for _ in range(offset):
        if 0 in active:
            advance(0)
    while active:
        for i in list(active):
            advance(i)
    return results[0], results[1]  # type: ignore[return-value]


def choose_overlap(mode: OverlapSetting, max_tokens_per_rank: int, threshold: int | None) -> OverlapMode:
    """The schedule for this step. ``auto``: two micro-batches once every rank's FFN half holds at
    least ``threshold`` tokens (the step's global maximum decides, so all ranks agree; None: never),
    else dispatch overlap; splitting small batches only halves GEMM efficiency."""
    if mode == "auto":
        return "microbatch" if threshold is not None and max_tokens_per_rank >= threshold else "dispatch"
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; choose from {OVERLAP_CHOICES}")
    return mode
