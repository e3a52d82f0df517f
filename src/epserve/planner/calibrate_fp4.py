"""The four-bit kernels' points of ``epserve plan calibrate``: the engine's NVFP4 linear
(``kernels.nvfp4.nvfp4_linear``) and routed experts (``GroupedExperts(nvfp4=True)``, ``nvfp4_moe_swiglu``) timed as
the bf16 ``gemm`` and ``group_gemm`` points are (the same shapes, rows and pools of weights larger than the
caches), as the classes ``gemm_fp4`` and ``group_gemm_fp4`` (``hardware.FP4_CLASSES``).

An NVFP4 weight moves half a byte per value and one e4m3 scale per 16 (``FP4_BYTES``), but a W4A16 kernel also
decodes every e2m1 code and its two scales before it multiplies, so at few rows it may be bound by that decode
rather than by memory: the bf16 kernels' bytes per second do not price it. Its own curves (``memory_by_rows``: bytes
per second by rows and weight size) do, and ``ops`` prices an FP4 GEMM with them where the hardware file has them
(``HardwareSpec.kernel_class``). Weight values do not change the kernels' speed: random codes, one block scale.
"""

from __future__ import annotations

from functools import partial

import torch

from epserve.planner.calibrate_timing import (
    BUDGET_S,
    EXPERT_DIMS,
    EXPERTS_PER_CALL,
    GEMM_KN,
    SIZES,
    routed_counts,
    time_calls,
)
from epserve.planner.deployment import WEIGHT_BYTES
from epserve.planner.hardware import FP4_CLASSES, MeasuredPoint
from epserve.planner.memory import PART_BYTES

FP4_BYTES = WEIGHT_BYTES["fp4"]  # per weight value: an e2m1 code and a 16th of an e4m3 block scale
SCALARS = PART_BYTES["fp4"]  # per linear (a part of a fused weight): its fp32 global and input scales


def _packed(*shape: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e2m1 codes for a ``[..., N, K]`` weight and its block scales (all 0.5)."""
    *lead, n, k = shape
    codes = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.full((*lead, n, k // 16), 0.5, device=device).to(torch.float8_e4m3fn)
    return codes, scales


def _experts(count: int, h: int, inter: int, device: str) -> torch.nn.Module:
    from epserve.moe.experts import GroupedExperts

    experts = GroupedExperts(count, h, inter, nvfp4=True, act_dtype=torch.bfloat16)
    for name, shape in (("w13", (count, 2 * inter, h)), ("w2", (count, h, inter))):
        codes, scales = _packed(*shape, device=device)
        getattr(experts, name).data = codes
        getattr(experts, f"{name}_scale").data = scales
        for scalar in ("scale_2", "input_scale"):
            param = getattr(experts, f"{name}_{scalar}")
            param.data = torch.ones(param.shape, dtype=torch.float32, device=device)
    return experts


def measure_fp4_kernels(device: str, dtype: torch.dtype, quick: bool) -> list[MeasuredPoint]:
    """``gemm_fp4`` and ``group_gemm_fp4`` points, activations in ``dtype`` (W4A16)."""
    from epserve.kernels.cpu import TILE_M
    from epserve.kernels.nvfp4 import nvfp4_linear
    from epserve.moe.dispatch.base import ExpertInput

    q = 0 if quick else 1
    budget, pool_bytes = BUDGET_S[q], SIZES["pool_bytes"][q]
    tile = (TILE_M, TILE_M + 1) if device == "cpu" else ()
    esize = torch.finfo(dtype).bits // 8
    one = torch.ones(1, dtype=torch.float32, device=device)
    pts: list[MeasuredPoint] = []
    for k, n in GEMM_KN:
        pool = [_packed(n, k, device=device) for _ in range(max(2, int(pool_bytes // (n * k * FP4_BYTES))))]
        for m in sorted({*SIZES["rows"][q], *tile}):
            x = torch.randn(m, k, device=device, dtype=dtype)
            t = time_calls(device, [partial(nvfp4_linear, x, w, s, one) for w, s in pool], budget)
            moved = n * k * FP4_BYTES + SCALARS + (m * k + m * n) * esize
            pts.append(MeasuredPoint(FP4_CLASSES["gemm"], f"{m}x{k}x{n}", 2 * m * k * n, moved, t))
        del pool
    per_call = EXPERTS_PER_CALL[q]
    for h, inter in EXPERT_DIMS:
        weights = per_call * 3 * h * inter
        modules = [_experts(per_call, h, inter, device)
                   for _ in range(max(1, int(pool_bytes // (weights * FP4_BYTES))))]
        for m in sorted({*SIZES["expert_rows"][q], *tile}):
            counts = routed_counts(m, per_call, seed=m)
            tokens = sum(counts)
            inp = ExpertInput(torch.randn(tokens, h, device=device, dtype=dtype),
                              torch.tensor(counts, dtype=torch.int64, device=device), tuple(counts))
            t = time_calls(device, [partial(e, inp) for e in modules], budget)
            moved = weights * FP4_BYTES + per_call * 3 * SCALARS + tokens * (h + 2 * inter + inter + h) * esize
            pts.append(MeasuredPoint(FP4_CLASSES["group_gemm"], f"{per_call}x{tokens / per_call:.4g}x{h}x{inter}",
                                     6 * tokens * h * inter, moved, t))
        del modules
    return pts


def fp4_curve_point(p: MeasuredPoint, floor_us: float, other_bw: float) -> tuple[float, float, float]:
    """Rows per weight, bytes of one weight matrix (as the planner counts an FP4 one) and attained bytes/s of a
    ``gemm_fp4`` or ``group_gemm_fp4`` point, its time split as ``calibrate._curve_point`` splits the bf16 ones."""
    d = [float(v) for v in p.shape.split("x")]
    if p.kind == FP4_CLASSES["gemm"]:
        return d[0], d[1] * d[2] * FP4_BYTES, p.bytes / max(p.time_us - floor_us, 1e-3) * 1e6
    act_us = floor_us + d[0] * d[1] * d[3] * 6 / other_bw * 1e6  # read gate and up, write the product
    return d[1], 3 * d[2] * d[3] * FP4_BYTES / 2, p.bytes / max(p.time_us - 2 * floor_us - act_us, 1e-3) * 1e6
