"""Run decoder layers by their stage lists (``stages.py``), with one micro-batch or two interleaved.

A layer exposes ``run_op(name, state)`` for every op name its schedules use. With one micro-batch the
ops simply run in order. With two, each micro-batch is a generator that yields at every stage end;
micro-batch A runs ``micro_batch_offset`` stages ahead, then A and B alternate one stage each, so the
transfer one half started (dispatch or combine send) is in flight while the other half computes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from epserve.parallel.stages import OVERLAP_MODES, Schedule


class StagedLayer(Protocol):
    def schedule(self, mode: str) -> Schedule: ...

    def run_op(self, name: str, state: object) -> None: ...


def run_in_order(layers: Sequence[StagedLayer], state: object, mode: str) -> None:
    for layer in layers:
        for op in layer.schedule(mode).ops:
            layer.run_op(op.name, state)


def _stages(layers: Sequence[StagedLayer], state: object, mode: str) -> Iterator[None]:
    for layer in layers:
        for stage in layer.schedule(mode).stages:
            for op in stage.ops:
                layer.run_op(op.name, state)
            yield


def run_interleaved(layers: Sequence[StagedLayer], a: object, b: object, mode: str = "microbatch") -> None:
    """Two micro-batches through ``layers`` by the stage list of ``mode`` (A leads by its offset)."""
    if not layers:
        return
    offset = layers[0].schedule(mode).micro_batch_offset
    first, second = _stages(layers, a, mode), _stages(layers, b, mode)
    for _ in range(offset):
        if next(first, StopIteration) is StopIteration:
            break
    active = [first, second]
    while active:
        for gen in list(active):
            if next(gen, StopIteration) is StopIteration:
                active.remove(gen)


def choose_overlap(mode: str, max_tokens_per_rank: int, threshold: int | None) -> str:
    """The schedule for this step. ``auto``: two micro-batches once every rank's FFN half holds at
    least ``threshold`` tokens (the step's global maximum decides, so all ranks agree; None: never),
    else dispatch overlap; splitting small batches only halves GEMM efficiency."""
    if mode == "auto":
        return "microbatch" if threshold is not None and max_tokens_per_rank >= threshold else "dispatch"
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; choose from {(*OVERLAP_MODES, 'auto')}")
    return mode

