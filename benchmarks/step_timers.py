"""Timers for the layer benchmarks: the engine's log lines, stamps in stream order (CUDA events or
perf_counter), the forward alone, each decoder layer's attention and FFN, and each op of each layer, the
last two through the layers' op hooks (eager steps only: a captured replay runs no Python); and a decode
batch timed on an eager and a captured engine (``time_batch``)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from common import start_decode_batch

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


WARM_STEPS = 2  # decode steps of each batch before the timed rounds (a bucket's first use; compiles on the CPU)


def decode_steps(args: Any, mode: str) -> int:
    """Decode steps a timed batch runs on the engine of ``mode``: warm-up, the rounds, and on the eager
    engine a layer-timed and an op-timed pass."""
    return WARM_STEPS + args.rounds * args.steps + (2 * args.steps if mode == "eager" else 0)


def prefill_chunk(args: Any) -> int:
    """Tokens a step prefills: long prompts in fewer, larger chunks (the prefill is not what is timed)."""
    return 8192 if args.prompt_len > 2048 else 2048


def prefill_steps(args: Any, batch: int) -> int:
    """Steps the batch's prefill takes; the sequences prefilled first decode during the later ones (decodes
    share a step with prefill chunks), so each request gets this many more tokens: the whole batch is still
    running through every timed step."""
    return -(-batch * args.prompt_len // prefill_chunk(args)) + 1


def run_steps(llm: Any, steps: int, fwd: ForwardTimer, clock: Clock, timer: LayerTimer | OpTimer | None = None,
              running: list[int] | None = None) -> tuple[list[float], list[float]]:
    """``steps`` decode steps of the engine's running batch: each step's wall time and its forward's time
    (``timer``: its op hooks on during those steps only; ``running``: gets the sequences each step runs)."""
    engine = llm.engine
    fwd.take()
    walls = []
    if timer is not None:
        timer.enable(True)
    try:
        for _ in range(steps):
            if running is not None:
                running.append(len(engine.scheduler.running))
            start = time.perf_counter()
            engine.step()
            if clock.cuda:
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    finally:
        if timer is not None:
            timer.enable(False)
    return walls, fwd.take()


def drain(llm: Any, fwd: ForwardTimer) -> None:
    """Run the engine's requests to their end (their ``max_tokens`` is set to last the timed steps)."""
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    fwd.take()


def time_batch(args: Any, batch: int, engines: dict[str, Any], timers: dict[str, ForwardTimer], clock: Clock,
               row: dict[str, Any], save: Callable[[], None], num_layers: int) -> None:
    """One batch size on engines by mode (``eager``, ``captured``; ``args``: ``prompt_len``, ``rounds``,
    ``steps``): each engine prefills its B sequences once, then rounds of timed decode steps alternate between
    the engines; the eager engine then times its layers and its ops. Fills ``row`` (``save()`` after each
    part); ``num_layers``: the model's, for the per-layer forward time."""
    start = time.perf_counter()
    for mode, llm in engines.items():
        start_decode_batch(llm.engine, batch, args.prompt_len, decode_steps(args, mode) + prefill_steps(args, batch),
                           seed=batch, tag=f"b{batch}")
        row[mode] = {"step_ms_rounds": [], "forward_ms_rounds": []}
    row["prefill_s"] = time.perf_counter() - start
    for mode, llm in engines.items():  # warm-up (a bucket's first use; compiles on the CPU)
        run_steps(llm, WARM_STEPS, timers[mode], clock)
    running: dict[str, list[int]] = {mode: [] for mode in engines}
    for _ in range(args.rounds):  # alternating, so drift hits both alike
        for mode, llm in engines.items():
            walls, forwards = run_steps(llm, args.steps, timers[mode], clock, running=running[mode])
            row[mode]["step_ms_rounds"].append(median_ms(walls))
            row[mode]["forward_ms_rounds"].append(median_ms(forwards))
    for mode in engines:
        rec = row[mode]
        rec["min_running"] = min(running[mode])  # the sequences every timed step decoded (B: none finished early)
        rec["step_ms"] = statistics.median(rec["step_ms_rounds"])
        rec["forward_ms"] = statistics.median(rec["forward_ms_rounds"])
        rec["forward_ms_per_layer"] = rec["forward_ms"] / num_layers
    if "captured" in row and "eager" in row and row["captured"]["forward_ms"]:
        row["captured"]["speedup_vs_eager"] = row["eager"]["step_ms"] / row["captured"]["step_ms"]
    save()
    if "eager" in engines:
        model = engines["eager"].engine.runner.model
        kind = {layer.layer_idx: "moe" if layer.is_moe else "dense" for layer in model.layers}
        layers = LayerTimer(model, clock)
        run_steps(engines["eager"], args.steps, timers["eager"], clock, layers)
        row["eager"]["layers"] = {kind[i]: {k: median_ms(v) for k, v in rec.items()}
                                  for i, rec in sorted(layers.take().items())}
        save()
        ops = OpTimer(model, clock)
        run_steps(engines["eager"], args.steps, timers["eager"], clock, ops)
        per_op = {kind[i]: {op: median_ms(v) for op, v in rec.items()} for i, rec in sorted(ops.take().items())}
        row["eager"]["ops"] = per_op
        row["eager"]["op_groups"] = {k: group_ops(v) for k, v in per_op.items()}
        row["eager"]["ops_method"] = ("eager pass, CUDA events around each op of the layers' op hooks, a sleep kernel "
                                      "queued before each (the op's kernels back to back, not its launches)"
                                      if clock.cuda else "eager pass, perf_counter around each op")
    for llm, timer in zip(engines.values(), timers.values()):
        drain(llm, timer)


def median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None
