"""Run a function on ``world_size`` spawned gloo ranks and collect the results.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every rank (``fn`` must be
a module-level function) and returns the per-rank results in rank order. A rank that raises fails the
call with its rank number and traceback; a run that outlives ``timeout`` seconds (e.g. a rank hanging
in a collective) fails with ``TimeoutError``. Every child is killed before ``run_ranks`` returns.
"""

from __future__ import annotations

import datetime
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epserve.parallel.launch import free_port

__all__ = ["free_port", "run_ranks"]


def _rank_main(rank: int, world_size: int, port: int, results: Any, fn: Callable[..., Any], args: tuple) -> None:
    try:
        torch.set_num_threads(1)  # several ranks share few cores: avoid OpenMP oversubscription
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                              timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            # Plain pickle copies tensors by value (the queue's pickler would share their memory, which
            # dies with this process).
            results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list:
    """-> [fn(0, world_size, *args), …, fn(world_size - 1, world_size, *args)]"""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, results, fn, args))
             for rank in range(world_size)]
    deadline = time.monotonic() + timeout
    outputs: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        while len(outputs) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - outputs.keys())
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            outputs[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        results.close()
    return [outputs[rank] for rank in range(world_size)]
