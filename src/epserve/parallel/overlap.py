"""Run decoder layers with one micro-batch, or two interleaved (``docs/architecture.md``, "Overlap").

A layer's forward is a generator that yields at the end of every stage of the micro-batch schedule
(``stages.moe_layer_schedule("microbatch")``); it is the only definition of the layer's computation.
With one micro-batch it is drained (:func:`run_in_order`). With two, micro-batch A runs ``offset``
stages ahead, then A and B alternate one stage each (:func:`run_interleaved`), so the transfer one half
started (dispatch or combine send) is in flight while the other half computes.

A stage generator returns nothing: it leaves its output in the :class:`Result` its caller passes in,
and a layer delegates to its sub-forwards (``MLAttention.forward``, ``MoE.forward``) with a plain
``yield from``. One micro-batch's drained forward is what ``torch.compile(fullgraph=True)`` traces (the
captured decode, ``engine/graphs.py``): dynamo follows generators and attribute writes, but (torch 2.13
on Python 3.11) a ``yield from`` expression's value comes back as None and a ``StopIteration``'s
``value`` is not traceable, so a returned output would be lost.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Generic, TypeVar

from epserve.config import OVERLAP_CHOICES, OVERLAP_MODES, OverlapMode, OverlapSetting

T = TypeVar("T")
Stages = Generator[None, None, None]  # a forward: yields at its stage ends, its output in a Result


class Result(Generic[T]):
    """Where a stage generator leaves its output (``value``) for its caller (module docstring)."""

    __slots__ = ("value",)
    value: T


def run_in_order(stages: Stages) -> None:
    """Run ``stages`` to the end without pausing."""
    for _ in stages:
        pass


def run_interleaved(first: Stages, second: Stages, offset: int) -> None:
    """Run two micro-batches' forwards to the end, ``first`` leading by ``offset`` stages, then
    alternating one stage each."""
    active = {0: first, 1: second}

    def advance(i: int) -> None:
        try:
            next(active[i])
        except StopIteration:
            del active[i]

    for _ in range(offset):
        if 0 in active:
            advance(0)
    while active:
        for i in list(active):
            advance(i)


def choose_overlap(mode: OverlapSetting, max_tokens_per_rank: int, threshold: int | None) -> OverlapMode:
    """The schedule for this step. ``auto``: two micro-batches once every rank's FFN half holds at
    least ``threshold`` tokens (the step's global maximum decides, so all ranks agree; None: never),
    else dispatch overlap; splitting small batches only halves GEMM efficiency."""
    if mode == "auto":
        return "microbatch" if threshold is not None and max_tokens_per_rank >= threshold else "dispatch"
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; choose from {OVERLAP_CHOICES}")
    return mode
