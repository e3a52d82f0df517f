"""The terms that let one cost model serve GPUs and our eager CPU engine: the achievable-bandwidth
curve by rows, the host overhead per stage op (and per token), the step overhead, the fit that
calibration makes of them, and hardware files carrying them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from epserve.config import ModelConfig
from epserve.parallel.stages import HEAD_OPS, dense_layer_schedule, moe_layer_schedule
from epserve.planner import BUILTIN, Deployment, load_hardware, resolve_model, save_hardware
from epserve.planner.cost import Kernel, Work, kernel_time
from epserve.planner.hardware import Efficiency, HardwareSpec, MeasuredPoint, interpolate_fraction
from epserve.planner.ops import BatchShape, price_ops
from epserve.planner.step import estimate_step

V3 = resolve_model("deepseek-v3")[1]
TOY = HardwareSpec(
    name="toy", peak_flops={"bf16": 1e12}, memory_bytes=10 * 2**30, memory_bandwidth=1e11,
    nvlink_bandwidth=1e10, ib_bandwidth=1e9, gpus_per_node=8,
    efficiency={c: Efficiency(0.5, 0.5) for c in ("gemm", "group_gemm", "attention", "other")},
    kernel_latency_us=2.0, reserved_memory_fraction=0.0,
)
CURVED = replace(TOY, memory_by_rows={"gemm": ((1.0, 1e6, 0.8), (16.0, 1e6, 0.4))})


def test_bandwidth_curve_interpolates_time_per_byte_linearly_in_rows() -> None:
    curve = ((1.0, 0.8), (16.0, 0.4))
    assert interpolate_fraction(curve, 1) == 0.8
    assert interpolate_fraction(curve, 0.25) == 0.8  # flat below the first point
    assert interpolate_fraction(curve, 1000) == 0.4  # and beyond the last
    # half way: time per byte (1/0.8 + 1/0.4) / 2 = 1.875 -> fraction 0.5333
    assert interpolate_fraction(curve, 8.5) == pytest.approx(1 / 1.875)
    assert interpolate_fraction(((16.0, 0.4), (1.0, 0.8)), 8.5) == pytest.approx(1 / 1.875)  # any order


def test_bandwidth_curve_interpolates_in_log_matrix_size() -> None:
    curve = ((1.0, 1e6, 0.5), (16.0, 1e6, 0.25), (1.0, 16e6, 0.8), (16.0, 16e6, 0.4))
    hw = replace(TOY, memory_by_rows={"gemm": curve})
    assert hw.memory_fraction("gemm", 1, 1e6) == 0.5
    assert hw.memory_fraction("gemm", 1, 1e3) == 0.5  # smaller than measured: the smallest size
    assert hw.memory_fraction("gemm", 1, 1e9) == 0.8  # larger: the largest
    assert hw.memory_fraction("gemm", 1) == 0.8  # unknown size: the largest
    # 4 MB is half way in log size: time per byte (1/0.5 + 1/0.8) / 2 -> 0.615
    assert hw.memory_fraction("gemm", 1, 4e6) == pytest.approx(1 / (0.5 / 0.5 + 0.5 / 0.8))
    assert hw.memory_fraction("gemm", 16, 4e6) == pytest.approx(1 / (0.5 / 0.25 + 0.5 / 0.4))


def test_kernel_time_reads_the_curve_at_the_kernels_rows() -> None:
    # 1 MB at 100 GB/s x 0.4 (16 rows) = 25 us, + 2 us floor
    assert kernel_time(CURVED, Kernel("gemm", Work(0.0, 1e6), rows=16)).time_us == pytest.approx(27.0)
    assert kernel_time(CURVED, Kernel("gemm", Work(0.0, 1e6), rows=1)).time_us == pytest.approx(2 + 12.5)
    # no rows (or a class without a curve): the constant fraction, 0.5 -> 20 us
    assert kernel_time(CURVED, Kernel("gemm", Work(0.0, 1e6))).time_us == pytest.approx(22.0)
    assert kernel_time(CURVED, Kernel("group_gemm", Work(0.0, 1e6), rows=16)).time_us == pytest.approx(22.0)
    # compute still bounds: 1 GFLOP at 0.5 TFLOP/s = 2000 us
    assert kernel_time(CURVED, Kernel("gemm", Work(1e9, 1e6), rows=16)).time_us == pytest.approx(2002.0)


def test_gemm_kernels_carry_their_rows() -> None:
    d = Deployment(ep=8, tp=1, batch=4, weight_dtype="bf16")
    shape = BatchShape(4, 1, 100)
    plain = price_ops(V3, TOY, d, shape, moe_layer_schedule("dispatch").ops)
    curved = price_ops(V3, replace(TOY, memory_by_rows={"gemm": ((1.0, 1e6, 0.25),)}), d, shape,
                       moe_layer_schedule("dispatch").ops)
    # o_proj [4, 16384] x [16384, 7168] in BF16 is memory-bound: half the fraction, twice the memory time
    assert curved["o_proj"].compute_us - 2.0 == pytest.approx(2 * (plain["o_proj"].compute_us - 2.0))
    assert curved["experts"].compute_us == plain["experts"].compute_us  # group_gemm has no curve here


def test_op_overhead_is_charged_per_op_that_runs_and_per_token() -> None:
    hw = replace(TOY, op_overhead_us=10.0, op_overhead_per_token_us=0.5)
    d = Deployment(ep=8, tp=2, batch=4)  # T_attn = 4 x 2 = 8 tokens, T_moe = 4 after the reduce-scatter
    shape = BatchShape(4, 1, 100)
    ops = moe_layer_schedule("dispatch").ops
    with_overhead, without = price_ops(V3, hw, d, shape, ops), price_ops(V3, TOY, d, shape, ops)
    extra = {name: with_overhead[name].compute_us - without[name].compute_us for name in without}
    assert extra["input_norm"] == pytest.approx(10 + 0.5 * 8)
    assert extra["attention_core"] == pytest.approx(10 + 0.5 * 8)
    assert extra["experts"] == pytest.approx(10 + 0.5 * 4)
    assert extra["attn_reduce_scatter"] == pytest.approx(10 + 0.5 * 8)  # TP 2: the collective runs
    assert with_overhead["experts"].overhead_us == pytest.approx(12)
    tp1 = Deployment(ep=8, tp=1, batch=4)
    skipped = price_ops(V3, hw, tp1, shape, ops)["attn_reduce_scatter"]
    assert skipped.compute_us == 0 and skipped.overhead_us == 0 and skipped.bound == "skipped"


def test_step_overhead_counts_the_stage_ops_by_hand() -> None:
    # V3 at TP 1 without MTP: 3 dense layers of 10 ops (input_norm, qkv_a_proj, q_b_proj, append_kv,
    # q_absorb, attention_core, v_absorb, o_proj, post_norm, mlp), 58 MoE layers of 16 (the same
    # attention ops, post_norm, gate, dispatch send/recv, shared_expert, experts, combine send/recv),
    # and the 4 head ops: 962 ops; the TP collectives are skipped. (EP 1: no transfer for the
    # overhead to hide behind.)
    assert len([o for o in dense_layer_schedule().ops if "all_gather" not in o.name and "scatter" not in o.name]) == 10
    assert len(HEAD_OPS) == 4
    d = Deployment(ep=1, tp=1, batch=2, kv_len=1000, weight_dtype="bf16")
    hw = replace(BUILTIN["h200"], op_overhead_us=1.0, op_overhead_per_token_us=0.25, step_overhead_us=300.0)
    base = estimate_step(V3, BUILTIN["h200"], d, "dispatch")
    step = estimate_step(V3, hw, d, "dispatch")
    expected = 962 * (1.0 + 0.25 * 2) + 300.0
    assert step.step_time_us - base.step_time_us == pytest.approx(expected)
    assert step.breakdown_us["overhead"] == pytest.approx(expected)
    assert base.breakdown_us["overhead"] == 0.0
    assert sum(step.breakdown_us.values()) == pytest.approx(step.step_time_us)
    # two micro-batches of one request each issue every MoE op twice; dense layers and head once
    mb = estimate_step(V3, hw, d, "microbatch").breakdown_us["overhead"]
    assert mb == pytest.approx(58 * 2 * 16 * (1.0 + 0.25 * 1) + (3 * 10 + 4) * (1.0 + 0.25 * 2) + 300.0)


def test_gpu_entries_assume_cuda_graphs() -> None:
    for spec in BUILTIN.values():
        assert spec.op_overhead_us == spec.op_overhead_per_token_us == spec.step_overhead_us == 0.0
        assert spec.memory_by_rows == {}


def _engine_points(op_us: float, token_us: float, step_us: float) -> list[MeasuredPoint]:
    """What the engine would measure if the planner's host-overhead model held exactly."""
    from epserve.planner.calibrate_engine import engine_config

    hw = replace(TOY, op_overhead_us=op_us, op_overhead_per_token_us=token_us, step_overhead_us=step_us)
    points = []
    for layers in (2, 5, 8):
        model = ModelConfig.from_dict(engine_config(layers))
        for batch in (1, 16, 64):
            d = Deployment(ep=1, batch=batch, kv_len=50, overlap="dispatch", weight_dtype="bf16")
            t = estimate_step(model, hw, d, "dispatch").step_time_us
            points.append(MeasuredPoint("engine_step", f"tiny {layers} layers b{batch} kv50", 0.0, 0.0, t))
    return points


def test_fit_overhead_recovers_the_host_overhead() -> None:
    from epserve.planner.calibrate_engine import fit_overhead

    op_us, token_us, step_us = fit_overhead(TOY, _engine_points(20.0, 0.4, 150.0))
    assert (op_us, token_us, step_us) == pytest.approx((20.0, 0.4, 150.0), rel=1e-6)
    # a negative coefficient is dropped, the others refitted
    op_us, token_us, step_us = fit_overhead(TOY, _engine_points(25.0, 0.0, 0.0))
    assert (op_us, token_us, step_us) == pytest.approx((25.0, 0.0, 0.0), abs=1e-6)
    # per-op cost growing faster with the tokens than a positive intercept allows (a host whose small
    # ops are fused away): one per-op figure, the mean of the batches' slopes, never zero
    op_us, token_us, step_us = fit_overhead(TOY, _engine_points(-5.0, 2.0, 0.0))
    assert token_us == 0.0 and op_us > 0


def test_hardware_file_with_curves_and_overheads_loads_back(tmp_path: Path) -> None:
    spec = replace(CURVED, op_overhead_us=19.5, op_overhead_per_token_us=0.35, step_overhead_us=120.0,
                   memory_by_rows={"gemm": ((1.0, 1e6, 0.93), (16.0, 1e6, 0.46), (17.0, 16e6, 0.44)),
                                   "group_gemm": ((1.0, 3e6, 1.0),)},
                   points=(MeasuredPoint("engine_step", "tiny 2 layers b1 kv40", 0.0, 0.0, 800.0),))
    loaded = load_hardware(save_hardware(spec, tmp_path / "local.json"))
    assert loaded == spec
    d = Deployment(ep=8, batch=4, kv_len=100, weight_dtype="bf16")
    assert estimate_step(V3, loaded, d, "dispatch") == estimate_step(V3, spec, d, "dispatch")


def test_stream_efficiency_scales_only_the_weight_streaming_classes() -> None:
    hw = replace(CURVED, stream_efficiency=0.8)
    assert hw.memory_fraction("gemm", 1, 1e6) == pytest.approx(0.8 * 0.8)  # curve: 0.8 at 1 row
    assert hw.memory_fraction("gemm", 16, 1e6) == pytest.approx(0.8 * 0.4)
    assert hw.memory_fraction("group_gemm", 4) == pytest.approx(0.8 * 0.5)  # constant fraction
    assert hw.memory_fraction("attention", 4) == 0.5 and hw.memory_fraction("other") == 0.5
    # 1 MB at 100 GB/s x 0.4 x 0.8 = 31.25 us, + 2 us floor; compute (1 GFLOP at 0.5 TFLOP/s) unscaled
    assert kernel_time(hw, Kernel("gemm", Work(0.0, 1e6), rows=16)).time_us == pytest.approx(33.25)
    assert kernel_time(hw, Kernel("gemm", Work(1e9, 1e6), rows=16)).time_us == pytest.approx(2002.0)
    for spec in BUILTIN.values():  # the GPU sweeps do not move
        assert spec.stream_efficiency == 1.0


def _stream_point(hw: HardwareSpec, layers: int, experts: int, batch: int) -> MeasuredPoint:
    from epserve.planner.calibrate_engine import engine_config

    model = ModelConfig.from_dict(engine_config(layers, experts))
    d = Deployment(ep=1, batch=batch, kv_len=40, overlap="dispatch", weight_dtype="bf16")
    t = estimate_step(model, hw, d, "dispatch").step_time_us
    return MeasuredPoint("engine_stream", f"wide{experts} {layers} layers b{batch} kv40", 0.0, 0.0, t)


def test_fit_stream_efficiency() -> None:
    from epserve.planner.calibrate_engine import (
        STREAM_EFFICIENCY_RANGE,
        WIDE,
        engine_config,
        fit_stream_efficiency,
    )

    cfg = engine_config(4, 64)
    assert cfg["n_routed_experts"] == 64 and cfg["num_hidden_layers"] == 4
    assert all(cfg[k] == v for k, v in WIDE.items())
    assert engine_config(3)["hidden_size"] == 64  # without experts: the tiny preset
    # a single point of a memory-bound TOY step: halving every weight-streaming fraction prices the
    # step that was measured, so the fit returns 0.5; with the host overhead already known
    hw = replace(TOY, op_overhead_us=20.0, step_overhead_us=100.0)
    points = [_stream_point(replace(hw, stream_efficiency=0.5), 4, 64, 1)]
    assert fit_stream_efficiency(hw, points) == pytest.approx(0.5, rel=1e-6)
    # several points: the factor that makes the mean relative error zero (exact when all agree)
    points = [_stream_point(replace(hw, stream_efficiency=0.75), 3, 32, b) for b in (1, 16)]
    assert fit_stream_efficiency(hw, points) == pytest.approx(0.75, rel=1e-6)
    # no engine_stream points: the spec's own value; out of range: clipped
    assert fit_stream_efficiency(replace(hw, stream_efficiency=0.9), []) == 0.9
    slow = [replace(p, time_us=p.time_us * 100) for p in points]
    assert fit_stream_efficiency(hw, slow) == STREAM_EFFICIENCY_RANGE[0]
    fast = [replace(p, time_us=1.0) for p in points]
    assert fit_stream_efficiency(hw, fast) == STREAM_EFFICIENCY_RANGE[1]


def test_engine_calibration_flushes_through_the_op_hook(make_ckpt) -> None:
    """The engine-step calibration's cache flush rides on the model's op hook (before the dense MLP
    ops), and the model runs unchanged through it."""
    from epserve import LLM, SamplingParams
    from epserve.planner.calibrate_engine import flush_before_blocks

    llm = LLM(make_ckpt("tiny", dtype="float32"), dtype="float32", num_blocks=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], params)[0].token_ids
    model = llm.engine.runner.model
    spent = flush_before_blocks(model)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == want
    assert spent[0] > 0
    assert all(layer.op_hook is not None for layer in model.layers)
