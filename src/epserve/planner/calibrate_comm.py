"""Calibration of expert-parallel communication: ``all_to_all_single`` between spawned processes
(gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from epserve.parallel.launch import free_port, pin_to_cores, pinning_enabled
from epserve.planner.hardware import MeasuredPoint


def _spawn(worker: Callable[..., None], world: int, *args: object) -> dict:
    """Run ``worker(rank, world, port, out, *args)`` on ``world`` spawned processes; rank 0 writes its
    JSON result to ``out``, which is returned."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world, free_port(), out, *args), nprocs=world)
        return json.loads(Path(out).read_text())


def _a2a_worker(rank: int, world: int, port: int, out: str, sizes: list[int], iters: int) -> None:
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
            samples = []
            for _ in range(iters):
                start = time.perf_counter()
                dist.all_to_all_single(y, x)
                samples.append(time.perf_counter() - start)
            best = sorted(samples)[len(samples) // 5] * 1e6
        result[size] = best
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure_all_to_all(world: int, sizes: Sequence[int], iters: int) -> list[MeasuredPoint]:
    """Each rank sends ``size`` bytes to every other rank; one point per size."""
    times = _spawn(_a2a_worker, world, list(sizes), iters)
    return [MeasuredPoint("all_to_all", f"{world} ranks x {size} B", 0.0, size * (world - 1), t)
            for size, t in ((int(k), v) for k, v in times.items())]


LOADED_GEMVS = 4  # weight-streaming GEMVs (2 MiB each, ~0.6 ms at one thread here) between two collectives


def resolve_pin(pin: bool | None) -> bool:
    """``pin`` as given, or (None) the engine's default (``pinning_enabled``)."""
    return pinning_enabled() if pin is None else bool(pin)


def pin_rank(rank: int, world: int, pin: bool) -> None:
    """Pin this calibration process as the engine pins rank ``rank`` of ``world`` on this host."""
    if pin:
        pin_to_cores(rank, world)


def _loaded_worker(rank: int, world: int, port: int, out: str, sizes: list[int], iters: int, threads: int,
                   pin: bool = False) -> None:
    """Every rank streams weights between collectives, as the engine's ranks compute between theirs;
    records, per collective, when it entered and left, so that the time after the *last* rank arrived
    (the collective's own latency, not the wait for a slower peer) can be taken."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    pin_rank(rank, world, pin)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    pool = [torch.full((1024, 1024), 0.01, dtype=torch.bfloat16) for _ in range(24)]  # 48 MiB: beyond the caches
    x = torch.full((1, 1024), 0.01, dtype=torch.bfloat16)
    counts = torch.ones(64 * world, dtype=torch.int64)
    flags = torch.zeros(2, dtype=torch.int64)
    cases: list[tuple[str, int]] = [("handshake", counts.numel() * 8), ("all_reduce", 16)]
    cases += [("all_to_all_loaded", size) for size in sizes]
    stamps: dict[str, list[tuple[float, float]]] = {}
    j = 0
    for kind, size in cases:
        rows = torch.zeros(size // 2 * world, dtype=torch.bfloat16)
        recv = torch.empty_like(rows)
        recv_counts = torch.empty_like(counts)
        own = []
        for it in range(iters + 5):
            for _ in range(LOADED_GEMVS):
                torch.nn.functional.linear(x, pool[j % len(pool)])
                j += 1
            start = time.perf_counter()
            if kind == "handshake":  # the all_to_all dispatcher's synchronous exchange of counts
                dist.all_to_all_single(recv_counts, counts)
            elif kind == "all_reduce":  # the step's metadata all-reduce
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            else:  # the rows: an asynchronous exchange, waited for
                dist.all_to_all_single(recv, rows, async_op=True).wait()
            if it >= 5:
                own.append((start, time.perf_counter()))
        stamps[f"{kind} {size}"] = own
    # perf_counter is CLOCK_MONOTONIC: comparable between processes of one host
    mine = torch.tensor([[s for pair in v for s in pair] for v in stamps.values()], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    if rank == 0:
        result = {}
        for c, key in enumerate(stamps):
            lat = []
            for i in range(iters):
                last_in = max(float(e[c, 2 * i]) for e in every)
                lat.append(max(float(e[c, 2 * i + 1]) for e in every) - last_in)
            result[key] = sum(lat) / len(lat) * 1e6  # the mean: a step pays every collective, tail included
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def measure_loaded_collectives(world: int, sizes: Sequence[int], iters: int, threads: int = 1,
                               pin: bool | None = None) -> list[MeasuredPoint]:
    """The engine's collectives between ``world`` CPU rank processes of ``threads`` torch threads that
    compute between them: the dispatcher's count exchange (``handshake``), the step's all-reduce
    (``all_reduce``) and the rows' asynchronous ``all_to_all_single`` (``all_to_all_loaded``, each rank
    sending ``size`` bytes to every other). Each point is the *mean* time from the last rank's arrival
    to the last rank's departure. On a host whose cores all run ranks, a collective waits on threads
    (gloo's, the peer's) that compete with the compute for the cores: its mean is several times the
    idle back-to-back figure, with a long tail, and a step pays the mean. ``pin``: each rank process
    pinned to its own block of cores, as the engine pins its ranks (default: as the engine does,
    ``EPSERVE_PIN``)."""
    times = _spawn(_loaded_worker, world, list(sizes), iters, threads, resolve_pin(pin))
    pts = []
    for key, t in times.items():
        kind, size = key.split()
        moved = int(size) * (world - 1)
        pts.append(MeasuredPoint(kind, f"{world} ranks x {size} B", 0.0, float(moved), t))
    return pts


def fit_loaded(points: Sequence[MeasuredPoint]) -> dict[str, float]:
    """Hardware fields from ``measure_loaded_collectives`` points: the count exchange and the step
    all-reduce as they are; a line ``latency + bytes / bandwidth`` through the rows' points (least
    squares; the latency floored at 0, the bandwidth at the largest point's average rate if the slope
    is not positive)."""
    by = {p.kind: p for p in points if p.kind in ("handshake", "all_reduce")}
    rows = sorted((p for p in points if p.kind == "all_to_all_loaded"), key=lambda p: p.bytes)
    out: dict[str, float] = {}
    if "handshake" in by:
        out["dispatch_handshake_us"] = round(by["handshake"].time_us, 2)
    if "all_reduce" in by:
        out["step_sync_us"] = round(by["all_reduce"].time_us, 2)
    if len(rows) >= 2:
        n = len(rows)
        mx = sum(p.bytes for p in rows) / n
        my = sum(p.time_us for p in rows) / n
        sxx = sum((p.bytes - mx) ** 2 for p in rows)
        slope = sum((p.bytes - mx) * (p.time_us - my) for p in rows) / sxx if sxx else 0.0
        latency = max(my - slope * mx, 0.0)
        bandwidth = 1e6 / slope if slope > 0 else rows[-1].bytes / rows[-1].time_us * 1e6
        out.update(nvlink_latency_us=round(latency, 2), collective_latency_us=round(latency, 2),
                   ib_latency_us=round(latency, 2), link_bandwidth=bandwidth)
    return out
