"""Deployment planner: which EP/TP/batch gives the most throughput for a model, GPUs and speed target.

A roofline model per operation of the engine's own stage lists (``epserve.parallel.stages``), a
memory model, communication over NVLink/InfiniBand, the overlap schedule run stage by stage, and
MTP. Pure Python (numpy for the busiest-rank draws): ``plots`` imports matplotlib and ``calibrate``
imports torch, only when used.

    from epserve.planner import Deployment, load_hardware, plan_decode, resolve_model
    name, model = resolve_model("deepseek-v3")
    plan = plan_decode(model, load_hardware("h100"), Deployment(ep=128, batch=64, mtp_draft=1), name)
    plan.output_tokens_per_s_per_request, plan.throughput_tokens_per_s_per_node
    load = load_expert_load("load.json", model)  # a measured skew (LLM.expert_load().summary())
    plan_decode(model, load_hardware("h200"), Deployment(ep=32, num_redundant_experts=32, eplb=True), name, load)

Plans that do not fit in memory are priced all the same (``plan.fits``, ``plan.fits_reason``).
"""

from __future__ import annotations

from epserve.planner.deployment import Deployment, check_deployment
from epserve.planner.errors import PlanError
from epserve.planner.gpus import BUILTIN, load_hardware
from epserve.planner.hardware import HardwareSpec, save_hardware
from epserve.planner.memory import MemoryEstimate, estimate_memory, planned_kv_bytes_per_token
from epserve.planner.models import resolve_model
from epserve.planner.prefill import PrefillPlan, plan_prefill
from epserve.planner.skew import ExpertLoadFile, load_expert_load
from epserve.planner.step import DecodePlan, StepEstimate, plan_decode
from epserve.planner.sweep import SweepRow, best_plan, microbatch_crossover, sweep

__all__ = [
    "BUILTIN",
    "DecodePlan",
    "Deployment",
    "ExpertLoadFile",
    "HardwareSpec",
    "MemoryEstimate",
    "PlanError",
    "PrefillPlan",
    "StepEstimate",
    "SweepRow",
    "best_plan",
    "check_deployment",
    "estimate_memory",
    "load_expert_load",
    "load_hardware",
    "microbatch_crossover",
    "plan_decode",
    "plan_prefill",
    "planned_kv_bytes_per_token",
    "resolve_model",
    "save_hardware",
    "sweep",
]
