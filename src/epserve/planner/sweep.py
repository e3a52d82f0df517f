"""Sweeps over EP x TP x batch, Pareto frontiers, the best plan for a speed target, and the batch
from which two micro-batches beat dispatch overlap."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment, batch_per_gpu, check_deployment, num_expert_slots
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec
from epserve.planner.skew import ExpertLoadFile
from epserve.planner.step import DecodePlan, estimate_step, plan_decode

SWEEP_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SWEEP_TPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class SweepRow:
    plan: DecodePlan
    pareto: bool  # on the frontier of its EP (speed per request vs throughput per node)
    pareto_global: bool  # on the frontier of all rows

    def to_json(self, slo_speed: float | None = None) -> dict[str, Any]:
        out = self.plan.to_json()
        out["pareto"] = self.pareto
        out["pareto_global"] = self.pareto_global
        if slo_speed is not None:
            out["meets_slo"] = self.plan.fits and self.plan.output_tokens_per_s_per_request >= slo_speed
        return out


def default_eps(model: ModelConfig, d: Deployment) -> tuple[int, ...]:
    """One node of 8 up to 128 GPUs (powers of two dividing the expert slots); smaller for small models."""
    slots = num_expert_slots(model, d)
    wide = tuple(e for e in (8, 16, 32, 64, 128) if slots % e == 0)
    return wide or tuple(e for e in (1, 2, 4, 8) if e <= slots and slots % e == 0)


def pareto_front(points: Sequence[tuple[float, float] | None]) -> list[bool]:
    """True for each point ``(speed, throughput)`` no other point beats on both; ``None`` (a plan that
    does not fit) is never on the front."""
    flags = [False] * len(points)
    best = -1.0
    for _, neg_throughput, i in sorted((-p[0], -p[1], i) for i, p in enumerate(points) if p is not None):
        if -neg_throughput > best:
            flags[i], best = True, -neg_throughput
    return flags


def pareto_flags(plans: Sequence[DecodePlan]) -> list[bool]:
    """True for each fitting plan no other plan beats on both speed per request and node throughput."""
    return pareto_front([(p.output_tokens_per_s_per_request, p.throughput_tokens_per_s_per_node) if p.fits else None
                         for p in plans])


def sweep(
    model: ModelConfig,
    hw: HardwareSpec,
    base: Deployment,
    *,
    eps: Iterable[int] | None = None,
    tps: Iterable[int] | None = None,
    batches: Iterable[float] | None = None,
    requests: int | None = None,
    model_name: str = "model",
    load: ExpertLoadFile | None = None,
) -> list[SweepRow]:
    """Every valid (EP, TP, batch) around ``base``; combinations the layout forbids are skipped,
    batches beyond memory are kept, priced, as rows that do not fit (never on a frontier).
    ``requests``: instead of batches per GPU, this many requests per DP group at every TP.
    ``load``: a measured expert load priced at every point (placed as ``base.eplb`` says)."""
    eps, tps, batches = list(eps or default_eps(model, base)), list(tps or SWEEP_TPS), list(batches or SWEEP_BATCHES)
    plans: list[DecodePlan] = []
    first_error: PlanError | None = None
    for ep in eps:
        for tp in tps:
            for batch in [batch_per_gpu(requests, tp)] if requests is not None else batches:
                d = replace(base, ep=ep, tp=tp, batch=batch)
                try:
                    check_deployment(model, hw, d)
                except PlanError as e:
                    first_error = first_error or e
                    continue
                plans.append(plan_decode(model, hw, d, model_name, load))
    if not plans:
        raise first_error or PlanError("nothing to sweep")
    per_ep = [False] * len(plans)
    for ep in {p.deployment.ep for p in plans}:
        idx = [i for i, p in enumerate(plans) if p.deployment.ep == ep]
        for i, flag in zip(idx, pareto_flags([plans[i] for i in idx])):
            per_ep[i] = flag
    return [SweepRow(p, a, b) for p, a, b in zip(plans, per_ep, pareto_flags(plans))]


def best_plan(rows: Iterable[SweepRow], min_speed: float, ep: int | None = None) -> DecodePlan | None:
    """Highest throughput per node among plans at least ``min_speed`` tokens/s per request."""
    ok = [r.plan for r in rows
          if r.plan.fits and r.plan.output_tokens_per_s_per_request >= min_speed
          and (ep is None or r.plan.deployment.ep == ep)]
    return max(ok, key=lambda p: p.throughput_tokens_per_s_per_node, default=None)


def microbatch_crossover(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, max_batch: int = 256, load: ExpertLoadFile | None = None
) -> int | None:
    """Smallest batch per GPU from which two micro-batches are faster than dispatch overlap for
    every larger batch up to ``max_batch`` (memory not applied); None if they never are."""
    check_deployment(model, hw, d)
    crossover = None
    for batch in range(max_batch, 0, -1):
        d_b = replace(d, batch=batch)
        micro = estimate_step(model, hw, d_b, "microbatch", load=load).step_time_us
        if micro >= estimate_step(model, hw, d_b, "dispatch", load=load).step_time_us:
            break
        crossover = batch
    return crossover
