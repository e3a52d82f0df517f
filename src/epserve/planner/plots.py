"""PNG figures: the Pareto frontiers, the GEMM / GroupGEMM rooflines, and prefill throughput."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from epserve.config import ModelConfig
from epserve.planner.cost import kernel_time
from epserve.planner.deployment import WEIGHT_BYTES, Deployment
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec
from epserve.planner.ops import BatchShape, op_kernels
from epserve.planner.prefill import plan_prefill
from epserve.planner.sweep import SWEEP_BATCHES, SweepRow

PROMPT_LENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
GEMM_OPS = ("qkv_a_proj", "q_b_proj", "o_proj", "shared_expert")


def _pyplot() -> Any:
    """matplotlib, imported only when a figure is asked for (it is slow to import)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_pareto(rows: Sequence[SweepRow], path: str | Path, title: str, slo_speed: float | None = None) -> Path:
    """Throughput per node (log) against tokens/s per request; one frontier per EP."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    eps = sorted({r.plan.deployment.ep for r in rows})
    colors = plt.get_cmap("viridis")([i / max(len(eps) - 1, 1) for i in range(len(eps))])
    for ep, color in zip(eps, colors):
        fits = [r for r in rows if r.plan.deployment.ep == ep and r.plan.fits]
        ax.scatter([r.plan.output_tokens_per_s_per_request for r in fits],
                   [r.plan.throughput_tokens_per_s_per_node for r in fits], s=6, color=color, alpha=0.25)
        front = sorted((r.plan for r in fits if r.pareto), key=lambda p: p.output_tokens_per_s_per_request)
        label = f"EP{ep}" if fits else f"EP{ep}: does not fit"
        ax.plot([p.output_tokens_per_s_per_request for p in front],
                [p.throughput_tokens_per_s_per_node for p in front], "o-", ms=3, color=color, label=label)
    if slo_speed is not None:
        ax.axvline(slo_speed, color="grey", ls="--", lw=1, label=f"SLO {slo_speed:g} tok/s")
    ax.set_yscale("log")
    ax.set_xlabel("output tokens/s per request")
    ax.set_ylabel("output tokens/s per node")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _roof(ax: Any, hw: HardwareSpec, kernel_class: str, dtype: str, xs: Sequence[float], weight_bytes: float) -> None:
    eff = hw.eff(kernel_class)
    peak, bw = hw.flops_for(dtype), hw.memory_bandwidth
    ax.plot(xs, [min(peak, x * bw) / 1e12 for x in xs], "k--", lw=1, label=f"datasheet ({dtype})")
    if kernel_class in hw.memory_by_rows:  # a weight-streaming GEMM of m rows does ~2m / weight_bytes FLOP/byte
        frac = [hw.memory_fraction(kernel_class, x * weight_bytes / 2) for x in xs]
        ax.plot(xs, [min(peak * eff.compute, x * bw * f) / 1e12 for x, f in zip(xs, frac)], "k-", lw=1.5,
                label=f"achievable (calibrated by rows, compute {eff.compute:.0%})")
        return
    ax.plot(xs, [min(peak * eff.compute, x * bw * eff.memory) / 1e12 for x in xs], "k-", lw=1.5,
            label=f"achievable ({eff.compute:.0%} / {eff.memory:.0%})")


def plot_roofline(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, path: str | Path, eps: Iterable[int] = (8, 32, 128)
) -> Path:
    """Attained FLOP/s against arithmetic intensity for the planner's GEMMs (per op, batch 1…256)
    and grouped GEMMs (per EP), on the achievable and datasheet roofs, with measured points."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    dtype = hw.compute_dtype(d.weight_dtype)
    xs = [2 ** (i / 4) for i in range(-8, 60)]
    series: list[tuple[Any, str, list[tuple[str, Deployment]]]] = [
        (axes[0], "gemm", [(name, d) for name in GEMM_OPS]),
        (axes[1], "group_gemm", [(f"experts EP{ep}", replace(d, ep=ep, tp=1)) for ep in eps]),
    ]
    for ax, kernel_class, curves in series:
        _roof(ax, hw, kernel_class, dtype, xs, WEIGHT_BYTES[d.weight_dtype])
        for label, dep in curves:
            op = "experts" if kernel_class == "group_gemm" else label
            pts = []
            for batch in SWEEP_BATCHES:
                shape = BatchShape(batch, dep.query_len, dep.kv_len)
                for k in op_kernels(model, hw, dep, shape, op):
                    if k.kernel_class == kernel_class and k.work.bytes > 0 and k.work.flops > 0:
                        t = kernel_time(hw, k).time_us
                        pts.append((k.work.flops / k.work.bytes, k.work.flops / t / 1e6))
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, label=label)
        measured = [p for p in hw.points if p.kind == kernel_class and p.bytes > 0]
        if measured:
            ax.scatter([p.flops / p.bytes for p in measured], [p.flops / p.time_us / 1e6 for p in measured],
                       marker="x", color="red", s=25, label="measured")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{'GEMM' if kernel_class == 'gemm' else 'GroupGEMM'} on {hw.name}, "
                     f"batch 1-256/GPU, {d.weight_dtype} weights", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_prefill(
    model: ModelConfig, hw: HardwareSpec, base: Deployment, path: str | Path, eps: Iterable[int], title: str
) -> Path:
    """Prefill tokens/s per GPU against prompt length, one line per EP (TP 1)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for ep in eps:
        pts = []
        for prompt_len in PROMPT_LENS:
            try:
                plan = plan_prefill(model, hw, replace(base, ep=ep, tp=1), prompt_len)
            except PlanError:
                continue
            pts.append((prompt_len, plan.tokens_per_s_per_gpu))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=f"EP{ep}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("prefill tokens/s per GPU")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    _pyplot().close(fig)
    return path


def plot_workload_pareto(rows: Sequence[Any], path: str | Path, title: str) -> Path:
    """End to end, as public benchmarks plot it: output tokens/s per GPU against tokens/s per user; every
    fitting plan by EP, the front of all of them as a line (``workload_sweep.WorkloadRow``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    fits = [r.plan for r in rows if r.plan.fits]
    eps = sorted({p.decode.deployment.ep for p in fits})
    colors = plt.get_cmap("viridis")([i / max(len(eps) - 1, 1) for i in range(len(eps))])
    for ep, color in zip(eps, colors):
        pts = [p for p in fits if p.decode.deployment.ep == ep]
        ax.scatter([p.interactivity for p in pts], [p.output_tokens_per_s_per_gpu for p in pts], s=8, color=color,
                   alpha=0.5, label=f"EP{ep}")
    front = sorted((r.plan for r in rows if r.pareto), key=lambda p: p.interactivity)
    ax.plot([p.interactivity for p in front], [p.output_tokens_per_s_per_gpu for p in front], "k-", lw=1.5,
            label="Pareto front")
    ax.set_yscale("log")
    ax.set_xlabel("interactivity: output tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU (end to end)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
