"""A decode step: dense layers, MoE layers under their overlap schedule, the head and the MTP drafts.

``step = dense layers + MoE layers (schedule) + embed/norm/LM head/sample + drafts x (MTP layer
+ head) + step overhead (+ the DP groups' metadata all-reduce)``; every op that runs adds the hardware's per-op host overhead. Output speed per request is the expected accepted tokens per step
(``1 + a + a^2 + ... + a^drafts``) over the step time.
"""

from __future__ import annotations

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
from epserve.planner.ops import BatchShape, PricedOp, price_ops
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
    step: StepEstimate | None  # None: refused
    refusal: str | None = None

    @property
    def fits(self) -> bool:
        return self.step is not None

    @property
    def output_tokens_per_s_per_request(self) -> float:
        return 0.0 if self.step is None else self.deployment.accepted_tokens_per_step / self.step.step_time_us * 1e6

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
            "num_nodes": d.num_nodes,
            "gpus_per_node": d.gpus_per_node,
            "kv_len": d.kv_len,
            "mtp_draft": d.mtp_draft,
            "mtp_accept": d.mtp_accept,
            "overlap": step.overlap if step else d.overlap,
            "dispatch": d.dispatch,
            "num_redundant_experts": d.num_redundant_experts,
            "weight_dtype": d.weight_dtype,
            "kv_dtype": d.kv_dtype,
            "fits": self.fits,
            "refusal": self.refusal,
            "kv_bytes_per_token": mem.kv_bytes_per_token,
            "max_batch_per_gpu": mem.max_batch_per_gpu,
            "memory_per_gpu_bytes": {
                "weights": mem.weights_bytes,
                "kv": mem.kv_bytes,
                "reserved": mem.reserved_bytes,
                "capacity": mem.capacity_bytes,
            },
            "accepted_tokens_per_step": d.accepted_tokens_per_step,
        }
        timing = ("moe_layer_time_us", "step_time_us", "output_tokens_per_s_per_request",
                  "throughput_tokens_per_s_per_gpu", "throughput_tokens_per_s_per_node")
        if step is None:
            out.update(dict.fromkeys(timing))
            out["breakdown_us"] = None
            return out
        out["moe_layer_time_us"] = step.moe_layer_time_us
        out["step_time_us"] = step.step_time_us
        out["breakdown_us"] = dict(step.breakdown_us)
        out["exposed_comm_us"] = step.exposed_comm_us
        out["output_tokens_per_s_per_request"] = self.output_tokens_per_s_per_request
        out["throughput_tokens_per_s_per_gpu"] = self.throughput_tokens_per_s_per_gpu
        out["throughput_tokens_per_s_per_node"] = self.throughput_tokens_per_s_per_node
        return out


def _run_layers(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, schedule: Schedule, shape: BatchShape, num_layers: int
) -> tuple[Timeline, dict[str, PricedOp]]:
    """Split ``shape`` over the schedule's micro-batches, price its ops, run ``num_layers`` layers."""
    n = schedule.num_micro_batches
    sizes = [shape.requests // n + (1 if i < shape.requests % n else 0) for i in range(n)]
    costs = [price_ops(model, hw, d, replace(shape, requests=r), schedule.ops) for r in sizes]
    return run_schedule(schedule, costs, num_layers), costs[0]


def _run_ops(model: ModelConfig, hw: HardwareSpec, d: Deployment, shape: BatchShape, ops: tuple[Op, ...]) -> Timeline:
    """Ops outside the decoder layers, in order, on the whole batch."""
    return _run_layers(model, hw, d, Schedule("ops", (Stage("ops", ops),)), shape, 1)[0]


def estimate_step(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, mode: OverlapMode, shape: BatchShape | None = None
) -> StepEstimate:
    """Time one decode step (or, with a prefill ``shape``, one prefill forward) under ``mode``."""
    shape = shape or BatchShape(d.batch, d.query_len, d.kv_len)
    num_moe = len(model.moe_layer_ids)
    dense, _ = _run_layers(model, hw, d, dense_layer_schedule(shape.phase), shape,
                           model.num_hidden_layers - num_moe)
    moe, moe_ops = _run_layers(model, hw, d, moe_layer_schedule(mode, shape.phase), shape, num_moe)
    head = _run_ops(model, hw, d, shape, HEAD_OPS)
    mtp = EMPTY
    if shape.phase == "decode" and d.mtp_draft:
        draft = replace(shape, query_len=1)
        layer, _ = _run_layers(model, hw, d, moe_layer_schedule("dispatch"), draft, 1)
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


def plan_decode(model: ModelConfig, hw: HardwareSpec, d: Deployment, model_name: str = "model") -> DecodePlan:
    """Memory first (a batch beyond it is refused, not priced), then the step under the overlap
    mode; ``auto`` keeps the faster of ``dispatch`` and ``microbatch`` as the engine would."""
    check_deployment(model, hw, d)
    memory = estimate_memory(model, hw, d)
    refusal = None
    if not memory.weights_fit:
        refusal = (f"weights need {memory.weights_bytes / 2**30:.1f} GiB per GPU, more than the "
                   f"{(memory.capacity_bytes - memory.reserved_bytes) / 2**30:.1f} GiB usable")
    elif d.batch > memory.max_batch_per_gpu:
        refusal = (f"batch {d.batch} needs {memory.kv_bytes / 2**30:.1f} GiB of KV per GPU; "
                   f"at most {memory.max_batch_per_gpu} requests of {d.kv_len} tokens fit")
    if refusal:
        return DecodePlan(model_name, hw.name, d, memory, None, refusal)
    steps = [estimate_step(model, hw, d, mode) for mode in overlap_modes(d)]
    return DecodePlan(model_name, hw.name, d, memory, min(steps, key=lambda s: s.step_time_us))
