"""A decode step: dense layers, MoE layers under their overlap schedule, the head and the MTP drafts.

``step = dense layers + MoE layers (schedule) + embed/norm/LM head/sample + drafts x (MTP layer
+ head) + step overhead (+ the DP groups' metadata all-reduce)``; every op that runs adds the
hardware's per-op host overhead. Output speed per request is the expected accepted tokens per step
(``1 + a + a^2 + ... + a^drafts``) over the step time. With a measured expert load
(``skew.ExpertLoadFile``) each MoE layer's load-dependent ops are priced with its own layer of the
file; the MTP layer with a layer at their mean (its own load is not in the file).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from epserve.config import ModelConfig
from epserve.parallel.stages import (
    HEAD_OPS,
    MTP_DRAFT_OPS,
    Op,
    OverlapMode,
    Schedule,
    Stage,
    dense_layer_schedule,
    moe_layer_schedule,
)
from epserve.planner.deployment import Deployment, check_deployment
from epserve.planner.hardware import HardwareSpec
from epserve.planner.memory import MemoryEstimate, estimate_memory
from epserve.planner.ops import LOAD_OPS, BatchShape, PricedOp, price_ops
from epserve.planner.skew import ExpertLoadFile, LayerLoad, LoadReport
from epserve.planner.timeline import EMPTY, Timeline, run_schedule

BREAKDOWN_KEYS = ("gemm", "group_gemm", "attention", "dispatch", "combine", "other", "overhead")


@dataclass(frozen=True)
class StepEstimate:
    overlap: str  # the schedule priced (auto resolved)
    step_time_us: float
    moe_layer_time_us: float
    dense_layer_time_us: float
    head_time_us: float
    mtp_time_us: float
    breakdown_us: dict[str, float]
    exposed_comm_us: float
    moe_ops: dict[str, PricedOp]  # one MoE layer, the (first) micro-batch


@dataclass(frozen=True)
class DecodePlan:
    model_name: str
    hardware: str
    deployment: Deployment
    memory: MemoryEstimate
    step: StepEstimate  # priced whether or not it fits in memory
    fits_reason: str | None = None  # what does not fit in a GPU's memory, by how much (None: it fits)
    expert_load: LoadReport | None = None  # priced with a measured expert load (None: uniform routing)

    @property
    def fits(self) -> bool:
        return self.fits_reason is None

    @property
    def refusal(self) -> str | None:
        """``fits_reason`` by its former name (``benchmarks/planner_validation.py``)."""
        return self.fits_reason

    @property
    def output_tokens_per_s_per_request(self) -> float:
        return self.deployment.accepted_tokens_per_step / self.step.step_time_us * 1e6

    @property
    def throughput_tokens_per_s_per_gpu(self) -> float:
        return self.deployment.batch * self.output_tokens_per_s_per_request

    @property
    def throughput_tokens_per_s_per_node(self) -> float:
        """A node's worth of GPUs (the NVLink domain), whatever the EP."""
        return self.throughput_tokens_per_s_per_gpu * self.deployment.gpus_per_node

    def to_json(self) -> dict[str, Any]:
        d, mem, step = self.deployment, self.memory, self.step
        out: dict[str, Any] = {
            "model": self.model_name,
            "gpu": self.hardware,
            "ep": d.ep,
            "tp": d.tp,
            "dp": d.dp,
            "batch": d.batch,
            "requests_per_dp_group": d.requests_per_dp_group,
            "num_nodes": d.num_nodes,
            "gpus_per_node": d.gpus_per_node,
            "kv_len": d.kv_len,
            "mtp_draft": d.mtp_draft,
            "mtp_accept": d.mtp_accept,
            "dispatch": d.dispatch,
            "num_redundant_experts": d.num_redundant_experts,
            "eplb": d.eplb,
            "weight_dtype": d.weight_dtype,
            "kv_dtype": d.kv_dtype,
            "fits": self.fits,
            "fits_reason": self.fits_reason,
            "kv_bytes_per_token": mem.kv_bytes_per_token,
            "max_batch_per_gpu": mem.max_batch_per_gpu,
            "max_requests_per_dp_group": mem.max_requests_per_dp_group,
            "memory_per_gpu_bytes": {
                "weights": mem.weights_bytes,
                "kv": mem.kv_bytes,
                "reserved": mem.reserved_bytes,
                "capacity": mem.capacity_bytes,
            },
            "accepted_tokens_per_step": d.accepted_tokens_per_step,
            "expert_load": self.expert_load and self.expert_load.to_json(),
        }
        if d.attn_dtype != d.weight_dtype:  # an NVFP4 checkpoint's attention, left unquantized
            out["attention_dtype"] = d.attn_dtype
        out.update(self.timings())
        out["breakdown_us"] = dict(step.breakdown_us)
        out["exposed_comm_us"] = step.exposed_comm_us
        return out

    def timings(self) -> dict[str, Any]:
        """The step and what it delivers (JSON)."""
        return {
            "overlap": self.step.overlap,
            "moe_layer_time_us": self.step.moe_layer_time_us,
            "step_time_us": self.step.step_time_us,
            "output_tokens_per_s_per_request": self.output_tokens_per_s_per_request,
            "throughput_tokens_per_s_per_gpu": self.throughput_tokens_per_s_per_gpu,
            "throughput_tokens_per_s_per_node": self.throughput_tokens_per_s_per_node,
        }


def _run_layers(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, schedule: Schedule, shape: BatchShape, num_layers: int,
    loads: Sequence[LayerLoad] | None = None,
) -> tuple[Timeline, dict[str, PricedOp]]:
    """Split the DP group's requests of ``shape`` over the schedule's micro-batches (as the engine
    splits its batch), price its ops, run ``num_layers`` layers (layer ``l`` under ``loads[l]``, if
    given: only ``LOAD_OPS`` are priced again per load). Returns the first layer's ops."""
    n = schedule.num_micro_batches
    group = round(shape.requests * d.tp)
    shapes = [replace(shape, requests=(group // n + (1 if i < group % n else 0)) / d.tp) for i in range(n)]
    if loads is None:
        costs = [price_ops(model, hw, d, s, schedule.ops) for s in shapes]
        return run_schedule(schedule, costs, num_layers), costs[0]
    skewed = [op for op in schedule.ops if op.name in LOAD_OPS]
    layers_of: dict[BatchShape, list[dict[str, PricedOp]]] = {}  # equal halves are priced once
    for s in shapes:
        if s not in layers_of:
            base = price_ops(model, hw, d, s, schedule.ops)
            priced = {load: {**base, **price_ops(model, hw, d, s, skewed, load)} for load in dict.fromkeys(loads)}
            layers_of[s] = [priced[load] for load in loads]
    per_layer = [layers_of[s] for s in shapes]
    return run_schedule(schedule, per_layer, num_layers), per_layer[0][0]


def _run_ops(model: ModelConfig, hw: HardwareSpec, d: Deployment, shape: BatchShape, ops: tuple[Op, ...]) -> Timeline:
    """Ops outside the decoder layers, in order, on the whole batch."""
    return _run_layers(model, hw, d, Schedule("ops", (Stage("ops", ops),)), shape, 1)[0]


def estimate_step(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, mode: OverlapMode, shape: BatchShape | None = None,
    load: ExpertLoadFile | None = None,
) -> StepEstimate:
    """Time one decode step (or, with a prefill ``shape``, one prefill forward) under ``mode``, with
    uniform routing or the measured expert ``load`` (placed as ``d.eplb`` says)."""
    shape = shape or BatchShape(d.batch, d.query_len, d.kv_len)
    num_moe = len(model.moe_layer_ids)
    loads = load.model_layers(model, d) if load is not None and num_moe else None
    dense, _ = _run_layers(model, hw, d, dense_layer_schedule(shape.phase), shape,
                           model.num_hidden_layers - num_moe)
    moe, moe_ops = _run_layers(model, hw, d, moe_layer_schedule(mode, shape.phase), shape, num_moe, loads)
    head = _run_ops(model, hw, d, shape, HEAD_OPS)
    mtp = EMPTY
    if shape.phase == "decode" and d.mtp_draft:
        draft = replace(shape, query_len=1)
        mean = None if load is None or not num_moe else (load.mean_layer(model, d),)
        layer, _ = _run_layers(model, hw, d, moe_layer_schedule("dispatch"), draft, 1, mean)
        mtp = (layer + _run_ops(model, hw, d, draft, MTP_DRAFT_OPS)).scaled(d.mtp_draft)
    total = dense + moe + head + mtp
    sync = hw.step_sync_us if d.dp > 1 else 0.0  # the step's metadata all-reduce over the DP groups
    breakdown = {k: total.by_kind_us[k] for k in BREAKDOWN_KEYS}
    breakdown["other"] += total.by_kind_us["collective"] + sync
    breakdown["overhead"] += hw.step_overhead_us
    return StepEstimate(
        overlap=mode,
        step_time_us=total.time_us + hw.step_overhead_us + sync,
        moe_layer_time_us=moe.time_us / max(num_moe, 1),
        dense_layer_time_us=dense.time_us / max(model.num_hidden_layers - num_moe, 1),
        head_time_us=head.time_us,
        mtp_time_us=mtp.time_us,
        breakdown_us=breakdown,
        exposed_comm_us=total.exposed_comm_us,
        moe_ops=moe_ops,
    )


def overlap_modes(d: Deployment) -> tuple[OverlapMode, ...]:
    """The schedules to price: the one asked for, or both candidates of ``auto``."""
    return ("dispatch", "microbatch") if d.overlap == "auto" else (d.overlap,)  # type: ignore[return-value]


def plan_decode(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, model_name: str = "model", load: ExpertLoadFile | None = None
) -> DecodePlan:
    """Memory (what does not fit is said in ``fits_reason``, and priced all the same), then the step
    under the overlap mode; ``auto`` keeps the faster of ``dispatch`` and ``microbatch`` as the engine
    would. ``load``: a measured expert load, placed as ``d.eplb`` says (None: uniform routing)."""
    check_deployment(model, hw, d)
    memory = estimate_memory(model, hw, d)
    steps = [estimate_step(model, hw, d, mode, load=load) for mode in overlap_modes(d)]
    report = load.report(model, d) if load is not None else None
    return DecodePlan(model_name, hw.name, d, memory, min(steps, key=lambda s: s.step_time_us), memory.shortfall(),
                      report)
