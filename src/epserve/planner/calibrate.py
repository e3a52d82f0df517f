"""``epserve plan calibrate``: measure kernels on this device and write a hardware file.

Times torch GEMMs, grouped GEMMs (``torch._grouped_mm`` on CUDA when present, else a loop over
experts), absorbed-MLA attention (batched matmuls over a latent cache), an RMSNorm-like
elementwise kernel and an all-to-all between ``world_size`` processes (gloo on CPU, NCCL on CUDA).
Per kernel class it keeps the best attained FLOP/s and bytes/s (after the measured per-kernel
floor) and writes them as achievable fractions of a datasheet entry (a recognised GPU) or, on an
unknown device, of the best measured rates themselves. Only this module imports torch.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from epserve.planner.errors import PlanError
from epserve.planner.hardware import BUILTIN, Efficiency, HardwareSpec, MeasuredPoint

SIZES = {  # (quick, full) shapes
    "gemm_m": ((1, 16, 128), (1, 4, 16, 64, 256, 1024)),
    "gemm_kn": (((1024, 1024),), ((4096, 4096), (8192, 2048), (2048, 8192))),  # full: 32 MB, past the caches
    "group": (((4, 1), (4, 16), (4, 64)), ((8, 1), (8, 4), (8, 16), (8, 64), (4, 256))),
    "attn": (((1, 256), (4, 512)), ((1, 512), (4, 1024), (16, 1024), (16, 4096))),
    "a2a": ((1 << 10, 1 << 16, 1 << 20), (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)),
}
BUDGET_S = (0.03, 0.25)  # time spent measuring one shape


def _timer(device: str) -> Callable[[Callable[[], object], float], float]:
    """A function timing ``fn`` for about ``budget_s``. On CUDA: the best mean of a few chunks of
    launches. On CPU: a low percentile of single calls, which a preempted call cannot move."""

    def time_us(fn: Callable[[], object], budget_s: float) -> float:
        fn()
        deadline = time.perf_counter() + budget_s
        if device == "cuda":
            torch.cuda.synchronize()
            best = float("inf")
            while True:
                n, start = 0, time.perf_counter()
                while n < 4 or (time.perf_counter() - start < budget_s / 4 and n < 1000):
                    fn()
                    n += 1
                torch.cuda.synchronize()
                best = min(best, (time.perf_counter() - start) / n * 1e6)
                if time.perf_counter() > deadline:
                    return best
        return _low_percentile_us(fn, lambda n: n >= 5 and (time.perf_counter() > deadline or n >= 2000))

    return time_us


def _low_percentile_us(fn: Callable[[], object], done: Callable[[int], bool]) -> float:
    samples: list[float] = []
    while not done(len(samples)):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    samples.sort()
    return samples[len(samples) // 5] * 1e6


def _measure_kernels(device: str, dtype: torch.dtype, quick: bool) -> list[MeasuredPoint]:
    q = 0 if quick else 1
    time_us, budget = _timer(device), BUDGET_S[q]
    esize = torch.finfo(dtype).bits // 8
    pts: list[MeasuredPoint] = []

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    tiny_a, tiny_b = rand(1, 16), rand(16, 16)
    pts.append(MeasuredPoint("floor", "1x16x16", 0.0, 0.0, time_us(lambda: tiny_a @ tiny_b, budget)))
    for k, n in SIZES["gemm_kn"][q]:
        w = rand(k, n)
        for m in SIZES["gemm_m"][q]:
            x = rand(m, k)
            t = time_us(lambda x=x, w=w: x @ w, budget)
            pts.append(MeasuredPoint("gemm", f"{m}x{k}x{n}", 2 * m * k * n, (m * k + k * n + m * n) * esize, t))
    k, n = SIZES["gemm_kn"][q][0]
    grouped = getattr(torch, "_grouped_mm", None) if device == "cuda" else None
    for g, m in SIZES["group"][q]:
        ws, xs = rand(g, k, n), rand(g * m, k)
        def loop(xs: torch.Tensor = xs, ws: torch.Tensor = ws, g: int = g, m: int = m) -> object:
            return [xs[i * m:(i + 1) * m] @ ws[i] for i in range(g)]

        fn: Callable[[], object] = loop
        if grouped is not None:
            offs = torch.arange(m, g * m + 1, m, device=device, dtype=torch.int32)
            try:
                grouped(xs, ws, offs=offs)
                fn = lambda xs=xs, ws=ws, offs=offs: grouped(xs, ws, offs=offs)  # noqa: E731
            except (RuntimeError, TypeError, ValueError):  # shape or dtype the fused kernel refuses
                pass
        t = time_us(fn, budget)
        pts.append(MeasuredPoint("group_gemm", f"{g}x{m}x{k}x{n}", 2 * g * m * k * n,
                                 g * (m * k + k * n + m * n) * esize, t))
    heads, latent, rope = 16, 512, 64
    for b, length in SIZES["attn"][q]:
        qry, cache = rand(b, heads, latent + rope), rand(b, length, latent + rope)

        def mla(qry: torch.Tensor = qry, cache: torch.Tensor = cache) -> torch.Tensor:
            scores = torch.softmax(qry @ cache.transpose(1, 2), dim=-1)  # [B, h, L]
            return scores @ cache[..., :latent]  # [B, h, latent]

        flops = 2 * b * heads * length * (2 * latent + rope)
        moved = (b * length * (latent + rope) + b * heads * (2 * latent + rope)) * esize
        pts.append(MeasuredPoint("attention", f"{b}x{heads}x{length}", flops, moved, time_us(mla, budget)))
    for tokens in (16, 256) if quick else (16, 256, 2048):
        x = rand(tokens, 4096)
        t = time_us(lambda x=x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(dtype), budget)
        pts.append(MeasuredPoint("other", f"rmsnorm {tokens}x4096", 0.0, 2 * tokens * 4096 * esize, t))
    return pts


def _a2a_worker(rank: int, world: int, port: int, sizes: list[int], iters: int, out: str) -> None:
    import torch.distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = {}
    for size in sizes:  # every rank runs the same number of collectives
        x = torch.zeros(size // 4 * world, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        if device == "cuda":
            dist.barrier()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_to_all_single(y, x)
            torch.cuda.synchronize()
            best = (time.perf_counter() - start) / iters * 1e6
        else:  # same count on every rank: a collective each
            best = _low_percentile_us(lambda x=x, y=y: dist.all_to_all_single(y, x), lambda n: n >= iters)
        result[size] = best
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _measure_all_to_all(world: int, quick: bool) -> list[MeasuredPoint]:
    """Each rank sends ``size`` bytes to every other rank; one point per size."""
    import torch.multiprocessing as mp

    sizes = list(SIZES["a2a"][0 if quick else 1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "a2a.json")
        mp.spawn(_a2a_worker, args=(world, port, sizes, 5 if quick else 20, out), nprocs=world)
        times = json.loads(Path(out).read_text())
    return [MeasuredPoint("all_to_all", f"{world} ranks x {size} B", 0.0, size * (world - 1), t)
            for size, t in ((int(k), v) for k, v in times.items())]


def _fit(points: list[MeasuredPoint], floor_us: float, kind: str) -> tuple[float, float]:
    """Best attained FLOP/s and bytes/s of one kernel class, its per-kernel floor taken off."""
    own = [p for p in points if p.kind == kind and p.time_us > 2 * floor_us]  # floor-dominated points say nothing
    flops = max((p.flops / max(p.time_us - floor_us, 1e-3) * 1e6 for p in own), default=0.0)
    moved = max((p.bytes / max(p.time_us - floor_us, 1e-3) * 1e6 for p in own), default=0.0)
    return flops, moved


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def match_builtin(device_name: str) -> HardwareSpec | None:
    low = device_name.lower()
    for key in ("gb200", "b200", "h800", "h200", "h100"):
        if key in low:
            return BUILTIN[key]
    return None


def calibrate(quick: bool = False, device: str | None = None, world_size: int = 2,
              base: HardwareSpec | None = None) -> HardwareSpec:
    """Measure this device and return a ``HardwareSpec`` whose fractions are the measured ones."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda but CUDA is not available")
    if device == "cuda":  # NCCL needs one GPU per rank; with fewer, the link figures stay the datasheet's
        world_size = min(world_size, torch.cuda.device_count())
    dtype = torch.bfloat16
    points = _measure_kernels(device, dtype, quick)
    if world_size > 1:
        points += _measure_all_to_all(world_size, quick)
    floor = next(p.time_us for p in points if p.kind == "floor")
    rates = {c: _fit(points, floor, c) for c in ("gemm", "group_gemm", "attention", "other")}
    name = _device_name(device)
    base = base or match_builtin(name)
    if base is None:
        memory = (torch.cuda.get_device_properties(0).total_memory if device == "cuda"
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        peak = max(r[0] for r in rates.values())
        bw = max(r[1] for r in rates.values())
        base = HardwareSpec(name=f"local-{name}", peak_flops={"bf16": peak}, memory_bytes=int(memory),
                            memory_bandwidth=bw, nvlink_bandwidth=bw, ib_bandwidth=bw,
                            gpus_per_node=max(8, os.cpu_count() or 1), nvlink_efficiency=1.0, ib_efficiency=1.0)
    peak, bw = base.flops_for("bf16"), base.memory_bandwidth
    efficiency = {c: Efficiency(compute=round(min(1.0, f / peak), 4) if f else base.eff(c).compute,
                                memory=round(min(1.0, b / bw), 4) if b else base.eff(c).memory)
                  for c, (f, b) in rates.items()}
    changes: dict = {"efficiency": efficiency, "kernel_latency_us": round(floor, 3), "points": tuple(points)}
    a2a = sorted((p for p in points if p.kind == "all_to_all"), key=lambda p: p.bytes)
    if a2a:
        latency = a2a[0].time_us
        link = max((p.bytes / max(p.time_us - latency, 1e-3) * 1e6 for p in a2a[1:]), default=0.0)
        changes.update(nvlink_latency_us=round(latency, 2), collective_latency_us=round(latency, 2))
        if base.name.startswith("local-"):  # no second host measured: inter-node taken as intra-node
            link = link or base.nvlink_bandwidth
            changes.update(nvlink_bandwidth=link, nvlink_efficiency=1.0, ib_bandwidth=link, ib_efficiency=1.0,
                           ib_latency_us=round(latency, 2))
        elif link:
            changes["nvlink_efficiency"] = round(min(1.0, link / base.nvlink_bandwidth), 4)
    stamp = time.strftime("%Y-%m-%d %H:%M")
    changes["source"] = (f"calibrated on {name} ({device}, {dtype}) at {stamp} by `epserve plan calibrate"
                         f"{' --quick' if quick else ''}`; peaks from {base.source if not base.name.startswith('local-') else 'the best measured rates'}")
    return replace(base, **changes)
