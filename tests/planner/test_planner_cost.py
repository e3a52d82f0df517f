"""Planner arithmetic checked by hand: GEMM / GroupGEMM FLOPs and bytes, tokens per expert, kernel
time, all-to-all volumes, KV bytes per token and the memory model."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from planner_toys import TOY, V3

from epserve.parallel.stages import moe_layer_schedule
from epserve.planner import (
    Deployment,
    estimate_memory,
    load_hardware,
    plan_decode,
    planned_kv_bytes_per_token,
)
from epserve.planner.cost import (
    Kernel,
    Work,
    activated_experts,
    all_to_all,
    busiest_rank_load,
    gemm_work,
    group_gemm_work,
    kernel_time,
    tokens_per_expert,
)
from epserve.planner.deployment import WEIGHT_BYTES
from epserve.planner.errors import PlanError
from epserve.planner.memory import expert_counts, weight_counts
from epserve.planner.ops import BatchShape, price_ops


def test_gemm_flops_and_bytes_by_hand() -> None:
    # [4, 8] x [8, 16] in BF16: 2*4*8*16 FLOPs; (4*8 + 16*8 + 4*16) elements of 2 bytes
    w = gemm_work(4, 8, 16)
    assert w.flops == 1024
    assert w.bytes == 2 * (32 + 128 + 64)
    # FP8 input with one fp32 scale per 128 values, FP8 weight with one per 128x128 tile, BF16 out
    w8 = gemm_work(2, 256, 128, in_bytes=1 + 4 / 128, weight_bytes=1 + 4 / 128**2, out_bytes=2)
    assert w8.flops == 2 * 2 * 256 * 128
    assert w8.bytes == pytest.approx(512 * 1.03125 + 32768 * (1 + 4 / 16384) + 256 * 2)


def test_group_gemm_flops_and_bytes_by_hand() -> None:
    # 3 experts of 4 tokens each: 2gmkn FLOPs, g(mk + nk + mn) elements
    w = group_gemm_work(3, 4, 8, 16)
    assert w.flops == 3 * 2 * 4 * 8 * 16
    assert w.bytes == 3 * 2 * (32 + 128 + 64)
    # V3 expert up-projection at 16 tokens per expert, 2 active experts, FP8 weights
    up = group_gemm_work(2, 16, 7168, 4096, in_bytes=1, weight_bytes=1, out_bytes=2)
    assert up.flops == 2 * 2 * 16 * 7168 * 4096
    assert up.bytes == 2 * (16 * 7168 + 4096 * 7168 + 16 * 4096 * 2)


def test_tokens_per_expert_formula() -> None:
    # m = batch_per_gpu * query_len * top_k * EP / n_routed_experts
    assert tokens_per_expert(32, 2, 8, 128, 256) == 256
    assert tokens_per_expert(1, 1, 8, 8, 256) == 0.25
    # V3 at EP 256 = one expert per GPU: every GPU receives batch * top_k tokens
    assert tokens_per_expert(64, 1, 8, 256, 256) == 64 * 8


def test_activated_experts() -> None:
    assert activated_experts(32, 256, 8, 0) == 0
    assert activated_experts(32, 256, 8, 8) == pytest.approx(32 * (1 - (248 / 256) ** 8))
    assert activated_experts(2, 256, 8, 10**6) == pytest.approx(2)


def test_experts_op_prices_grouped_gemm_over_the_active_experts() -> None:
    d = Deployment(ep=128, tp=1, batch=4)
    ops = price_ops(V3, TOY, d, BatchShape(4, 1, 1000), moe_layer_schedule("dispatch").ops)
    h, inter = 7168, 2048
    copies_x, active_x = busiest_rank_load(128, 256, 8, 4 * 128)  # priced for the busiest GPU
    pairs = 4 * 8 * copies_x  # tokens per GPU x top-k
    groups = min(2, activated_experts(2, 256, 8, 4 * 128) * active_x)
    act = 2.0  # TOY has no FP8 tensor cores: activations stay BF16
    w = WEIGHT_BYTES["fp8"]
    expected_bytes = (groups * 3 * h * inter * w  # the active experts' weights, read once
                      + pairs * h * act + pairs * 2 * inter * 2  # gate_up: in, out
                      + pairs * inter * (4 + act)  # SwiGLU: read gate and up, write the product
                      + pairs * inter * act + pairs * h * 2)  # down: in, out
    assert ops["experts"].flops == pytest.approx(2 * pairs * h * 3 * inter)
    assert ops["experts"].bytes == pytest.approx(expected_bytes)


def test_one_rank_has_no_imbalance() -> None:
    assert busiest_rank_load(1, 256, 8, 1000) == (1.0, 1.0)
    # EP 1 (one engine instance, the dp 1 validation) prices the mean: every copy, E[active] experts
    d = Deployment(ep=1, tp=1, batch=4, weight_dtype="bf16")
    ops = price_ops(V3, TOY, d, BatchShape(4, 1, 1000), moe_layer_schedule("dispatch").ops)
    pairs, groups = 4 * 8, activated_experts(256, 256, 8, 4)
    assert ops["experts"].flops == pytest.approx(2 * pairs * 7168 * 3 * 2048)
    assert ops["experts"].bytes == pytest.approx(groups * 3 * 7168 * 2048 * 2 + pairs * (7168 * 2 + 2048 * 2 * 2
                                                 + 2048 * 6 + 2048 * 2 + 7168 * 2))


def _enumerate_busiest(ep: int, slots: int, k: int, tokens: int) -> tuple[float, float]:
    """Every routing of ``tokens`` tokens (each ``k`` distinct of ``slots``), equally likely."""
    per = slots // ep
    picks = list(itertools.combinations(range(slots), k))
    max_copies = max_active = mean_active = 0.0
    routings = list(itertools.product(picks, repeat=tokens))
    for routing in routings:
        chosen = [s for p in routing for s in p]
        copies = [sum(1 for s in chosen if s // per == r) for r in range(ep)]
        active = [len({s for s in chosen if s // per == r}) for r in range(ep)]
        max_copies += max(copies)
        max_active += max(active)
        mean_active += sum(active) / ep
    n = len(routings)
    return max_copies / n / (tokens * k / ep), max_active / mean_active


def test_busiest_rank_by_hand_and_by_enumeration() -> None:
    # 1 token picks 2 of 4 experts, 2 per rank: both on one rank in 2 of the 6 pairs (max 2), else 1 each
    assert _enumerate_busiest(2, 4, 2, 1) == pytest.approx((4 / 3, 4 / 3))
    assert busiest_rank_load(2, 4, 2, 1) == pytest.approx((4 / 3, 4 / 3), rel=0.03)
    for ep, slots, k, tokens in ((2, 4, 2, 2), (2, 6, 2, 3), (3, 6, 2, 2), (2, 8, 3, 2)):
        exact = _enumerate_busiest(ep, slots, k, tokens)
        assert busiest_rank_load(ep, slots, k, tokens) == pytest.approx(exact, rel=0.03)


def test_imbalance_falls_as_tokens_per_rank_grow() -> None:
    copies, active = zip(*(busiest_rank_load(8, 256, 8, t) for t in (8, 64, 512, 4096, 65536)))
    assert all(a > b for a, b in zip(copies, copies[1:]))
    assert copies[0] > 1.3 and copies[-1] < 1.02
    assert all(a >= b for a, b in zip(active, active[1:]))
    assert active[0] > 1.1 and active[-1] == pytest.approx(1.0)  # every expert active on every rank
    # more ranks, same tokens per rank: a busier busiest rank
    assert busiest_rank_load(64, 256, 8, 64 * 32)[0] > busiest_rank_load(8, 256, 8, 8 * 32)[0]


def test_kernel_time_is_floor_plus_roofline() -> None:
    # 1 MFLOP at 0.5 TFLOP/s = 2 us; 1 MB at 50 GB/s = 20 us; floor 2 us -> 22 us, memory-bound
    t = kernel_time(TOY, Kernel("gemm", Work(1e6, 1e6)))
    assert t.time_us == pytest.approx(22.0)
    assert t.bound == "memory"
    assert kernel_time(TOY, Kernel("gemm", Work(1e8, 1e6))).bound == "compute"
    assert kernel_time(TOY, Kernel("other", Work(0, 10))).bound == "latency"


def test_all_to_all_volume_and_links() -> None:
    assert all_to_all(TOY, 1, 4, 100, 8, 1000).time_us == 0
    # inside one node (EP 4 = G): 3/4 of the 800 copies over NVLink at 5 GB/s, NVLink latency
    intra = all_to_all(TOY, 4, 4, 100, 8, 1000)
    assert intra.latency_us == 10.0
    assert intra.wire_us == pytest.approx(600 * 1000 / 5e9 * 1e6)
    # EP 16 over 4 nodes: 12/16 of the copies over IB at 0.5 GB/s dominate
    inter = all_to_all(TOY, 16, 4, 100, 8, 1000)
    assert inter.latency_us == 30.0
    assert inter.wire_us == pytest.approx(800 * 12 / 16 * 1000 / 0.5e9 * 1e6)
    # prefill kernels send a token once per remote node: (N-1)(1 - (1-1/N)^k) with N = 4
    dedup = all_to_all(TOY, 16, 4, 100, 8, 1000, dedup_nodes=True)
    assert dedup.wire_us == pytest.approx(100 * 3 * (1 - 0.75**8) * 1000 / 0.5e9 * 1e6)


def test_kv_bytes_per_token() -> None:
    # (kv_lora_rank + qk_rope_head_dim) values per layer: (512 + 64) x 61 layers
    assert planned_kv_bytes_per_token(V3, "bf16") == 61 * 576 * 2 == 70272
    assert planned_kv_bytes_per_token(V3, "fp8") == 61 * 576
    assert planned_kv_bytes_per_token(V3, "bf16", mtp_draft=1) == 62 * 576 * 2  # the MTP layer caches too


def test_deepseek_v3_parameter_count() -> None:
    total = weight_counts(V3, Deployment(ep=1))
    assert total.parameters / 1e9 == pytest.approx(671, rel=0.002)


def test_memory_arithmetic() -> None:
    hw = load_hardware("h200")
    d = Deployment(ep=8, tp=1, batch=10, kv_len=4000)
    mem = estimate_memory(V3, hw, d)
    per_request = 4000 * 70272
    assert mem.kv_bytes == 10 * per_request
    assert mem.reserved_bytes == int(hw.memory_bytes * 0.10)
    assert mem.max_batch_per_gpu == (hw.memory_bytes - mem.reserved_bytes - mem.weights_bytes) // per_request
    # halving EP adds 16 experts x 58 MoE layers of FP8 weights (and their tile scales, and an int64
    # entry each of the rank's slot table) on every GPU
    wide = estimate_memory(V3, hw, replace(d, ep=16))
    assert mem.weights_bytes - wide.weights_bytes == 16 * 58 * (expert_counts(V3).bytes("fp8") + 8)
    # TP replicates the latent cache: TP 2 stores both DP ranks' requests
    tp2 = estimate_memory(V3, hw, replace(d, tp=2))
    assert tp2.kv_bytes == 2 * mem.kv_bytes
    # FP8 KV halves the cache and so roughly doubles the batch that fits
    fp8 = estimate_memory(V3, hw, replace(d, kv_dtype="fp8"))
    assert fp8.kv_bytes * 2 == mem.kv_bytes
    assert fp8.max_batch_per_gpu in (2 * mem.max_batch_per_gpu, 2 * mem.max_batch_per_gpu + 1)


def test_redundant_experts_cost_memory() -> None:
    hw = load_hardware("h200")
    base = estimate_memory(V3, hw, Deployment(ep=32))
    extra = estimate_memory(V3, hw, Deployment(ep=32, num_redundant_experts=32))
    # per MoE layer one more expert slot per GPU, and room for 32 more replicas of each of the 256
    # experts in the int64 routing table (the engine's replica_table [256, R + 1])
    assert extra.weights_bytes - base.weights_bytes == 58 * (expert_counts(V3).bytes("fp8") + 8 * (1 + 256 * 32))


def test_weights_that_do_not_fit_are_priced_with_the_reason() -> None:
    # 671B FP8 parameters on one node of 80 GB H100s: ~96 GiB of weights per GPU (72 usable)
    plan = plan_decode(V3, load_hardware("h100"), Deployment(ep=8, batch=1))
    assert not plan.fits and plan.step.step_time_us > 0
    assert plan.fits_reason == "weights need 96.1 GiB per GPU, more than the 72.0 GiB usable (24.1 GiB short)"
    assert plan.refusal == plan.fits_reason  # the former name, still read by benchmarks/planner_validation.py
    assert plan.memory.max_batch_per_gpu == 0
    assert math.isclose(plan.memory.weights_bytes / 2**30, 96.06, rel_tol=0.001)


def test_padded_dispatch_sends_fixed_buffers() -> None:
    """padded: every remote rank gets tokens x min(top_k, slots per rank) rows, whatever the routing.
    The `small` preset at EP 2 (top-6 of 64 experts): exactly 2x the all_to_all rows, as measured
    (docs/benchmarks.md: 2.000x); V3 at EP 8 (top-8 of 256): 8x; at EP 128 (2 slots per rank): 32x."""
    for ep, ratio in ((8, 8.0), (128, 32.0)):
        d = Deployment(ep=ep, batch=4, gpus_per_node=8, weight_dtype="bf16")
        shape = BatchShape(4, 1, 1000)
        sched = moe_layer_schedule("dispatch").ops
        exact = price_ops(V3, TOY, d, shape, sched)["combine_send"].transfer.wire_us
        padded = price_ops(V3, TOY, replace(d, dispatch="padded"), shape, sched)["combine_send"].transfer.wire_us
        assert padded == pytest.approx(ratio * exact)
    with pytest.raises(PlanError, match="unknown dispatch"):
        plan_decode(V3, TOY, Deployment(ep=8, dispatch="carrier-pigeon"))
