"""Human-readable text for plans and sweeps (JSON comes from the dataclasses' ``to_json``)."""

from __future__ import annotations

from collections.abc import Sequence

from epserve.planner.disagg import DisaggPlan, PrefillInstance
from epserve.planner.memory import MemoryEstimate
from epserve.planner.prefill import PrefillPlan
from epserve.planner.step import BREAKDOWN_KEYS, DecodePlan
from epserve.planner.sweep import SweepRow, best_plan

GIB = 2**30


def _memory(mem: MemoryEstimate) -> str:
    return (f"memory per GPU: weights {mem.weights_bytes / GIB:.1f} GiB + KV {mem.kv_bytes / GIB:.1f} GiB "
            f"(+ {mem.reserved_bytes / GIB:.1f} GiB reserved) of {mem.capacity_bytes / GIB:.1f} GiB")


def _layout(plan: DecodePlan) -> str:
    d = plan.deployment
    nodes = f"{d.num_nodes} node{'s' if d.num_nodes > 1 else ''}"
    mtp = f"MTP {d.mtp_draft} draft @ {d.mtp_accept:.0%}" if d.mtp_draft else "no MTP"
    group = f" ({d.requests_per_dp_group} per DP group)" if d.tp > 1 else ""
    return (f"{plan.model_name} on {d.ep} x {plan.hardware} ({nodes}): EP{d.ep} = DP{d.dp} x TP{d.tp}, "
            f"{d.batch:g} requests/GPU{group}, KV {d.kv_len} tokens ({d.kv_dtype}), weights {d.weights_label}, {mtp}")


def _placement_lines(placements: dict[str, DecodePlan], plan: DecodePlan) -> list[str]:
    """The plan under uniform routing, the engine's start-up placement and EPLB, side by side."""
    report = plan.expert_load
    assert report is not None
    lines = [f"expert load {report.file} ({len(report.layer_imbalance)} MoE layers, "
             f"{plan.deployment.num_redundant_experts} redundant experts): "
             "busiest EP rank / mean, mean (max) over layers"]
    names = {"uniform": "uniform routing", "without_eplb": "start-up placement", "with_eplb": "EPLB"}
    for key, p in placements.items():
        r = p.expert_load
        skew = f"{r.imbalance:.2f} ({max(r.layer_imbalance):.2f})" if r else "1"
        mark = "  <- this plan" if p is plan else ""
        lines.append(f"  {names[key]:<20}{skew:<14}step {p.step.step_time_us / 1e3:.2f} ms, "
                     f"{p.output_tokens_per_s_per_request:.1f} tok/s per request, "
                     f"{p.throughput_tokens_per_s_per_node:,.0f} tok/s per node{mark}")
    return lines


def format_plan(plan: DecodePlan, crossover: int | None = None, prefill: PrefillPlan | None = None,
                placements: dict[str, DecodePlan] | None = None) -> str:
    mem, d = plan.memory, plan.deployment
    lines = [
        _layout(plan),
        f"{_memory(mem)}; KV {mem.kv_bytes_per_token:,} B/token; max batch {mem.max_batch_per_gpu}/GPU",
    ]
    if not plan.fits:
        lines.append(f"DOES NOT FIT: {plan.fits_reason} (priced all the same)")
    step = plan.step
    lines += [
        f"step {step.step_time_us / 1e3:.2f} ms (overlap {step.overlap}): MoE layer {step.moe_layer_time_us:.0f} us, "
        f"dense layer {step.dense_layer_time_us:.0f} us, head {step.head_time_us:.0f} us, "
        f"MTP drafts {step.mtp_time_us:.0f} us",
        "breakdown: " + " | ".join(f"{k} {step.breakdown_us[k] / 1e3:.2f}" for k in BREAKDOWN_KEYS)
        + f" ms (exposed communication {step.exposed_comm_us / 1e3:.2f} ms)",
        f"output: {plan.output_tokens_per_s_per_request:.1f} tok/s per request "
        f"({d.accepted_tokens_per_step:.2f} tokens/step), {plan.throughput_tokens_per_s_per_gpu:,.0f} tok/s per GPU, "
        f"{plan.throughput_tokens_per_s_per_node:,.0f} tok/s per node",
    ]
    if placements is not None:
        lines += _placement_lines(placements, plan)
    if crossover is not None:
        lines.append(f"two micro-batches beat dispatch overlap from batch {crossover}/GPU at this EP/TP")
    else:
        lines.append("two micro-batches never beat dispatch overlap at this EP/TP (batch <= 256)")
    if prefill is not None:
        lines.append(f"prefill: {prefill.prompts_per_gpu} x {prefill.prompt_len}-token prompts per GPU -> "
                     f"{prefill.tokens_per_s_per_gpu:,.0f} tok/s per GPU ({prefill.step.overlap})")
    lines.append("one MoE layer, per op (first micro-batch):")
    lines.append(f"  {'op':<20}{'kind':<12}{'us':>9}  {'bound':<9}{'GFLOP':>9}{'MB':>10}")
    for op in step.moe_ops.values():
        if op.bound == "skipped":
            continue
        wire = f"  + transfer {op.transfer.time_us:.0f} us" if op.transfer.time_us else ""
        lines.append(f"  {op.name:<20}{op.kind:<12}{op.compute_us:>9.1f}  {op.bound:<9}"
                     f"{op.flops / 1e9:>9.2f}{op.bytes / 1e6:>10.2f}{wire}")
    return "\n".join(lines)


def _sweep_line(p: DecodePlan) -> str:
    q, step = p.deployment, p.step
    return (f"  {q.ep:>4}{q.tp:>4}{q.dp:>5}{q.batch:>7g}  {step.overlap:<11}"
            f"{p.output_tokens_per_s_per_request:>10.1f}{p.throughput_tokens_per_s_per_gpu:>11,.0f}"
            f"{p.throughput_tokens_per_s_per_node:>12,.0f}{step.step_time_us / 1e3:>9.2f}")


def format_sweep(rows: Sequence[SweepRow], slo_speed: float | None = None) -> str:
    plans = [r.plan for r in rows]
    first = plans[0]
    d = first.deployment
    refused = sum(not p.fits for p in plans)
    mtp = f"MTP {d.mtp_draft} @ {d.mtp_accept:.0%}" if d.mtp_draft else "no MTP"
    load = first.expert_load
    if load is not None:
        mtp += f", expert load {load.file} ({'EPLB' if load.eplb else 'start-up placement'})"
    lines = [f"{first.model_name} on {first.hardware}, KV {d.kv_len} tokens, {mtp}, weights {d.weights_label}: "
             f"{len(plans)} plans, {refused} beyond memory",
             "Pareto frontier of each EP:",
             f"  {'EP':>4}{'TP':>4}{'DP':>5}{'batch':>7}  {'overlap':<11}{'tok/s/req':>10}{'tok/s/GPU':>11}"
             f"{'tok/s/node':>12}{'step ms':>9}"]
    for ep in sorted({p.deployment.ep for p in plans}):
        front = sorted((r.plan for r in rows if r.pareto and r.plan.deployment.ep == ep),
                       key=lambda p: -p.output_tokens_per_s_per_request)
        lines += [_sweep_line(p) for p in front]
    if slo_speed is not None:
        best = best_plan(rows, slo_speed)
        if best is None:
            lines.append(f"no plan reaches {slo_speed:g} tok/s per request")
        else:
            q = best.deployment
            lines.append(f"best at >= {slo_speed:g} tok/s per request: EP{q.ep} TP{q.tp} batch {q.batch:g}: "
                         f"{best.output_tokens_per_s_per_request:.1f} tok/s, "
                         f"{best.throughput_tokens_per_s_per_node:,.0f} tok/s per node")
            per_ep = []
            for ep in sorted({p.deployment.ep for p in plans}):
                b = best_plan(rows, slo_speed, ep)
                per_ep.append(f"EP{ep} {b.throughput_tokens_per_s_per_node:,.0f}" if b else f"EP{ep} -")
            lines.append("  per EP (tok/s per node): " + " | ".join(per_ep))
    return "\n".join(lines)


def _instance(ep: int, tp: int, nodes: int) -> str:
    return f"EP{ep} = DP{ep // tp} x TP{tp} ({nodes} node{'s' if nodes > 1 else ''})"


def _prefill_lines(p: PrefillInstance) -> list[str]:
    d, m = p.deployment, p.memory
    mtp = f" + MTP layer {p.mtp_layer_time_us / 1e3:.1f} ms" if p.mtp_layer_time_us else ""
    lines = [f"prefill instance: {_instance(d.ep, d.tp, d.num_nodes)}, {p.plan.prompts_per_gpu} x "
             f"{p.plan.prompt_len}-token prompts per GPU in {p.prompt_time_us / 1e3:.1f} ms "
             f"({p.plan.step.overlap}{mtp}): "
             f"{p.tokens_per_s_per_gpu:,.0f} tok/s per GPU, {p.tokens_per_s_per_instance:,.0f} tok/s per instance, "
             f"{p.requests_per_s_per_instance:.2f} prompts/s",
             f"  {_memory(m)}"]
    if not p.fits:
        lines.append(f"  DOES NOT FIT: {p.fits_reason} (priced all the same)")
    return lines


def format_disaggregated(plan: DisaggPlan, slo_speed: float | None = None) -> str:
    dec, d, t = plan.decode, plan.decode.deployment, plan.transfer
    m = dec.memory
    mtp = f"MTP {d.mtp_draft} draft @ {d.mtp_accept:.0%}" if d.mtp_draft else "no MTP"
    kv_source = "--kv-len" if plan.kv_len_given else "input + output/2"
    p_count, d_count = plan.pair
    busy = plan.colocated_busy_fraction
    lines = [f"{plan.model_name} on {plan.hardware}, disaggregated: {plan.input_len}-token prompts, "
             f"{plan.output_len} output tokens per request, {mtp}, weights {d.weights_label}, KV {d.kv_dtype}",
             *_prefill_lines(plan.prefill),
             f"decode instance: {_instance(d.ep, d.tp, d.num_nodes)}, {d.batch:g} requests/GPU, KV {d.kv_len} tokens "
             f"({kv_source}): step {dec.step.step_time_us / 1e3:.2f} ms ({dec.step.overlap}), "
             f"{dec.output_tokens_per_s_per_request:.1f} tok/s per request, {dec.throughput_tokens_per_s_per_gpu:,.0f} "
             f"tok/s per GPU, {plan.decode_tokens_per_s_per_instance:,.0f} tok/s per instance, "
             f"{plan.decode_requests_per_s_per_instance:.2f} requests/s",
             f"  {_memory(m)}"]
    if not dec.fits:
        lines.append(f"  DOES NOT FIT: {dec.fits_reason} (priced all the same)")
    copies = f", {t.copies} copies (decode TP)" if t.copies > 1 else ""
    lines += [
        f"KV transfer: {t.bytes_per_token:,} B/token ({t.layers} layers x {t.kv_dim} x {t.dtype_bytes} B) x "
        f"{t.input_len} = {t.bytes_per_request / 1e6:.1f} MB per request over InfiniBand "
        f"({t.bandwidth / 1e9:.0f} GB/s achievable per GPU + {t.latency_us:.0f} us{copies}): "
        f"{t.time_us / 1e3:.1f} ms; {plan.nic_share_prefill:.1%} of a prefill GPU's NIC, "
        f"{plan.nic_share_decode:.1%} of a decode GPU's",
        f"TTFT: {plan.prefill.prompt_time_us / 1e3:.1f} ms prefill + {t.time_us / 1e3:.1f} ms transfer = "
        f"{plan.ttft_us / 1e3:.1f} ms (no queueing, transfer after the prefill)",
        f"ratio: {plan.prefill_per_decode:.3f} prefill instances per decode instance -> {p_count} prefill : "
        f"{d_count} decode instances, {plan.gpus} GPUs, {plan.output_tokens_per_s:,.0f} output tok/s, "
        f"{plan.output_tokens_per_s_per_gpu:,.0f} tok/s per GPU (prefill {plan.prefill_utilization:.0%} busy)",
        f"colocated (the decode instance runs the prefills too, each stalling it for "
        f"{plan.colocated_prefill.prompt_time_us / 1e3:.1f} ms): prefill {busy:.1%} of the time -> "
        f"{plan.colocated_tokens_per_s_per_gpu:,.0f} tok/s per GPU, "
        f"{dec.output_tokens_per_s_per_request * (1 - busy):.1f} tok/s per request",
        f"disaggregated / colocated output per GPU: {plan.disaggregation_gain:.2f}x "
        f"({'disaggregation pays' if plan.disaggregation_gain > 1 else 'colocated is as good or better'})",
    ]
    if slo_speed is not None:
        ok = plan.fits and dec.output_tokens_per_s_per_request >= slo_speed
        lines.append(f"decode {'meets' if ok else 'misses'} {slo_speed:g} tok/s per request")
    if not plan.fits:
        lines.append(f"DOES NOT FIT: {plan.fits_reason}")
    return "\n".join(lines)
