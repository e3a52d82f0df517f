"""Calibration from decode steps of the engine itself, and the fits of its points.

- ``engine_step``: the ``tiny`` preset, a model too small to do work, so that what a step spends
  beyond the priced kernels is host overhead. On the CPU with the cores' private caches flushed
  through the model's op hook (``flush_before_blocks``), as a real model's weights flush them.
- ``engine_stream``: a synthetic *wide* model (the ``tiny`` preset's attention and routing with
  ``WIDE`` overrides: hidden 1024, 32-64 experts of 3 MiB, 8 active per token) whose weights exceed
  the last-level cache several times and whose step at batch 1 streams 2-3x that cache. What its steps
  spend beyond the planner's price (host overhead included) is the weight streaming being slower
  inside a step than the back-to-back kernel timings: ``stream_efficiency``. No flushing: its own
  weights evict the caches.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from statistics import linear_regression
from typing import TypeVar

import torch

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment
from epserve.planner.hardware import HardwareSpec, MeasuredPoint
from epserve.planner.step import estimate_step

T = TypeVar("T")

WIDE = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts_per_tok": 8}
STREAM_EFFICIENCY_RANGE = (0.25, 2.0)


def engine_config(layers: int, experts: int = 0) -> dict:
    """``config.json`` of the ``tiny`` preset at ``layers`` layers; with ``experts``, of the wide
    streaming model with that many routed experts."""
    from epserve.presets import build_config

    return build_config("tiny", overrides=_overrides(layers, experts), dtype="bfloat16")


def _overrides(layers: int, experts: int) -> dict:
    wide = {**WIDE, "n_routed_experts": experts} if experts else {}
    return {**wide, "num_hidden_layers": layers}


def measure_engine(
    device: str, depths: Sequence[int], batches: Sequence[int], steps: int, prompt_len: int = 32, experts: int = 0
) -> list[MeasuredPoint]:
    """Median decode step of the engine on the ``tiny`` preset (``engine_step`` points) or, with
    ``experts``, on the wide streaming model (``engine_stream``) at each depth and batch."""
    from epserve import LLM, SamplingParams
    from epserve.presets import make_checkpoint

    kind, label = ("engine_stream", f"wide{experts}") if experts else ("engine_step", "tiny")
    pts = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in depths:
            cfg = engine_config(layers, experts)
            path = make_checkpoint(Path(tmp) / f"{label}-{layers}", preset="tiny", dtype="bfloat16",
                                   overrides=_overrides(layers, experts))
            engine = LLM(path, dtype="bfloat16", device=device, num_blocks=512, enable_prefix_caching=False).engine
            flushed = flush_before_blocks(engine.runner.model) if device == "cpu" and not experts else [0.0]
            params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
            vocab = cfg["vocab_size"] - 10
            for batch in batches:
                for i in range(batch):  # the wide model's requests differ, so that they route as a batch does
                    prompt = [10 + (j + 97 * i * bool(experts)) * (1 + 2 * i * bool(experts)) % vocab
                              for j in range(prompt_len)]
                    engine.add_request(f"calibrate-{batch}-{i}", prompt, params)
                for _ in range(3):  # prefill and two warm decode steps
                    engine.step()
                times = []
                for _ in range(steps):
                    before, start = flushed[0], time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start - (flushed[0] - before))
                while engine.has_unfinished_requests():
                    engine.step()
                times.sort()
                kv = prompt_len + 2 + steps // 2
                pts.append(MeasuredPoint(kind, f"{label} {layers} layers b{batch} kv{kv}", 0.0, 0.0,
                                         times[len(times) // 2] * 1e6))
            del engine
    return pts


def private_cache_bytes() -> int:
    """This CPU's per-core caches (the largest level not shared between cores, from sysfs) summed
    over the cores torch uses; 1 MiB per core if unknown."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "shared_cpu_list").read_text().strip() == "0":  # not the shared last level
                size = (index / "size").read_text().strip()
                sizes.append(int(size.rstrip("KM")) << {"K": 10, "M": 20}.get(size[-1:], 0))
        except OSError:
            continue
    return max(sizes, default=1 << 20) * torch.get_num_threads()


# The ops before which the engine-step calibration flushes the private caches. Today the dense MLP
# only: the module hooks this replaced fired for nothing else (MLAttention and MoE were never called as
# modules), and the fitted overheads and the planner validation in docs/ were measured that way.
FLUSH_BEFORE_OPS = frozenset({"mlp"})


def flush_before_blocks(model: torch.nn.Module) -> list[float]:
    """Through the model's op hook (the one the profiler uses), read twice the cores' private caches
    before each op of ``FLUSH_BEFORE_OPS``, as streaming a block's weights does to the runtime's
    state; returns a one-element list accumulating the seconds spent doing so."""
    buffer = torch.ones(2 * private_cache_bytes() // 4)
    spent = [0.0]

    def hook(name: str, fn: Callable[..., T], *args: object) -> T:
        if name in FLUSH_BEFORE_OPS:
            start = time.perf_counter()
            buffer.sum()
            spent[0] += time.perf_counter() - start
        return fn(*args)

    model.set_op_hook(hook)
    return spent


def _steps(points: Sequence[MeasuredPoint], kind: str) -> list[tuple[ModelConfig, Deployment, float]]:
    """The model, deployment and measured µs of each ``kind`` point (``tiny|wide<experts> <layers>
    layers b<batch> kv<kv>``)."""
    cases = []
    for p in points:
        if p.kind == kind:
            label, layers, _, batch, kv = p.shape.split()
            experts = int(label.removeprefix("wide")) if label.startswith("wide") else 0
            model = ModelConfig.from_dict(engine_config(int(layers), experts))
            d = Deployment(ep=1, batch=int(batch.removeprefix("b")), kv_len=int(kv.removeprefix("kv")),
                           overlap="dispatch", weight_dtype="bf16")
            cases.append((model, d, p.time_us))
    return cases


def fit_overhead(spec: HardwareSpec, points: Sequence[MeasuredPoint]) -> tuple[float, float, float]:
    """``(op_overhead_us, op_overhead_per_token_us, step_overhead_us)`` from ``engine_step`` points.
    The measured step less the step the planner prices without host overhead is
    ``ops x (op_overhead + tokens x per_token) + step_overhead``, the op count read off the planner
    itself (the same stage list). At each batch the slope over the depths is the overhead per op
    (the intercept, the step's, cannot leak into it); a line through those slopes against the
    tokens gives the per-op and per-token parts (where that line is not physical, a negative part, the
    mean slope is all per-op); the intercept at the smallest batch the step's."""
    bare = replace(spec, op_overhead_us=0.0, op_overhead_per_token_us=0.0, step_overhead_us=0.0)
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for model, d, time_us in _steps(points, "engine_step"):
        base = estimate_step(model, bare, d, "dispatch").step_time_us
        ops = estimate_step(model, replace(bare, op_overhead_us=1.0), d, "dispatch").step_time_us - base
        by_batch.setdefault(d.batch, []).append((ops, time_us - base))
    lines = {b: linear_regression(*zip(*pts)) for b, pts in sorted(by_batch.items()) if len({x for x, _ in pts}) > 1}
    if not lines:
        return spec.op_overhead_us, spec.op_overhead_per_token_us, spec.step_overhead_us
    first = min(lines)
    if len(lines) == 1:
        per_op, per_token = max(lines[first][0], 0.0), 0.0
    else:
        per_token, per_op = linear_regression(list(lines), [slope for slope, _ in lines.values()])
        if per_token <= 0 or per_op <= 0:  # the batches do not separate the parts (a busy or a fused host):
            per_token, per_op = 0.0, max(sum(s for s, _ in lines.values()) / len(lines), 0.0)  # one per op
    slope_first = per_op + per_token * first
    step = sum(y - slope_first * x for x, y in by_batch[first]) / len(by_batch[first])
    return per_op, per_token, max(step, 0.0)


def fit_stream_efficiency(spec: HardwareSpec, points: Sequence[MeasuredPoint]) -> float:
    """``stream_efficiency`` from ``engine_stream`` points: the factor on the weight-streaming
    classes' memory fractions at which the planner's steps (priced with ``spec``'s host overheads)
    are on average exactly as long as the measured ones, i.e. the mean relative error over the
    points is zero (found by bisection: the price falls as the factor grows). Clipped to
    ``STREAM_EFFICIENCY_RANGE``; ``spec``'s own value without points."""
    cases = _steps(points, "engine_stream")
    if not cases:
        return spec.stream_efficiency

    def error(factor: float) -> float:
        hw = replace(spec, stream_efficiency=factor)
        return sum(estimate_step(m, hw, d, "dispatch").step_time_us / t - 1 for m, d, t in cases)

    lo, hi = STREAM_EFFICIENCY_RANGE
    if error(lo) <= 0:
        return lo
    if error(hi) >= 0:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def measure_mtp_acceptance(model: str | Path, device: str = "cpu", num_speculative_tokens: int = 1,
                           max_tokens: int = 64) -> dict[str, object]:
    """The draft acceptance of ``model``'s MTP layer on this engine: greedy continuations of the engine's own
    probe prompts (``engine.spec_probe.MTP_PROMPTS``, all of them) with ``speculative="mtp"``, every step
    drafting; ``llm.speculative_stats()``."""
    from epserve.engine.llm import LLM
    from epserve.engine.spec_probe import MTP_PROMPTS, measure_acceptance, probe_prompts

    with LLM(model, device=device, speculative="mtp", num_speculative_tokens=num_speculative_tokens) as llm:
        engine = llm.engine
        assert engine is not None  # (one rank)
        measure_acceptance(engine, probe_prompts(engine.config, len(MTP_PROMPTS)), max_tokens)
        return llm.speculative_stats()  # type: ignore[return-value]
