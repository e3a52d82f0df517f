"""Timers for the layer benchmarks: the engine's log lines, stamps in stream order (CUDA events or
perf_counter), the forward alone and each decoder layer's attention and FFN through the layers' op hooks."""

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


def median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None
