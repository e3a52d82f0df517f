"""Efficiency curves, kernel floors and all-to-all fits computed from the published tables (``kernel_tables``).

- **GEMM and grouped GEMM** (DeepGEMM, H800, FP8): a row is *memory-bound* when its arithmetic
  intensity (the planner's FLOPs over the planner's bytes, which are DeepGEMM's) is at most half the
  datasheet ridge, *compute-bound* when at least 1.5 times it; rows in between sit at the roofline's
  knee, where neither fraction is reached, and are held out (priced in the validation table). The
  memory-bound rows (dense, M = 64 and 128) give, by least squares over all of them at once,
  ``time = floor + bytes / (fraction(M) x HBM)``: one kernel floor and a memory fraction per M. Each
  compute-bound row gives ``c = FLOPs / ((time - floor) x peak)``; over all of them at once, ``1 / c``
  is a line in ``1 / K`` (a tile's prologue and epilogue amortised over its K loop): ``c = c_M x K /
  (K + K_half)``, with ``K_half`` the depth at which a GEMM reaches half its deep-K fraction and
  ``c_M`` (per class and M) the mean of ``c (K + K_half) / K`` over the rows.
  DeepGEMM publishes no memory-bound grouped row: a grouped GEMM's memory curve is the dense one's.
- **All-to-all** (per link and direction): ``time = max(floor, intercept + bytes / (link x
  efficiency))`` with bytes counted as ``cost.all_to_all`` counts them (every (token, expert) copy to
  another GPU: NVLink copies inside the node, InfiniBand the rest). The floor is the published
  one-token latency; intercept and efficiency a least-squares line through the bandwidth regime.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from epserve.planner.kernel_tables import (
    COLLECTIVE_CITATIONS,
    COLLECTIVE_ROWS,
    DEEPEP_NORMAL,
    DEEPEP_NORMAL_NVLINK_GBS,
    DEEPGEMM,
    DEEPGEMM_ROWS,
    H800_NVLINK_GBS,
    CollectiveRow,
    GemmRow,
)

H800_FP8_FLOPS = 1979e12
H800_HBM = 3.35e12
RIDGE = H800_FP8_FLOPS / H800_HBM  # FLOP per byte
TOP_K = 8
BANDWIDTH_REGIME_TOKENS = 256  # TensorRT-LLM NVLinkOneSided rows from here on lie on a line


@dataclass(frozen=True)
class CurvePoint:
    """An achieved fraction of the datasheet peak at ``rows`` (M of a GEMM, tokens per expert of a
    grouped GEMM); ``compute`` or ``memory`` is 0 where this point does not measure it."""

    rows: float
    compute: float
    memory: float
    source: str


@dataclass(frozen=True)
class AllToAllFit:
    """``time = max(floor(EP), intercept + bytes / (link bandwidth x efficiency))`` for one link and
    direction; ``floors`` are ``(EP, us)`` points (the one-token latency grows with the EP size: more
    peers to synchronise with), linear in log EP between them and flat outside."""

    floors: tuple[tuple[float, float], ...]
    intercept_us: float
    efficiency: float
    source: str

    def floor_us(self, ep: float) -> float:
        pts = sorted(self.floors)
        if ep <= pts[0][0]:
            return pts[0][1]
        for (e0, f0), (e1, f1) in zip(pts, pts[1:]):
            if ep <= e1:
                return f0 + (f1 - f0) * math.log(ep / e0) / math.log(e1 / e0)
        return pts[-1][1]


@dataclass(frozen=True)
class KernelFloor:
    """The least time one kernel of a class takes under CUDA graphs."""

    us: float
    source: str


@dataclass(frozen=True)
class GemmFit:
    floor_us: float
    memory_by_m: dict[int, float]  # dense memory-bound rows
    depth_half: float  # K_half of the compute-bound rows
    compute_by_class_m: dict[tuple[str, int], float]  # (gemm | group_gemm, M): deep-K fraction c_M
    held_out: tuple[GemmRow, ...]  # at the knee: not used by the fit


def intensity(row: GemmRow) -> float:
    return row.flops / row.bytes


def gemm_class(row: GemmRow) -> str:
    return "gemm" if row.layout == "dense" else "group_gemm"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


@cache
def fit_gemm() -> GemmFit:
    import numpy as np

    memory_rows = [r for r in DEEPGEMM_ROWS if r.layout == "dense" and intensity(r) <= RIDGE / 2]
    ms = sorted({r.m for r in memory_rows})
    design = np.array([[1.0] + [r.bytes if r.m == m else 0.0 for m in ms] for r in memory_rows])
    times = np.array([r.time_us * 1e-6 for r in memory_rows])
    coef = np.linalg.lstsq(design, times, rcond=None)[0]
    floor_us = float(coef[0]) * 1e6
    memory = {m: float(1.0 / (b * H800_HBM)) for m, b in zip(ms, coef[1:])}
    compute_rows = [r for r in DEEPGEMM_ROWS if intensity(r) >= 1.5 * RIDGE]
    achieved = [r.flops / ((r.time_us - floor_us) * 1e-6) / H800_FP8_FLOPS for r in compute_rows]
    a, b = _line([1.0 / r.k for r in compute_rows], [1.0 / c for c in achieved])
    depth_half = b / a
    by: dict[tuple[str, int], list[float]] = {}
    for r, c in zip(compute_rows, achieved):
        by.setdefault((gemm_class(r), r.m), []).append(c * (r.k + depth_half) / r.k)
    held = tuple(r for r in DEEPGEMM_ROWS if r not in memory_rows and r not in compute_rows)
    return GemmFit(floor_us, memory, depth_half, {k: _mean(v) for k, v in sorted(by.items())}, held)


def hopper_curves() -> dict[str, tuple[CurvePoint, ...]]:
    """The ``gemm`` and ``group_gemm`` efficiency curves of the built-in entries (DeepGEMM on H800)."""
    fit = fit_gemm()
    memory = tuple(
        CurvePoint(m, 0.0, round(f, 4), DEEPGEMM.cite(
            f"dense rows M={m} (" + ", ".join(f"{r.n}x{r.k}" for r in DEEPGEMM_ROWS
                                             if r.layout == "dense" and r.m == m) + ") fitted with a common floor"))
        for m, f in fit.memory_by_m.items())
    out: dict[str, tuple[CurvePoint, ...]] = {}
    for cls in ("gemm", "group_gemm"):
        def rows_of(m: int, cls: str = cls) -> str:
            return ", ".join(r.label for r in DEEPGEMM_ROWS
                             if gemm_class(r) == cls and r.m == m and intensity(r) >= 1.5 * RIDGE)

        compute = tuple(
            CurvePoint(m, round(f, 4), 0.0, DEEPGEMM.cite(
                f"{cls} rows M={m}, deep-K fraction (x K / (K + {fit.depth_half:.0f}) at depth K) ({rows_of(m)})"))
            for (c, m), f in fit.compute_by_class_m.items() if c == cls)
        mem = memory if cls == "gemm" else tuple(
            CurvePoint(p.rows, 0.0, p.memory, "assumed the dense curve (no memory-bound grouped row is published): "
                       + p.source) for p in memory)
        out[cls] = tuple(sorted(compute + mem, key=lambda p: (p.rows, p.memory)))
    return out


def hopper_floors() -> dict[str, KernelFloor]:
    floor = round(fit_gemm().floor_us, 3)
    source = DEEPGEMM.cite("intercept of the memory-bound dense rows (M=64, 128), fitted with their bandwidth")
    return {"gemm": KernelFloor(floor, source),
            "group_gemm": KernelFloor(floor, "assumed the dense GEMM's (same kernel family): " + source),
            "attention": KernelFloor(floor, "assumed the GEMM's (FlashMLA publishes no small-shape time): "
                                     + source),
            "other": KernelFloor(floor, "assumed the GEMM's (norms, rotary, top-k: no published time): " + source)}


def curve_fraction(points: Sequence[CurvePoint], rows: float, what: str) -> float:
    """The ``what`` ('compute' or 'memory') fraction at ``rows``: linear in log rows between the points
    that measure it, flat outside them; 0 if none does."""
    pts = sorted((p.rows, getattr(p, what)) for p in points if getattr(p, what) > 0)
    if not pts:
        return 0.0
    if rows <= pts[0][0]:
        return pts[0][1]
    for (r0, f0), (r1, f1) in zip(pts, pts[1:]):
        if rows <= r1:
            a = math.log(rows / r0) / math.log(r1 / r0)
            return f0 + a * (f1 - f0)
    return pts[-1][1]


def remote_copy_bytes(row: CollectiveRow) -> float:
    """Bytes one GPU sends over the row's link, counted as ``cost.all_to_all`` counts them."""
    local = min(row.gpus_per_node, row.ep)
    share = (local - 1) / row.ep if row.link == "nvlink" else (row.ep - local) / row.ep
    return row.tokens * TOP_K * row.payload_bytes * share


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``: (a, b)."""
    mx, my = _mean(xs), _mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _rows(source: str, link: str, direction: str) -> list[CollectiveRow]:
    return [r for r in COLLECTIVE_ROWS if (r.source, r.link, r.direction) == (source, link, direction)]


def hopper_links(ib_bandwidth: float) -> dict[str, AllToAllFit]:
    """NVLink: pplx-kernels' one-token latency as floor and intercept, DeepEP's normal-kernel share of
    H800 NVLink as efficiency (assumed to hold at 450 GB/s too). InfiniBand: pplx-kernels' mean IBGDA
    one-token latency (EP16-128) as floor, a line through DeepEP's low-latency rows (EP16-256)."""
    out = {}
    for i, direction in enumerate(("dispatch", "combine")):
        floor = _rows("pplx", "nvlink", direction)
        one = next(r for r in floor if r.tokens == 1)
        share = f"intranode EP8 {direction} {DEEPEP_NORMAL_NVLINK_GBS[i]:g} GB/s of {H800_NVLINK_GBS:g}"
        out[f"nvlink_{direction}"] = AllToAllFit(
            ((one.ep, one.time_us),), one.time_us, round(DEEPEP_NORMAL_NVLINK_GBS[i] / H800_NVLINK_GBS, 4),
            f"floor {COLLECTIVE_CITATIONS['pplx'].cite(one.label)}; efficiency {DEEPEP_NORMAL.cite(share)}")
        ones = [r for r in _rows("pplx", "ib", direction) if r.tokens == 1]
        line = _rows("deepep_ll", "ib", direction)
        a, b = _line([remote_copy_bytes(r) for r in line], [r.time_us * 1e-6 for r in line])
        out[f"ib_{direction}"] = AllToAllFit(
            tuple((r.ep, r.time_us) for r in ones), round(max(a, 0.0) * 1e6, 2), round(1 / b / ib_bandwidth, 4),
            f"floors: {COLLECTIVE_CITATIONS['pplx'].cite('IBGDA 1 token EP16-128')}; line through "
            + COLLECTIVE_CITATIONS["deepep_ll"].cite(f"{direction} EP16-256"))
    return out


def blackwell_nvlink(nvlink_bandwidth: float) -> dict[str, AllToAllFit]:
    """NVLink dispatch and combine from TensorRT-LLM's NVLinkOneSided table (GB200 NVL72, EP8-64)."""
    out = {}
    for direction in ("dispatch", "combine"):
        rows = _rows("trtllm", "nvlink", direction)
        big = [r for r in rows if r.tokens >= BANDWIDTH_REGIME_TOKENS]
        a, b = _line([remote_copy_bytes(r) for r in big], [r.time_us * 1e-6 for r in big])
        floors = tuple((r.ep, r.time_us) for r in rows if r.tokens == 1)
        out[f"nvlink_{direction}"] = AllToAllFit(
            floors, round(a * 1e6, 2), round(1 / b / nvlink_bandwidth, 4),
            COLLECTIVE_CITATIONS["trtllm"].cite(f"{direction}: floors the 1-token latencies, line through "
                                                f"{BANDWIDTH_REGIME_TOKENS}-2048 tokens"))
    return out


def a2a_time_us(fit: AllToAllFit, ep: float, nbytes: float, link_bandwidth: float) -> tuple[float, float]:
    """(latency, wire) of a transfer of ``nbytes`` at ``ep`` GPUs under ``fit``: the wire time holds the
    link, the latency only delays arrival; together ``max(floor(EP), intercept + wire)``."""
    wire = nbytes / (link_bandwidth * fit.efficiency) * 1e6
    return max(fit.floor_us(ep) - wire, fit.intercept_us), wire
