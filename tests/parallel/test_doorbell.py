"""The doorbell idle ranks sleep on: a ring wakes every rank, a ring before the wait is not lost, and
old keys are collected."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from epserve.parallel.context import store_client
from epserve.parallel.doorbell import Doorbell, LocalDoorbell
from tests.dist_harness import free_port, run_ranks

pytestmark = pytest.mark.slow


def _doorbell_ranks(rank: int, world: int, port: int) -> dict:
    master = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                           timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    bell = Doorbell("127.0.0.1", port)
    out = {}
    # 1. everyone sleeps; rank 0's "gRPC thread" rings after 0.3 s
    dist.barrier()
    if rank == 0:
        threading.Timer(0.3, bell.ring).start()
    start = time.monotonic()
    bell.wait()
    out["slept"] = time.monotonic() - start
    dist.barrier()
    bell.collect()
    # 2. the ring comes before anybody waits: the wait returns at once
    if rank == 0:
        bell.ring()
    dist.barrier()
    start = time.monotonic()
    bell.wait()
    out["rang_before"] = time.monotonic() - start
    dist.barrier()
    bell.collect()
    out["epoch"] = bell.epoch
    client = store_client("127.0.0.1", port)
    out["old_keys_left"] = [e for e in range(bell.epoch) if client.check([f"doorbell/wake/{e}"])]
    dist.barrier()
    del master
    return out


def test_ring_wakes_every_rank_and_is_never_lost():
    results = run_ranks(_doorbell_ranks, 2, free_port())
    for r in results:
        assert 0.25 <= r["slept"] < 5.0
        assert r["rang_before"] < 0.2
        assert r["epoch"] == 2 and r["old_keys_left"] == []


def test_local_doorbell():
    bell = LocalDoorbell()
    bell.ring()
    start = time.monotonic()
    bell.wait()  # rung before: no wait
    assert time.monotonic() - start < 0.1
    threading.Timer(0.2, bell.ring).start()
    start = time.monotonic()
    bell.wait()
    assert time.monotonic() - start >= 0.15
