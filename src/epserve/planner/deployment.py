"""What is being planned: one layout, batch and precision choice, checked against model and hardware."""

from __future__ import annotations

import math
from dataclasses import dataclass

from epserve.config import MULTI_RANK_DISPATCH, OVERLAP_CHOICES, ModelConfig, OverlapSetting
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec

WEIGHT_DTYPES = ("fp8", "bf16", "fp4")
KV_DTYPES = ("bf16", "fp8")
DISPATCH_CHOICES = MULTI_RANK_DISPATCH  # the planner prices the engine's multi-rank dispatchers

# Bytes per element, block scales included: FP8 weights carry one fp32 scale per 128×128 tile and FP8
# activations one per 1×128 vector (docs/architecture.md, "Precision"); NVFP4 carries one fp8 scale
# per 16 values (and each linear an fp32 global and input scale: ``memory.PART_BYTES``).
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "fp4": 0.5 + 1 / 16}
ACT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / 128, "fp4": 0.5 + 1 / 16}
KV_BYTES = {"bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class Deployment:
    """One point of the design space. ``batch`` is requests per GPU; a DP group of ``tp`` GPUs
    serves ``batch * tp`` requests, a whole number, so ``batch`` may be a fraction (one request on TP 8
    is ``batch=1/8``). ``overlap='auto'`` is resolved per batch by the step model. ``eplb``: with a
    measured expert load, experts placed by EPLB instead of the engine's start-up placement.
    ``weight_dtype`` is the MLPs' and experts' (routed and shared); ``attention_dtype`` that of the other
    linear layers (attention's projections, the MTP layer's ``eh_proj``) where it differs: an NVFP4
    checkpoint quantizes the MLPs and leaves attention in bf16 or FP8 (None: ``weight_dtype``)."""

    ep: int
    tp: int = 1
    batch: float = 1
    kv_len: int = 5000
    mtp_draft: int = 0
    mtp_accept: float = 0.6
    overlap: OverlapSetting = "auto"
    num_redundant_experts: int = 0
    weight_dtype: str = "fp8"
    kv_dtype: str = "bf16"
    gpus_per_node: int = 8
    dispatch: str = "all_to_all"
    eplb: bool = False
    attention_dtype: str | None = None

    @property
    def attn_dtype(self) -> str:
        """The attention projections' weight dtype."""
        return self.attention_dtype or self.weight_dtype

    @property
    def weights_label(self) -> str:
        """The weight dtypes as reports name them: ``fp8``, or ``fp4 MLPs/experts, bf16 attention``."""
        if self.attn_dtype == self.weight_dtype:
            return self.weight_dtype
        return f"{self.weight_dtype} MLPs/experts, {self.attn_dtype} attention"

    @property
    def dp(self) -> int:
        return self.ep // self.tp

    @property
    def requests_per_dp_group(self) -> int:
        """Requests one DP group (one engine instance of ``tp`` GPUs) serves per step."""
        return round(self.batch * self.tp)

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.ep / self.gpus_per_node)

    @property
    def query_len(self) -> int:
        """Tokens per request per step: the next token plus the drafts being verified."""
        return 1 + self.mtp_draft

    @property
    def accepted_tokens_per_step(self) -> float:
        """Expected tokens a request gains per step: draft i survives only if drafts 1..i all do."""
        return sum(self.mtp_accept**i for i in range(self.mtp_draft + 1))


def batch_per_gpu(requests: int, tp: int) -> float:
    """``requests`` per DP group of ``tp`` GPUs as requests per GPU (an int when TP divides them)."""
    return requests // tp if requests % tp == 0 else requests / tp


def num_expert_slots(model: ModelConfig, d: Deployment) -> int:
    return model.n_routed_experts + d.num_redundant_experts


def check_deployment(model: ModelConfig, hw: HardwareSpec, d: Deployment) -> None:
    """Raise ``PlanError`` naming the first thing that makes ``d`` impossible for this model."""
    if model.n_routed_experts == 0:
        raise PlanError("the model has no routed experts; the planner prices MoE models")
    for name, value in (("EP", d.ep), ("TP", d.tp), ("kv-len", d.kv_len)):
        if value < 1:
            raise PlanError(f"{name} must be at least 1, got {value}")
    group = d.batch * d.tp
    if group < 1 - 1e-9:
        raise PlanError(f"batch must be at least 1 request per DP group, got {d.batch:g} per GPU x TP {d.tp}")
    if abs(group - round(group)) > 1e-9:
        raise PlanError(f"batch {d.batch:g} per GPU x TP {d.tp} = {group:g} requests per DP group, not a whole number")
    if d.gpus_per_node < 1:
        raise PlanError(f"gpus-per-node must be at least 1, got {d.gpus_per_node}")
    if d.num_redundant_experts < 0:
        raise PlanError(f"num-redundant-experts must be >= 0, got {d.num_redundant_experts}")
    slots = num_expert_slots(model, d)
    if slots % d.ep:
        extra = f" ({model.n_routed_experts} routed + {d.num_redundant_experts} redundant)"
        raise PlanError(f"EP {d.ep} does not divide the {slots} expert slots{extra if d.num_redundant_experts else ''}")
    if model.num_attention_heads % d.tp:
        raise PlanError(f"TP {d.tp} does not divide the {model.num_attention_heads} attention heads")
    if d.ep % d.tp:
        raise PlanError(f"TP {d.tp} does not divide EP {d.ep} (EP = DP x TP)")
    if d.tp > d.gpus_per_node:
        raise PlanError(f"TP {d.tp} spans nodes of {d.gpus_per_node} GPUs; engine instances never span nodes")
    if d.ep > d.gpus_per_node and d.ep % d.gpus_per_node:
        raise PlanError(f"EP {d.ep} does not fill whole nodes of {d.gpus_per_node} GPUs")
    if d.mtp_draft < 0:
        raise PlanError(f"mtp-draft must be >= 0, got {d.mtp_draft}")
    if d.mtp_draft and model.num_nextn_predict_layers == 0:
        raise PlanError("mtp-draft > 0 but the model has no MTP layer (num_nextn_predict_layers = 0)")
    if not 0.0 <= d.mtp_accept <= 1.0:
        raise PlanError(f"mtp-accept must be in [0, 1], got {d.mtp_accept}")
    if d.dispatch not in DISPATCH_CHOICES:
        raise PlanError(f"unknown dispatch {d.dispatch!r}; expected one of {', '.join(DISPATCH_CHOICES)}")
    if d.overlap not in OVERLAP_CHOICES:
        raise PlanError(f"unknown overlap {d.overlap!r}; expected one of {', '.join(OVERLAP_CHOICES)}")
    for what, dtype in (("weight", d.weight_dtype), ("attention weight", d.attn_dtype)):
        if dtype not in WEIGHT_DTYPES:
            raise PlanError(f"unknown {what} dtype {dtype!r}; expected one of {', '.join(WEIGHT_DTYPES)}")
    if d.kv_dtype not in KV_DTYPES:
        raise PlanError(f"unknown KV dtype {d.kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}")
    hw.flops_for(d.weight_dtype)
    hw.flops_for(d.attn_dtype)
