"""The multi-rank terms of the planner, checked by hand: the all_to_all dispatcher's blocking count
exchange before each dispatch, the step's metadata all-reduce over the DP groups, and their fit from
collectives timed between computing rank processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
from planner_toys import TOY, V3

from epserve.parallel.stages import moe_layer_schedule
from epserve.planner import Deployment
from epserve.planner.calibrate_ranks import fit_loaded, measure_loaded_collectives
from epserve.planner.gpus import BUILTIN
from epserve.planner.hardware import HardwareSpec, MeasuredPoint
from epserve.planner.ops import BatchShape, price_ops
from epserve.planner.step import estimate_step


def test_gpu_entries_have_no_host_collectives() -> None:
    for spec in BUILTIN.values():
        assert spec.dispatch_handshake_us == 0.0 and spec.step_sync_us == 0.0


def test_handshake_blocks_the_stream_in_dispatch_send_only_with_ep() -> None:
    ops = moe_layer_schedule("dispatch").ops
    shape = BatchShape(4, 1, 1000)
    for ep, extra in ((4, 250.0), (1, 0.0)):
        d = Deployment(ep=ep, tp=1, batch=4, gpus_per_node=4)
        base = price_ops(V3, TOY, d, shape, ops)
        more = price_ops(V3, replace(TOY, dispatch_handshake_us=250.0), d, shape, ops)
        assert more["dispatch_send"].compute_us - base["dispatch_send"].compute_us == pytest.approx(extra)
        for name in base:  # nothing else changes
            if name != "dispatch_send":
                assert more[name] == base[name]


@pytest.mark.parametrize("mode", ["none", "dispatch"])
def test_handshake_adds_once_per_moe_layer(mode: str) -> None:
    # the count exchange precedes the rows' transfer: it delays the send, hence the landing, by itself
    d = Deployment(ep=4, tp=1, batch=8, kv_len=1000, overlap=mode, gpus_per_node=4)
    base = estimate_step(V3, TOY, d, mode)
    more = estimate_step(V3, replace(TOY, dispatch_handshake_us=250.0), d, mode)
    assert more.step_time_us - base.step_time_us == pytest.approx(250.0 * 58)  # 58 MoE layers
    assert more.breakdown_us["dispatch"] - base.breakdown_us["dispatch"] == pytest.approx(250.0 * 58)


def test_step_sync_only_with_several_dp_groups() -> None:
    hw = replace(TOY, step_sync_us=700.0)
    for ep, tp, extra in ((4, 1, 700.0), (4, 2, 700.0), (4, 4, 0.0), (1, 1, 0.0)):
        d = Deployment(ep=ep, tp=tp, batch=2, kv_len=500, overlap="dispatch", gpus_per_node=4)
        base = estimate_step(V3, TOY, d, "dispatch")
        more = estimate_step(V3, hw, d, "dispatch")
        assert more.step_time_us - base.step_time_us == pytest.approx(extra)
        assert more.breakdown_us["other"] - base.breakdown_us["other"] == pytest.approx(extra)
        assert sum(more.breakdown_us.values()) == pytest.approx(more.step_time_us)


def test_fit_loaded_by_hand() -> None:
    pts = [MeasuredPoint("handshake", "2 ranks x 1024 B", 0.0, 1024.0, 600.0),
           MeasuredPoint("all_reduce", "2 ranks x 16 B", 0.0, 16.0, 500.0),
           MeasuredPoint("all_to_all_loaded", "2 ranks x 1000 B", 0.0, 1000.0, 700.0),
           MeasuredPoint("all_to_all_loaded", "2 ranks x 1001000 B", 0.0, 1_001_000.0, 1200.0)]
    fit = fit_loaded(pts)
    # slope 500 us per 1e6 B -> 2 GB/s; intercept 700 - 1000 B x 0.5 us/kB = 699.5 us
    assert fit["link_bandwidth"] == pytest.approx(2e9)
    assert fit["nvlink_latency_us"] == fit["collective_latency_us"] == fit["ib_latency_us"] == pytest.approx(699.5)
    assert fit["dispatch_handshake_us"] == 600.0 and fit["step_sync_us"] == 500.0
    assert fit_loaded(pts[:2]) == {"dispatch_handshake_us": 600.0, "step_sync_us": 500.0}


def test_hardware_file_round_trip_keeps_the_new_fields() -> None:
    spec = replace(TOY, dispatch_handshake_us=650.0, step_sync_us=700.0)
    assert HardwareSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.slow
def test_loaded_collectives_are_measured_between_two_ranks() -> None:
    pts = measure_loaded_collectives(2, [1 << 10, 1 << 16], iters=4)
    kinds = sorted(p.kind for p in pts)
    assert kinds == ["all_reduce", "all_to_all_loaded", "all_to_all_loaded", "handshake"]
    assert all(p.time_us > 0 for p in pts)
    fit = fit_loaded(pts)
    assert fit["dispatch_handshake_us"] > 0 and fit["step_sync_us"] > 0 and fit["nvlink_latency_us"] >= 0


def test_rank_calibration_pins_as_the_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from epserve.planner.calibrate_ranks import pin_rank, resolve_pin

    monkeypatch.delenv("EPSERVE_PIN", raising=False)
    assert resolve_pin(None) is True  # the engine's default
    monkeypatch.setenv("EPSERVE_PIN", "0")
    assert resolve_pin(None) is False and resolve_pin(True) is True
    before = os.sched_getaffinity(0)
    try:
        pin_rank(1, 2, False)
        assert os.sched_getaffinity(0) == before
        pin_rank(1, 2, True)  # rank 1 of 2: the second half of the cores, as pin_to_cores gives it
        cores = sorted(before)
        half = len(cores) // 2
        assert os.sched_getaffinity(0) == (set(cores[half:2 * half]) if half else before)
    finally:
        os.sched_setaffinity(0, before)
