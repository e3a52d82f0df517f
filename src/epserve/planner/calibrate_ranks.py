"""``epserve plan calibrate --ranks N``: calibrate one rank of a CPU engine that runs ``N`` rank
processes on this host, under the conditions its ranks run in (shared cores and memory bandwidth,
collectives between busy processes)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from epserve.planner.calibrate import SIZES, calibrate
from epserve.planner.calibrate_comm import fit_loaded, measure_loaded_collectives, pin_rank, resolve_pin
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec


def _rank_calibration(rank: int, ranks: int, quick: bool, base: dict | None, engine: bool, threads: int,
                      pin: bool, out: str) -> None:
    """One rank process of ``calibrate_ranks``: rank 0 calibrates and writes the result; the others
    stream memory (a sum over 256 MiB, over and over) on their threads until they are stopped, as an
    engine rank's peers stream their weights. ``pin``: on rank ``rank``'s cores, as the engine pins."""
    torch.set_num_threads(threads)
    pin_rank(rank, ranks, pin)
    if rank > 0:
        data = torch.ones(SIZES["stream_bytes"][0] // 4)
        while True:
            data.sum()
    spec = HardwareSpec.from_dict(base) if base else None
    result = calibrate(quick=quick, device="cpu", world_size=1, base=spec, engine=engine)
    Path(out).write_text(json.dumps(result.to_dict()))


def calibrate_ranks(ranks: int, quick: bool = False, base: HardwareSpec | None = None,
                    engine: bool = True, pin: bool | None = None) -> HardwareSpec:
    """A calibration of one rank of a CPU engine that runs ``ranks`` rank processes on this host:
    rank 0 calibrates with ``cores / ranks`` torch threads while ``ranks - 1`` processes of as many
    threads stream memory without pause (an engine rank's peers stream their weights during most of a
    step; a competitor repeating the calibration itself spent much of its time building models and
    understated the contention: predictions 20-30% low at dp 2), then the collectives
    are timed between ``ranks`` processes that compute between them (``measure_loaded_collectives``):
    the rows' latency and bandwidth, the dispatcher's count exchange and the step's all-reduce.
    ``pin``: every process pinned to its rank's block of cores (``pin_to_cores``), as the engine pins
    its CPU ranks; default: as the engine does (yes, unless ``EPSERVE_PIN=0``)."""
    import torch.multiprocessing as mp

    pin = resolve_pin(pin)
    threads = max(1, (os.cpu_count() or 1) // ranks)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        procs = [ctx.Process(target=_rank_calibration, daemon=True,
                             args=(r, ranks, quick, base.to_dict() if base else None, engine, threads, pin, out))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        procs[0].join()
        for p in procs[1:]:  # the competitors: stopped once rank 0 is done
            p.terminate()
            p.join()
        if procs[0].exitcode != 0:
            raise PlanError(f"the calibration of rank 0 failed (exit code {procs[0].exitcode})")
        spec = HardwareSpec.from_dict(json.loads(Path(out).read_text()))
    loaded = measure_loaded_collectives(ranks, SIZES["a2a_loaded"][0 if quick else 1], 60 if quick else 200, threads,
                                        pin=pin)
    fit = fit_loaded(loaded)
    changes: dict = {k: v for k, v in fit.items() if k != "link_bandwidth"}
    if "link_bandwidth" in fit and spec.name.startswith("local-"):  # one host: inter-node taken as intra-node
        link = fit["link_bandwidth"]
        changes.update(nvlink_bandwidth=link, nvlink_efficiency=1.0, ib_bandwidth=link, ib_efficiency=1.0)
    changes["points"] = (*(p for p in spec.points if p.kind != "all_to_all"), *loaded)
    changes["source"] = (f"{spec.source}; one of {ranks} {'pinned' if pin else 'unpinned'} rank processes "
                         f"calibrating at once, collectives timed between {ranks} computing ranks "
                         f"(`epserve plan calibrate --ranks {ranks}{'' if pin else ' --no-pin'}`)")
    return replace(spec, **changes)
