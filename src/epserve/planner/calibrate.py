"""``epserve plan calibrate``: time the engine's own kernels and steps on this device (bf16, on CUDA or
the CPU) and write a hardware file. The points:

- ``floor``: ``epserve.kernels.linear`` on one row of a 32 x 32 weight: the per-kernel floor;
- ``stream``: a reduction over a buffer far larger than the caches: the bandwidth a weight stream
  can reach (a CPU's "datasheet" figure);
- ``gemm``: ``epserve.kernels.linear`` (the CPU's AVX512-BF16 kernel up to its tile of rows, torch
  beyond it and on CUDA) at 1 ... 1024 rows on 16 MiB and 1 MiB weights; ``group_gemm``: the engine's
  ``GroupedExperts`` at 1 ... 64 tokens per expert (spread as routing spreads them) on 12 MiB and
  1.5 MiB experts; both cycling through weights that together exceed the caches; ``gemm_fp4`` and
  ``group_gemm_fp4``: the same with NVFP4 weights, the engine's four-bit kernels (``calibrate_fp4``);
- ``attention``: the engine's MLA decode attention; ``other``: its RMSNorm;
- ``all_to_all``: between ``world_size`` rank processes (``calibrate_ranks``);
- ``engine_step`` and ``engine_stream``: decode steps of the engine itself (``calibrate_engine``).

The fit: the floor is ``kernel_latency_us``; per class the best attained FLOP/s and bytes/s (the
floor taken off) become the achievable fractions of a datasheet entry (a recognised GPU) or, on an
unknown device, of the best measured rates themselves; the GEMM and grouped-GEMM points become the
achievable-bandwidth curves ``memory_by_rows`` by rows and weight size (their FP4 twins those of the
four-bit kernels, which price FP4 weights: ``HardwareSpec.kernel_class``; the planner then reproduces
every measured point); the engine steps give the host overheads and ``stream_efficiency``
(``calibrate_engine``). Only these calibration modules import torch.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from functools import partial

import torch

from epserve.parallel.launch import threads_per_rank
from epserve.planner.calibrate_engine import fit_overhead, fit_stream_efficiency, measure_engine
from epserve.planner.calibrate_fp4 import fp4_curve_point, measure_fp4_kernels
from epserve.planner.calibrate_ranks import (
    CalibrationRank,
    MeasureLoaded,
    fit_loaded,
    measure_all_to_all,
    one_host_link,
    resolve_pin,
    run_ranks,
)
from epserve.planner.calibrate_timing import (
    BUDGET_S,
    EXPERT_DIMS,
    EXPERTS_PER_CALL,
    GEMM_KN,
    SIZES,
    routed_counts,
    time_calls,
)
from epserve.planner.errors import PlanError
from epserve.planner.gpus import BUILTIN
from epserve.planner.hardware import FP4_CLASSES, Efficiency, HardwareSpec, MeasuredPoint


def _measure_kernels(device: str, dtype: torch.dtype, quick: bool) -> list[MeasuredPoint]:
    from epserve.kernels import linear
    from epserve.kernels.cpu import TILE_M
    from epserve.model.layers import RMSNorm
    from epserve.moe.dispatch.base import ExpertInput
    from epserve.moe.experts import GroupedExperts

    q = 0 if quick else 1
    budget = BUDGET_S[q]
    esize = torch.finfo(dtype).bits // 8
    pool_bytes = SIZES["pool_bytes"][q]
    tile = (TILE_M, TILE_M + 1) if device == "cpu" else ()  # either side of the CPU kernels' handover to torch
    pts: list[MeasuredPoint] = []

    def full(*shape: int) -> torch.Tensor:  # values do not change the speed; filling is cheap
        return torch.full(shape, 0.01, device=device, dtype=dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    tiny_x, tiny_w = rand(1, 32), rand(32, 32)
    pts.append(MeasuredPoint("floor", "linear 1x32x32", 0.0, 0.0,
                             time_calls(device, [partial(linear, tiny_x, tiny_w)], budget)))
    stream = SIZES["stream_bytes"][q]
    data = torch.ones(stream // 4, dtype=torch.float32, device=device)
    pts.append(MeasuredPoint("stream", f"sum {stream >> 20} MiB", 0.0, float(stream),
                             time_calls(device, [data.sum], budget)))
    del data

    for k, n in GEMM_KN:  # two weight sizes: small matrices stream slower than large ones
        pool = [full(n, k) for _ in range(max(2, pool_bytes // (n * k * esize)))]
        for m in sorted({*SIZES["rows"][q], *tile}):
            x = rand(m, k)
            t = time_calls(device, [partial(linear, x, w) for w in pool], budget)
            pts.append(MeasuredPoint("gemm", f"{m}x{k}x{n}", 2 * m * k * n, (m * k + n * k + m * n) * esize, t))
        del pool

    per_call = EXPERTS_PER_CALL[q]
    for h, inter in EXPERT_DIMS:  # two expert sizes, as for the GEMMs
        modules = []
        for _ in range(max(1, pool_bytes // (per_call * 3 * h * inter * esize))):  # enough to leave the caches
            experts = GroupedExperts(per_call, h, inter)
            experts.w13.data = full(per_call, 2 * inter, h)
            experts.w2.data = full(per_call, h, inter)
            modules.append(experts)
        for m in sorted({*SIZES["expert_rows"][q], *tile}):
            counts = routed_counts(m, per_call, seed=m)
            tokens = sum(counts)
            inp = ExpertInput(rand(tokens, h), torch.tensor(counts, dtype=torch.int64), tuple(counts))
            t = time_calls(device, [partial(e, inp) for e in modules], budget)
            weights = per_call * 3 * h * inter
            moved = weights + tokens * (h + 2 * inter + inter + h)  # per expert: its weights; per row: in and out
            pts.append(MeasuredPoint("group_gemm", f"{per_call}x{tokens / per_call:.4g}x{h}x{inter}",
                                     6 * tokens * h * inter, moved * esize, t))
        del modules

    pts += _measure_attention(device, dtype, quick, budget)
    for tokens in SIZES["norm_tokens"][q]:
        norm = RMSNorm(4096).to(device=device, dtype=dtype)
        x = rand(tokens, 4096)
        t = time_calls(device, [partial(norm, x)], budget)
        pts.append(MeasuredPoint("other", f"rmsnorm {tokens}x4096", 0.0, 2 * tokens * 4096 * esize, t))
    return pts


def _measure_attention(device: str, dtype: torch.dtype, quick: bool, budget: float) -> list[MeasuredPoint]:
    """The engine's decode attention (``MLAttention.decode_attention``: W_UK, MQA over the latent
    cache, W_UV) on DeepSeek-V3's MLA dimensions."""
    from epserve.config import ModelConfig
    from epserve.model.batch import ForwardBatch
    from epserve.model.mla import MLAttention
    from epserve.planner.models import DEEPSEEK_V3

    block = 16
    pts = []
    modules: dict[int, tuple[ModelConfig, MLAttention]] = {}
    for heads, requests, length in SIZES["attn"][0 if quick else 1]:
        if heads not in modules:
            cfg = ModelConfig.from_dict({**DEEPSEEK_V3, "num_attention_heads": heads, "num_key_value_heads": heads,
                                         "hidden_size": 1024, "max_position_embeddings": 8192,
                                         "quantization_config": None})
            attn = MLAttention(cfg)
            torch.nn.init.normal_(attn.kv_b_proj.weight, std=0.02)
            attn = attn.to(device=device, dtype=dtype)
            attn.w_uk, attn.w_uv_t = attn.w_uk.float(), attn.w_uv_t.float()  # fp32, as the engine keeps them
            attn.prepare()
            modules[heads] = cfg, attn
        cfg, attn = modules[heads]
        dim = cfg.kv_cache_dim
        blocks = -(-length // block)
        cache = torch.randn(requests * blocks + 1, block, dim, device=device, dtype=dtype)
        lens = (length,) * requests

        def t(values: object) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        batch = ForwardBatch(
            input_ids=t([0] * requests), positions=t([length - 1] * requests), slot_mapping=t([0] * requests),
            seq_lens=t(lens),
            block_tables=t(list(range(1, requests * blocks + 1))).view(requests, blocks),
            logits_indices=t(list(range(requests))), num_decode_seqs=requests, seq_lens_cpu=lens,
            query_start_loc_cpu=tuple(range(requests + 1)), block_size=block)
        query = torch.randn(requests, heads, cfg.qk_head_dim, device=device, dtype=dtype)
        us = time_calls(device, [partial(attn.decode_attention, query, batch, cache)], budget)
        flops = 2 * requests * heads * length * (dim + cfg.kv_lora_rank)
        moved = requests * length * dim * 2 + requests * heads * (dim + cfg.kv_lora_rank) * 2
        pts.append(MeasuredPoint("attention", f"{requests}x{heads}x{length}", flops, moved, us))
    return pts


def _fit(points: list[MeasuredPoint], floor_us: float, kind: str) -> tuple[float, float]:
    """Best attained FLOP/s and bytes/s of one kernel class, its per-kernel floor taken off."""
    own = [p for p in points if p.kind == kind and p.time_us > 2 * floor_us]  # floor-dominated points say nothing
    flops = max((p.flops / max(p.time_us - floor_us, 1e-3) * 1e6 for p in own), default=0.0)
    moved = max((p.bytes / max(p.time_us - floor_us, 1e-3) * 1e6 for p in own), default=0.0)
    return flops, moved


def _curve_point(p: MeasuredPoint, floor_us: float, other_bw: float, esize: int = 2) -> tuple[float, float, float]:
    """Rows per weight, bytes of one weight matrix and attained bytes/s of a gemm (``m x k x n``) or
    group_gemm (``experts x mean m x h x inter``: an expert's ``3 h inter`` over its two GEMMs) point,
    its time split as the planner splits it: a grouped SwiGLU is priced as two grouped GEMMs plus an
    elementwise SwiGLU kernel, each with its floor."""
    d = [float(v) for v in p.shape.split("x")]
    if p.kind == "gemm":
        return d[0], d[1] * d[2] * esize, p.bytes / max(p.time_us - floor_us, 1e-3) * 1e6
    act_us = floor_us + d[0] * d[1] * d[3] * 6 / other_bw * 1e6  # read gate and up, write the product
    return d[1], 3 * d[2] * d[3] * esize / 2, p.bytes / max(p.time_us - 2 * floor_us - act_us, 1e-3) * 1e6


def _fraction(x: float) -> float:
    """A share of a peak, to 4 significant digits, in (0, 1]."""
    return min(1.0, max(float(f"{x:.4g}"), 1e-6))


def calibrate(quick: bool = False, device: str | None = None, world_size: int = 2,
              base: HardwareSpec | None = None, engine: bool = True) -> HardwareSpec:
    """Measure this device and return a ``HardwareSpec`` whose fractions, curves and overheads are
    the measured ones. ``engine=False`` skips the engine steps (host overheads and
    ``stream_efficiency`` stay the base's)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda but CUDA is not available")
    if device == "cuda":  # NCCL needs one GPU per rank; with fewer, the link figures stay the datasheet's
        world_size = min(world_size, torch.cuda.device_count())
    dtype = torch.bfloat16
    with torch.inference_mode():
        points = _measure_kernels(device, dtype, quick) + measure_fp4_kernels(device, dtype, quick)
    if world_size > 1:
        points += measure_all_to_all(world_size, SIZES["a2a"][0 if quick else 1], 5 if quick else 20, device)
    floor = next(p.time_us for p in points if p.kind == "floor")
    stream = next(p for p in points if p.kind == "stream")
    rates = {c: _fit(points, floor, c) for c in ("gemm", "group_gemm", "attention", "other")}
    other_bw = rates["other"][1] or stream.bytes / stream.time_us * 1e6
    rows_fit = {c: [_curve_point(p, floor, other_bw) for p in points if p.kind == c] for c in ("gemm", "group_gemm")}
    rows_fit.update({c: [fp4_curve_point(p, floor, other_bw) for p in points if p.kind == c]
                     for c in FP4_CLASSES.values()})
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    base = base or next((BUILTIN[k] for k in ("gb200", "b200", "h800", "h200", "h100") if k in name.lower()), None)
    if base is None:
        memory = (torch.cuda.get_device_properties(0).total_memory if device == "cuda"
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        peak = max(r[0] for r in rates.values())
        bw = max([stream.bytes / stream.time_us * 1e6, *(b for c in rows_fit.values() for _, _, b in c)])
        if not peak > 0 or not 0 < bw < float("inf"):  # timings too noisy to fit (a busy host)
            raise PlanError(f"the calibration's timings did not fit (compute rate {peak:g} FLOP/s, bandwidth "
                            f"{bw:g} B/s): was the host busy? Run it again on an idle one")
        base = HardwareSpec(name=f"local-{name}", peak_flops={"bf16": peak}, memory_bytes=int(memory),
                            memory_bandwidth=bw, nvlink_bandwidth=bw, ib_bandwidth=bw,
                            gpus_per_node=max(8, os.cpu_count() or 1), nvlink_efficiency=1.0, ib_efficiency=1.0)
    peak, bw = base.flops_for("bf16"), base.memory_bandwidth
    rates.update({c: _fit(points, floor, c) for c in FP4_CLASSES.values()})  # (the curves above give the peak)
    efficiency = {c: Efficiency(compute=_fraction(f / peak) if f else base.eff(c).compute,
                                memory=_fraction(b / bw) if b else base.eff(c).memory)
                  for c, (f, b) in rates.items()}
    curves = {c: tuple(sorted((round(r, 3), size, _fraction(b / bw)) for r, size, b in fit))
              for c, fit in rows_fit.items() if fit}
    # Measured here: the public tables' curves and floors give way; only InfiniBand, which one host
    # cannot measure, keeps the base entry's fits (a CPU host has none).
    changes: dict = {"efficiency": efficiency, "memory_by_rows": curves, "kernel_latency_us": round(floor, 3),
                     "efficiency_curves": {}, "kernel_floors": {}, "gemm_depth_half": 0.0, "sources": {},
                     "all_to_all_fits": {k: v for k, v in base.all_to_all_fits.items() if k.startswith("ib_")}}
    a2a = sorted((p for p in points if p.kind == "all_to_all"), key=lambda p: p.bytes)
    if a2a:
        latency = a2a[0].time_us
        link = max((p.bytes / max(p.time_us - latency, 1e-3) * 1e6 for p in a2a[1:]), default=0.0)
        changes.update(nvlink_latency_us=round(latency, 2), collective_latency_us=round(latency, 2),
                       dispatch_handshake_us=round(latency, 2), step_sync_us=round(latency, 2))
        if base.name.startswith("local-"):
            changes.update(one_host_link(link or base.nvlink_bandwidth), ib_latency_us=round(latency, 2))
        elif link:
            changes["nvlink_efficiency"] = round(min(1.0, link / base.nvlink_bandwidth), 4)
    if engine:
        q = 0 if quick else 1
        steps = SIZES["engine_steps"][q]
        points += measure_engine(device, SIZES["engine_layers"][q], SIZES["engine_batches"][q], steps)
        op_us, token_us, step_us = fit_overhead(replace(base, **changes), points)
        changes.update(op_overhead_us=round(op_us, 2), op_overhead_per_token_us=round(token_us, 4),
                       step_overhead_us=round(step_us, 1))
        layers, experts = SIZES["stream_model"][q]
        points += measure_engine(device, (layers,), SIZES["stream_batches"][q], steps, experts=experts)
        changes["stream_efficiency"] = round(fit_stream_efficiency(replace(base, **changes), points), 4)
    changes["points"] = tuple(points)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    peaks = "the best measured rates" if base.name.startswith("local-") else base.source
    changes["source"] = (f"calibrated on {name} ({device}, {dtype}, {torch.get_num_threads()} threads) at {stamp} "
                         f"by `epserve plan calibrate{' --quick' if quick else ''}`; peaks from {peaks}")
    return replace(base, **changes)


@dataclass(frozen=True)
class CalibrateRank:
    """Rank 0 calibrates (its ``HardwareSpec``); the others stream memory (a sum over 256 MiB, over
    and over) until it is done, as an engine rank's peers stream their weights."""

    quick: bool
    base: HardwareSpec | None
    engine: bool

    def run(self, rank: CalibrationRank) -> HardwareSpec | None:
        if rank.ctx.rank > 0:
            data = torch.ones(SIZES["stream_bytes"][0] // 4)
            while not rank.done.is_set():
                data.sum()
            return None
        try:
            return calibrate(quick=self.quick, device="cpu", world_size=1, base=self.base, engine=self.engine)
        finally:
            rank.done.set()


def calibrate_ranks(ranks: int, quick: bool = False, base: HardwareSpec | None = None,
                    engine: bool = True, pin: bool | None = None) -> HardwareSpec:
    """A calibration of one rank of a CPU engine that runs ``ranks`` rank processes on this host:
    rank 0 calibrates with the engine's threads per rank while the ``ranks - 1`` others stream memory
    without pause (an engine rank's peers stream their weights during most of a step; a competitor
    repeating the calibration itself spent much of its time building models and understated the
    contention: predictions 20-30% low at dp 2), then the same processes time the collectives while
    computing between them (``MeasureLoaded``): the rows' latency and bandwidth, the dispatcher's
    count exchange and the step's all-reduce. ``pin``: every process pinned to its rank's block of
    cores, as the engine pins its CPU ranks; default: as the engine does (unless ``EPSERVE_PIN=0``)."""
    pin = resolve_pin(pin)
    spec, loaded = run_ranks(ranks, "cpu", threads_per_rank(ranks), pin, CalibrateRank(quick, base, engine),
                              MeasureLoaded(SIZES["a2a_loaded"][0 if quick else 1], 60 if quick else 200))
    fit = fit_loaded(loaded)
    changes: dict = {k: v for k, v in fit.items() if k != "link_bandwidth"}
    if "link_bandwidth" in fit and spec.name.startswith("local-"):
        changes.update(one_host_link(fit["link_bandwidth"]))
    changes["points"] = (*(p for p in spec.points if p.kind != "all_to_all"), *loaded)
    changes["source"] = (f"{spec.source}; one of {ranks} {'pinned' if pin else 'unpinned'} rank processes "
                         f"calibrating at once, collectives timed between {ranks} computing ranks "
                         f"(`epserve plan calibrate --ranks {ranks}{'' if pin else ' --no-pin'}`)")
    return replace(spec, **changes)
