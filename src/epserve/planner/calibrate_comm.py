"""Calibration of expert-parallel communication: ``all_to_all_single`` between spawned processes
(gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from epserve.planner.hardware import MeasuredPoint


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
    import torch.multiprocessing as mp

    sizes = list(sizes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "a2a.json")
        mp.spawn(_a2a_worker, args=(world, port, sizes, iters, out), nprocs=world)
        times = json.loads(Path(out).read_text())
    return [MeasuredPoint("all_to_all", f"{world} ranks x {size} B", 0.0, size * (world - 1), t)
            for size, t in ((int(k), v) for k, v in times.items())]
