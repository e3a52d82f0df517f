"""Timers for the layer benchmarks: the engine's log lines, stamps in stream order (CUDA events or
perf_counter), the forward alone, each decoder layer's attention and FFN, and each op of each layer, the
last two through the layers' op hooks (eager steps only: a captured replay runs no Python)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from epserve.parallel.stages import FFN_ALL_GATHER, INPUT_NORM, POST_NORM


class LogLines(logging.Handler):
    """The engine's INFO lines (the graph capture, the KV pool, the kernel backends) as they are logged."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


class Clock:
    """Stamps in stream order: CUDA events on a GPU (no sync until read), perf_counter on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class ForwardTimer:
    """Stamps around ``runner.forward`` (the forward alone: replaying a graph or running eagerly)."""

    def __init__(self, runner: Any, clock: Clock) -> None:
        self.clock, self.spans = clock, []
        forward = runner.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock.stamp()
            out = forward(*args, **kwargs)
            self.spans.append((start, clock.stamp()))
            return out

        runner.forward = timed

    def take(self) -> list[float]:
        spans, self.spans = self.spans, []
        return [self.clock.seconds(a, b) for a, b in spans]


class LayerTimer:
    """Stamps at each decoder layer's first op, its FFN's first op (post-attention norm) and after its last
    op, through the layers' op hooks (eager steps only: a captured replay runs no Python)."""

    MARKS = {INPUT_NORM.name: "start", POST_NORM.name: "ffn"}

    def __init__(self, model: Any, clock: Clock) -> None:
        self.model, self.clock = model, clock
        self.marks: list[tuple[int, str, Any]] = []

    def _hook(self, layer: int) -> Callable[..., Any]:
        def hook(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            if name in self.MARKS:
                self.marks.append((layer, self.MARKS[name], self.clock.stamp()))
            out = fn(*args)
            if name == FFN_ALL_GATHER.name:
                self.marks.append((layer, "end", self.clock.stamp()))
            return out
        return hook

    def enable(self, on: bool) -> None:
        for layer in self.model.layers:
            layer.op_hook = self._hook(layer.layer_idx) if on else None

    def take(self) -> dict[int, dict[str, list[float]]]:
        """Per layer: the attention (start to FFN) and FFN (FFN to end) seconds of each forward."""
        out: dict[int, dict[str, list[float]]] = {}
        open_: dict[int, dict[str, Any]] = {}
        for layer, mark, stamp in self.marks:
            open_.setdefault(layer, {})[mark] = stamp
            if mark == "end" and {"start", "ffn"} <= open_[layer].keys():
                m = open_.pop(layer)
                rec = out.setdefault(layer, {"attention": [], "ffn": [], "layer": []})
                rec["attention"].append(self.clock.seconds(m["start"], m["ffn"]))
                rec["ffn"].append(self.clock.seconds(m["ffn"], stamp))
                rec["layer"].append(self.clock.seconds(m["start"], stamp))
        self.marks = []
        return out


# The ops of a decode step grouped as the V3-layer benchmark reports them (``parallel/stages.py``'s names; an op
# not listed here is reported under its own name).
OP_GROUPS: dict[str, tuple[str, ...]] = {
    "norms": ("input_norm", "post_norm"),
    "attention projections": ("qkv_a_proj", "q_b_proj", "append_kv", "q_absorb", "kv_b_proj", "v_absorb"),
    "MLA decode": ("attention_core",),
    "o_proj": ("o_proj",),
    "gate": ("gate",),
    "dispatch": ("dispatch_send", "dispatch_recv"),
    "grouped experts": ("experts",),
    "shared expert": ("shared_expert",),
    "combine": ("combine_send", "combine_recv"),
    "dense MLP": ("mlp",),
    "TP collectives": ("attn_reduce_scatter", "ffn_all_gather"),
}


class OpTimer:
    """Each op's own time in eager decode steps, through the layers' op hooks: stamps just before and just
    after the op. On a GPU a sleep kernel (``torch.cuda._sleep``, ``queue_ahead_cycles`` clock cycles, about
    1 ms at Hopper's clocks) is queued before each op's start event, so that by the time the GPU reaches the
    start event the host has queued all of the op's kernels behind it: the span is the op's kernels running
    back to back, not the host's launches (an op that waits for the host inside loses that and counts its
    launches). On the CPU, perf_counter around the op (the host's time is the op's time)."""

    def __init__(self, model: Any, clock: Clock, queue_ahead_cycles: int = 2_000_000) -> None:
        self.model, self.clock = model, clock
        self.cycles = queue_ahead_cycles if clock.cuda and hasattr(torch.cuda, "_sleep") else 0
        self.spans: list[tuple[int, str, Any, Any]] = []

    def _hook(self, layer: int) -> Callable[..., Any]:
        def hook(name: str, fn: Callable[..., Any], *args: Any) -> Any:
            if self.cycles:
                torch.cuda._sleep(self.cycles)
            start = self.clock.stamp()
            out = fn(*args)
            self.spans.append((layer, name, start, self.clock.stamp()))
            return out
        return hook

    def enable(self, on: bool) -> None:
        for layer in self.model.layers:
            layer.op_hook = self._hook(layer.layer_idx) if on else None

    def take(self) -> dict[int, dict[str, list[float]]]:
        """Per layer, per op: the seconds of each time it ran."""
        out: dict[int, dict[str, list[float]]] = {}
        for layer, name, start, end in self.spans:
            out.setdefault(layer, {}).setdefault(name, []).append(self.clock.seconds(start, end))
        self.spans = []
        return out


def group_ops(per_op_ms: dict[str, float]) -> dict[str, float]:
    """Per-op milliseconds summed into ``OP_GROUPS`` (ops outside them under their own names)."""
    where = {op: group for group, ops in OP_GROUPS.items() for op in ops}
    out: dict[str, float] = {}
    for op, ms in per_op_ms.items():
        key = where.get(op, op)
        out[key] = out.get(key, 0.0) + ms
    return out


def median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None
