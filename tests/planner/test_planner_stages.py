"""The stage lists (shared with the engine) and the timeline that runs them."""

from __future__ import annotations

import inspect

import pytest

import epserve.parallel.stages as stages
from epserve.parallel.stages import (
    HEAD_OPS,
    MTP_DRAFT_OPS,
    OVERLAP_MODES,
    Op,
    Schedule,
    Stage,
    dense_layer_schedule,
    moe_layer_schedule,
)
from epserve.planner.cost import Transfer
from epserve.planner.ops import PRICERS, PricedOp
from epserve.planner.timeline import run_schedule, stage_order


def _all_schedules() -> list[Schedule]:
    return [moe_layer_schedule(m, p) for m in OVERLAP_MODES for p in ("decode", "prefill")] + [
        dense_layer_schedule("decode"), dense_layer_schedule("prefill")]


def test_stages_module_is_plain_python() -> None:
    source = inspect.getsource(stages)
    assert "import torch" not in source and "from torch" not in source


def test_planner_prices_exactly_the_stage_ops() -> None:
    names = {op.name for s in _all_schedules() for op in s.ops} | {op.name for op in HEAD_OPS + MTP_DRAFT_OPS}
    assert names == set(PRICERS)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_every_overlap_mode_runs_the_same_ops_once(phase: str) -> None:
    reference = sorted(op.name for op in moe_layer_schedule("none", phase).ops)  # type: ignore[arg-type]
    for mode in OVERLAP_MODES:
        ops = [op.name for op in moe_layer_schedule(mode, phase).ops]  # type: ignore[arg-type]
        assert sorted(ops) == reference
        assert ops.index("dispatch_send") < ops.index("dispatch_recv") < ops.index("experts")
        assert ops.index("experts") < ops.index("combine_send") < ops.index("combine_recv")


def test_microbatch_schedule_is_the_five_stages() -> None:
    s = moe_layer_schedule("microbatch")
    assert (s.num_micro_batches, s.micro_batch_offset) == (2, 2)
    assert [[op.name for op in st.ops] for st in s.stages] == [
        ["input_norm", "qkv_a_proj", "q_b_proj", "append_kv", "q_absorb"],
        ["attention_core", "v_absorb", "o_proj", "attn_reduce_scatter", "post_norm", "gate"],
        ["dispatch_send", "shared_expert"],
        ["dispatch_recv", "experts", "combine_send"],
        ["combine_recv", "ffn_all_gather"],
    ]
    dispatch = [op.name for op in moe_layer_schedule("dispatch").ops]
    assert dispatch.index("dispatch_send") + 1 == dispatch.index("shared_expert")


def test_micro_batches_interleave_with_an_offset() -> None:
    s = moe_layer_schedule("microbatch")
    order = [(mb, st.name) for mb, st in stage_order(s, num_layers=2)]
    assert order[:6] == [(0, "attn_prep"), (0, "attn_core"), (0, "dispatch_shared"), (1, "attn_prep"),
                         (0, "experts"), (1, "attn_core")]
    assert len(order) == 2 * 2 * 5
    assert order[-1] == (1, "combine")


def _cost(name: str, kind: str, us: float, wire: float = 0.0, latency: float = 0.0) -> PricedOp:
    return PricedOp(name, kind, us, Transfer(latency, wire), 0.0, 0.0, "memory", 1)


TOY_OPS = (Op("a", "gemm"), Op("send", "dispatch", "send"), Op("b", "gemm"), Op("recv", "dispatch", "recv"))


def test_timeline_hides_transfers_behind_compute() -> None:
    costs = {"a": _cost("a", "gemm", 10), "send": _cost("send", "dispatch", 1, wire=20, latency=5),
             "b": _cost("b", "gemm", 8), "recv": _cost("recv", "dispatch", 1)}
    t = run_schedule(Schedule("toy", (Stage("s", TOY_OPS),)), [costs], num_layers=1)
    # send ends at 11; the transfer lands at 11 + 5 + 20 = 36; b ends at 19; wait 17; recv ends at 37
    assert t.time_us == pytest.approx(37)
    assert t.exposed_comm_us == pytest.approx(17)
    assert sum(t.by_kind_us.values()) == pytest.approx(t.time_us)
    # a longer b hides the whole transfer
    costs["b"] = _cost("b", "gemm", 40)
    assert run_schedule(Schedule("toy", (Stage("s", TOY_OPS),)), [costs], 1).exposed_comm_us == 0


def test_two_micro_batches_share_one_link() -> None:
    costs = {"a": _cost("a", "gemm", 0), "send": _cost("send", "dispatch", 0, wire=10),
             "b": _cost("b", "gemm", 0), "recv": _cost("recv", "dispatch", 0)}
    schedule = Schedule("toy2", (Stage("s1", TOY_OPS[:2]), Stage("s2", TOY_OPS[2:])), 2, 1)
    # A sends (link busy 0-10), B sends at 0 but queues (10-20); A waits to 10, B to 20
    assert run_schedule(schedule, [costs, costs], 1).time_us == pytest.approx(20)


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="overlap"):
        moe_layer_schedule("both")  # type: ignore[arg-type]
