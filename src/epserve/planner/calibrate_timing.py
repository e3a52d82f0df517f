"""What ``calibrate`` and ``calibrate_fp4`` share: the shapes they measure, how a kernel is timed
(``time_calls``) and how tokens spread over experts (``routed_counts``)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

SIZES = {  # (quick, full)
    "rows": ((1, 4, 64, 256), (1, 2, 4, 8, 12, 24, 32, 64, 128, 256, 1024)),  # + the CPU kernel's tile edge
    "expert_rows": ((1, 4), (1, 2, 4, 6, 8, 12, 24, 32, 64)),  # + the tile edge
    "pool_bytes": (96 << 20, 256 << 20),  # weights cycled through: 3-8x a 32 MiB last-level cache
    "stream_bytes": (256 << 20, 1 << 30),
    "attn": (((8, 16, 256), (64, 4, 256)),  # (heads, requests, KV length): few heads pin the bandwidth,
             ((8, 64, 128), (8, 16, 512), (8, 1, 4096), (64, 16, 512), (64, 1, 4096))),  # many the FLOP/s
    "norm_tokens": ((16, 256), (16, 256, 2048)),
    "a2a": ((1 << 10, 1 << 16, 1 << 20), (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)),
    "a2a_loaded": ((1 << 10, 1 << 18), (1 << 10, 1 << 16, 1 << 18, 1 << 20)),
    "engine_layers": ((2, 6), (2, 5, 8)),  # tiny preset depths (1 dense + MoE layers)
    "engine_batches": ((1, 32), (1, 16, 64)),
    "engine_steps": (12, 30),
    "stream_model": ((3, 32), (4, 64)),  # wide model: layers (1 dense + MoE), routed experts: 0.2 / 0.6 GiB
    "stream_batches": ((1,), (1, 16)),
}
BUDGET_S = (0.03, 0.25)  # time spent measuring one shape
GEMM_KN = ((2048, 4096), (1024, 512))  # K, N of the calibration GEMMs: 16 MiB and 1 MiB bf16 weights
EXPERT_DIMS = ((2048, 1024), (1024, 256))  # hidden, intermediate: large (12 MiB) and small (1.5 MiB) experts
EXPERTS_PER_CALL = (8, 16)  # quick, full


def time_calls(device: str, calls: Sequence[Callable[[], object]], budget_s: float) -> float:
    """Median time of one call in µs, cycling through ``calls`` (each on its own weights, so nothing
    stays cached) for about ``budget_s`` and at least one full cycle. CPU: each call timed alone;
    CUDA: chunks of calls between synchronisations."""
    cuda = device == "cuda"
    chunk = max(4, len(calls)) if cuda else 1
    calls[0]()
    if cuda:
        torch.cuda.synchronize()
    samples: list[float] = []
    start, i = time.perf_counter(), 0
    while True:
        t = time.perf_counter()
        for _ in range(chunk):
            calls[i % len(calls)]()
            i += 1
        if cuda:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) / chunk)
        elapsed = time.perf_counter() - start
        if len(samples) >= 3 and (i >= len(calls) and elapsed > budget_s or elapsed > 4 * budget_s or i >= 4000):
            break
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def routed_counts(mean_rows: float, groups: int, seed: int = 0) -> tuple[int, ...]:
    """Rows of ``groups`` active experts averaging about ``mean_rows``, as uniform random routing
    spreads them: each expert's count is Poisson, conditioned on the expert being active (>= 1),
    with the rate whose conditional mean is ``mean_rows``. A kernel that tiles rows or pads groups
    (or, on the CPU, hands a layer to torch when one expert overflows its tile) pays for the spread,
    not just the mean, so the curve is measured under the routing the planner assumes."""
    if mean_rows <= 1:
        return (1,) * groups
    lo, hi = 0.0, float(mean_rows)  # lam / (1 - exp(-lam)) rises from 1 at 0 to mean_rows below mean_rows
    for _ in range(60):
        lam = (lo + hi) / 2
        lo, hi = (lam, hi) if lam / -math.expm1(-lam) < mean_rows else (lo, lam)
    gen = torch.Generator().manual_seed(seed)
    counts: list[int] = []
    while len(counts) < groups:
        draw = torch.poisson(torch.full((2 * groups,), lam, dtype=torch.float64), generator=gen)
        counts += [int(c) for c in draw.tolist() if c >= 1]
    return tuple(counts[:groups])
