"""Calibration in rank processes, spawned as the engine spawns its ranks (``RankProcesses``) and
joined as they join (``make_store`` + ``init_parallel``): the all-to-all between idle ranks and the
engine's collectives between computing ranks. ``epserve plan calibrate --ranks N`` runs on them
(``calibrate.calibrate_ranks``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import linear_regression
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epserve.env import pinning_enabled
from epserve.parallel import launch
from epserve.parallel.context import init_parallel, make_store, shutdown_parallel
from epserve.planner.errors import PlanError
from epserve.planner.hardware import MeasuredPoint

LOADED_GEMVS = 4  # weight-streaming GEMVs (2 MiB each, ~0.6 ms at one thread here) between two collectives


class CalibrationRank:
    """One rank process (the ``RankProcesses`` entry): ``threads`` torch threads (None: torch's
    default), pinned as the engine pins its rank when ``pin``, in a world of this host's ranks;
    ``done``: an event rank 0 sets when its calibration is over. Runs each command's ``run``."""

    def __init__(self, info: launch.RankInfo, device: str, threads: int | None, pin: bool, done: Any) -> None:
        if threads:
            torch.set_num_threads(threads)
        pin_rank(info.local_rank, info.local_world_size, pin)
        world, self.done = info.local_world_size, done
        dev = torch.device(device, info.local_rank % torch.cuda.device_count() if device == "cuda" else None)
        store = make_store(info.master_addr, info.master_port, world, info.rank)
        self.ctx = init_parallel(world, 1, info.rank, dev, store)

    def handle(self, command: Any) -> object:
        return command.run(self)

    def close(self) -> None:
        shutdown_parallel()


@dataclass(frozen=True)
class MeasureAllToAll:
    """Every rank sends ``size`` bytes to every other, ``iters`` times: a point per size."""

    sizes: tuple[int, ...]
    iters: int

    def run(self, rank: CalibrationRank) -> list[MeasuredPoint]:
        ctx, pts = rank.ctx, []
        for size in self.sizes:  # every rank runs the same number of collectives
            x = torch.zeros(size // 4 * ctx.world_size, dtype=torch.float32, device=ctx.device)
            y = torch.empty_like(x)
            for _ in range(3):
                dist.all_to_all_single(y, x, group=ctx.ep_group)
            if ctx.device.type == "cuda":
                dist.barrier(group=ctx.ep_group)
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(self.iters):
                    dist.all_to_all_single(y, x, group=ctx.ep_group)
                torch.cuda.synchronize()
                us = (time.perf_counter() - start) / self.iters * 1e6
            else:  # same count on every rank: a collective each
                samples = []
                for _ in range(self.iters):
                    start = time.perf_counter()
                    dist.all_to_all_single(y, x, group=ctx.ep_group)
                    samples.append(time.perf_counter() - start)
                us = sorted(samples)[len(samples) // 5] * 1e6
            pts.append(MeasuredPoint("all_to_all", f"{ctx.world_size} ranks x {size} B", 0.0,
                                     size * (ctx.world_size - 1), us))
        return pts


@dataclass(frozen=True)
class MeasureLoaded:
    """``measure_loaded_collectives``: every rank records when each collective entered and left."""

    sizes: tuple[int, ...]
    iters: int

    def run(self, rank: CalibrationRank) -> list[MeasuredPoint]:
        world, group, meta = rank.ctx.world_size, rank.ctx.ep_group, rank.ctx.meta_group
        pool = [torch.full((1024, 1024), 0.01, dtype=torch.bfloat16) for _ in range(24)]  # 48 MiB: beyond the caches
        x = torch.full((1, 1024), 0.01, dtype=torch.bfloat16)
        counts = torch.ones(64 * world, dtype=torch.int64)
        flags = torch.zeros(2, dtype=torch.int64)
        cases = [("handshake", counts.numel() * 8), ("all_reduce", 16), *(("all_to_all_loaded", s) for s in self.sizes)]
        stamps = []
        j = 0
        for kind, size in cases:
            rows = torch.zeros(size // 2 * world, dtype=torch.bfloat16)
            recv, recv_counts = torch.empty_like(rows), torch.empty_like(counts)
            own: list[float] = []
            for it in range(self.iters + 5):
                for _ in range(LOADED_GEMVS):
                    torch.nn.functional.linear(x, pool[j % len(pool)])
                    j += 1
                start = time.perf_counter()
                if kind == "handshake":  # the all_to_all dispatcher's synchronous exchange of counts
                    dist.all_to_all_single(recv_counts, counts, group=group)
                elif kind == "all_reduce":  # the step's metadata all-reduce
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=meta)
                else:  # the rows: an asynchronous exchange, waited for
                    dist.all_to_all_single(recv, rows, group=group, async_op=True).wait()
                if it >= 5:
                    own += (start, time.perf_counter())
            stamps.append(own)
        # perf_counter is CLOCK_MONOTONIC: comparable between processes of one host
        mine = torch.tensor(stamps, dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        pts = []
        for k, (kind, size) in enumerate(cases):
            lat = [max(float(e[k, 2 * i + 1]) for e in every) - max(float(e[k, 2 * i]) for e in every)
                   for i in range(self.iters)]  # the mean: a step pays every collective, tail included
            pts.append(MeasuredPoint(kind, f"{world} ranks x {size} B", 0.0, float(size * (world - 1)),
                                     sum(lat) / len(lat) * 1e6))
        return pts


def resolve_pin(pin: bool | None) -> bool:
    """``pin`` as given, or (None) the engine's default (``pinning_enabled``)."""
    return pinning_enabled() if pin is None else bool(pin)


def pin_rank(rank: int, world: int, pin: bool) -> None:
    """Pin this calibration process as the engine pins rank ``rank`` of ``world`` on this host."""
    if pin:
        launch.pin_to_cores(rank, world)


def run_ranks(world: int, device: str, threads: int | None, pin: bool, *commands: Any) -> list[Any]:
    """Rank 0's results of ``commands``, run one after the other on ``world`` calibration ranks."""
    port = launch.free_port()
    infos = [launch.RankInfo(r, r, world, "127.0.0.1", port) for r in range(world)]
    try:
        ranks = launch.RankProcesses(CalibrationRank, infos, (device, threads, pin, mp.get_context("spawn").Event()))
        try:
            return [ranks.call(command) for command in commands]
        finally:
            ranks.close()
    except launch.RankFailure as e:
        raise PlanError(f"calibration in {world} rank processes failed: {e}") from e


def measure_all_to_all(world: int, sizes: Sequence[int], iters: int, device: str = "cpu") -> list[MeasuredPoint]:
    """Each rank sends ``size`` bytes to every other rank; one point per size."""
    return run_ranks(world, device, None, False, MeasureAllToAll(tuple(sizes), iters))[0]


def measure_loaded_collectives(world: int, sizes: Sequence[int], iters: int, threads: int = 1,
                               pin: bool | None = None) -> list[MeasuredPoint]:
    """The engine's collectives between ``world`` CPU rank processes of ``threads`` torch threads that
    stream weights between them (``LOADED_GEMVS``): the dispatcher's count exchange (``handshake``),
    the step's all-reduce (``all_reduce``) and the rows' asynchronous ``all_to_all_single``
    (``all_to_all_loaded``, each rank sending ``size`` bytes to every other). Each point is the *mean*
    time from the last rank's arrival to the last rank's departure (the collective's own latency, not
    the wait for a slower peer). On a host whose cores all run ranks, a collective waits on threads
    (gloo's, the peer's) that compete with the compute for the cores: its mean is several times the
    idle back-to-back figure, with a long tail, and a step pays the mean. ``pin``: each rank process
    pinned to its own block of cores, as the engine pins its ranks (default: ``EPSERVE_PIN``)."""
    return run_ranks(world, "cpu", threads, resolve_pin(pin), MeasureLoaded(tuple(sizes), iters))[0]


def one_host_link(link: float) -> dict[str, float]:
    """No second host measured: the inter-node link taken as the intra-node one, both at 100%."""
    return {"nvlink_bandwidth": link, "nvlink_efficiency": 1.0, "ib_bandwidth": link, "ib_efficiency": 1.0}


def fit_loaded(points: Sequence[MeasuredPoint]) -> dict[str, float]:
    """Hardware fields from ``measure_loaded_collectives`` points: the count exchange and the step
    all-reduce as they are; a line ``latency + bytes / bandwidth`` through the rows' points (least
    squares; the latency floored at 0, the bandwidth at the largest point's average rate if the slope
    is not positive)."""
    fields = {"handshake": "dispatch_handshake_us", "all_reduce": "step_sync_us"}
    out = {fields[p.kind]: round(p.time_us, 2) for p in points if p.kind in fields}
    rows = sorted((p for p in points if p.kind == "all_to_all_loaded"), key=lambda p: p.bytes)
    if len({p.bytes for p in rows}) >= 2:
        slope, intercept = linear_regression([p.bytes for p in rows], [p.time_us for p in rows])
        latency = round(max(intercept, 0.0), 2)
        bandwidth = 1e6 / slope if slope > 0 else rows[-1].bytes / rows[-1].time_us * 1e6
        out.update(nvlink_latency_us=latency, collective_latency_us=latency, ib_latency_us=latency,
                   link_bandwidth=bandwidth)
    return out
