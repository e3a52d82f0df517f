"""Sweeps of end-to-end workload plans over layout and batch, the throughput-interactivity Pareto front
(output tokens/s per GPU against tokens/s per user, as public benchmarks plot it), and their text."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment, batch_per_gpu, check_deployment
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec
from epserve.planner.sweep import SWEEP_BATCHES, SWEEP_TPS, default_eps, pareto_front
from epserve.planner.workload import DEFAULT_MAX_NUM_TOKENS, ITL_PERCENTILES, WorkloadPlan, plan_workload

WORKLOAD_BATCHES = (*SWEEP_BATCHES, 384, 512, 768, 1024)


@dataclass(frozen=True)
class WorkloadRow:
    plan: WorkloadPlan
    pareto: bool  # on the frontier of all rows (tok/s per user against tok/s per GPU)

    def to_json(self) -> dict[str, Any]:
        return {**self.plan.to_json(), "pareto": self.pareto}


def workload_pareto(plans: Sequence[WorkloadPlan]) -> list[bool]:
    """True for each fitting plan no other beats on both interactivity and output per GPU."""
    return pareto_front([(p.interactivity, p.output_tokens_per_s_per_gpu) if p.fits else None for p in plans])


def sweep_workload(
    model: ModelConfig, hw: HardwareSpec, base: Deployment, input_len: int, output_len: int, *,
    eps: Iterable[int] | None = None, tps: Iterable[int] | None = None, batches: Iterable[float] | None = None,
    requests: int | None = None, max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS, model_name: str = "model",
) -> list[WorkloadRow]:
    """Every valid (EP, TP, batch) around ``base`` priced end to end; layouts the model forbids and
    batches whose decode tokens fill the budget are skipped, batches beyond memory kept (never on the front)."""
    eps, tps = list(eps or default_eps(model, base)), list(tps or SWEEP_TPS)
    plans: list[WorkloadPlan] = []
    first_error: PlanError | None = None
    for ep in eps:
        for tp in tps:
            for batch in [batch_per_gpu(requests, tp)] if requests is not None else (batches or WORKLOAD_BATCHES):
                d = replace(base, ep=ep, tp=tp, batch=batch)
                try:
                    check_deployment(model, hw, d)
                    plans.append(plan_workload(model, hw, d, input_len, output_len, max_num_tokens, model_name))
                except PlanError as e:
                    first_error = first_error or e
    if not plans:
        raise first_error or PlanError("nothing to sweep")
    return [WorkloadRow(p, f) for p, f in zip(plans, workload_pareto(plans))]


def throughput_at(rows: Iterable[WorkloadRow], interactivity: float) -> float:
    """Output tokens/s per GPU the front reaches at ``interactivity`` tokens/s per user: that of the best
    fitting plan at least that fast (the front as a staircase: no plan between two is assumed); 0 if none is."""
    return max((r.plan.output_tokens_per_s_per_gpu for r in rows
                if r.plan.fits and r.plan.interactivity >= interactivity), default=0.0)


def _row(p: WorkloadPlan) -> str:
    d = p.decode.deployment
    itl = "/".join(f"{p.itl_percentile_us(q) / 1e3:.0f}" for q in ITL_PERCENTILES)
    return (f"  {d.ep:>4}{d.tp:>4}{d.batch:>7g}{p.interactivity:>10.1f}{p.output_tokens_per_s_per_gpu:>11,.0f}"
            f"{p.decode.throughput_tokens_per_s_per_gpu:>11,.0f}{p.prefill_time_share:>8.0%}{p.ttft_us / 1e3:>9.0f}"
            f"  {itl}")


HEADER = (f"  {'EP':>4}{'TP':>4}{'batch':>7}{'tok/s/user':>10}{'tok/s/GPU':>11}{'decode-only':>11}"
          f"{'prefill':>8}{'TTFT ms':>9}  ITL p50/p90/p99 ms")


def _title(p: WorkloadPlan) -> str:
    d = p.decode.deployment
    mtp = f"MTP {d.mtp_draft} @ {d.mtp_accept:.0%}" if d.mtp_draft else "no MTP"
    return (f"{p.model_name} on {p.hardware}, colocated: {p.input_len}-token prompts, {p.output_len} output tokens, "
            f"budget {p.max_num_tokens} tokens/step, {mtp}, weights {d.weights_label}, KV {d.kv_dtype}")


def format_workload(p: WorkloadPlan) -> str:
    d = p.decode.deployment
    lines = [_title(p), f"layout EP{d.ep} = DP{d.dp} x TP{d.tp}, {d.batch:g} requests/GPU in flight, decode at KV "
             f"{d.kv_len} tokens" + ("" if p.fits else f"; DOES NOT FIT: {p.decode.fits_reason}"),
             f"decode step {p.decode_step_us / 1e3:.2f} ms ({p.decode.step.overlap}); "
             f"prefill chunk of {p.chunk_tokens} tokens per DP group adds {p.chunk_time_us / 1e3:.2f} ms "
             f"({p.chunk_overlap})",
             f"a DP group prefills {p.prefill_tokens_per_step:.0f} tokens/step: "
             f"chunks in {p.group_chunk_share:.1%} of its steps, {p.chunk_step_share:.1%} of the EP group's (DP{d.dp})"
             + ("; PREFILL-BOUND: the budget cannot keep the batch fed" if p.prefill_bound else ""),
             f"prefill {p.prefill_time_share:.1%} of GPU time; "
             f"output {p.output_tokens_per_s_per_gpu:,.0f} tok/s per GPU end to end "
             f"({p.decode.throughput_tokens_per_s_per_gpu:,.0f} decode only), {p.interactivity:.1f} tok/s per user "
             f"(TPOT {p.tpot_us / 1e3:.1f} ms), {p.tokens_per_s_per_request_with_ttft:.1f} with TTFT",
             "ITL " + ", ".join(f"p{q} {p.itl_percentile_us(q) / 1e3:.1f} ms" for q in ITL_PERCENTILES)
             + f"; TTFT {p.ttft_us / 1e3:.0f} ms (no queueing)"]
    return "\n".join(lines)


def format_workload_sweep(rows: Sequence[WorkloadRow]) -> str:
    plans = [r.plan for r in rows]
    lines = [f"{_title(plans[0])}: {len(plans)} plans, {sum(not p.fits for p in plans)} beyond memory",
             "throughput-interactivity Pareto front:", HEADER]
    front = sorted((r.plan for r in rows if r.pareto), key=lambda p: -p.interactivity)
    return "\n".join(lines + [_row(p) for p in front])
