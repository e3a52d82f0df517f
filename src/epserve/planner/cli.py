"""``epserve plan``: price a deployment, sweep EP x TP x batch, plot, or calibrate this device.

The lead's ``epserve.cli`` calls ``add_parser(subparsers)`` and dispatches to ``run(args)``;
``python -m epserve.planner.cli plan ...`` does the same on its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from epserve.config import ConfigError
from epserve.planner.cli_workload import run_workload, wants_workload
from epserve.planner.deployment import (
    DISPATCH_CHOICES,
    KV_DTYPES,
    OVERLAP_CHOICES,
    WEIGHT_DTYPES,
    Deployment,
    batch_per_gpu,
)
from epserve.planner.disagg import DEFAULT_OUTPUT_LEN, decode_kv_len, default_prefill_ep, plan_disaggregated
from epserve.planner.errors import PlanError
from epserve.planner.gpus import GPU_CHOICES, load_hardware
from epserve.planner.hardware import DEFAULT_LOCAL_FILE, save_hardware
from epserve.planner.models import resolve_model
from epserve.planner.prefill import plan_prefill
from epserve.planner.report import format_disaggregated, format_plan, format_sweep
from epserve.planner.skew import ExpertLoadFile, load_expert_load
from epserve.planner.step import DecodePlan, plan_decode
from epserve.planner.stored import StoredWeights, checkpoint_dir, compare, format_compare, read_stored
from epserve.planner.sweep import best_plan, default_eps, microbatch_crossover, sweep

BUSY_FLOOR_US = 500.0  # a kernel floor above this is a measurement taken on a busy machine
DEFAULT_KV_LEN = 5000
DEFAULT_PROMPT_LEN = 4096
DISAGG_ONLY = ("prefill_ep", "prefill_tp", "decode_ep", "decode_tp")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_parser(subparsers: Any) -> None:
    """Register ``plan`` (and its ``calibrate`` action) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "plan", help="predict throughput and latency of a deployment before buying the GPUs",
        description="Price a deployment of an MoE model (EP/TP/batch) with a roofline model, sweep the "
        "design space, or calibrate this device (`epserve plan calibrate`). A plan that does not fit in memory "
        "is priced all the same (fits: false, fits_reason) and exits 1; bad input exits 2.")
    p.add_argument("--model", default="deepseek-v3", help="config.json, checkpoint directory or 'deepseek-v3'")
    p.add_argument("--gpu", default="h200", help=f"{'|'.join(GPU_CHOICES)} or a hardware JSON file")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per NVLink domain (default 8; 72 for gb200)")
    p.add_argument("--ep", type=int, help="expert-parallel size = DP x TP (fixed in a sweep if given)")
    p.add_argument("--tp", type=int, help="tensor-parallel size inside a DP group")
    batch = p.add_mutually_exclusive_group()
    batch.add_argument("--batch", type=int, help="requests per GPU (default 32; a DP group serves batch x TP)")
    batch.add_argument("--requests", type=int, metavar="N",
                       help="requests per DP group (one engine instance of TP GPUs) instead of --batch: "
                            "--tp 8 --requests 1 is one request on 8 GPUs (batch 1/8 per GPU)")
    p.add_argument("--kv-len", type=int, help="KV length per request (default 5000; with --disaggregated "
                                              "--input-len + --output-len / 2)")
    p.add_argument("--mtp-draft", type=int, help="MTP draft tokens per step (default 1 if the model has MTP)")
    p.add_argument("--mtp-accept", type=float, default=None,
                   help="acceptance rate per draft token (default: the --gpu file's measured figure, else 0.6)")
    p.add_argument("--overlap", choices=OVERLAP_CHOICES, default="auto",
                   help="communication overlap; auto = the faster of dispatch and microbatch")
    p.add_argument("--dispatch", choices=DISPATCH_CHOICES, default="all_to_all",
                   help="dispatcher backend: all_to_all (exact rows) or padded (fixed buffers)")
    p.add_argument("--num-redundant-experts", type=int, default=0,
                   help="extra expert slots (EP divides the slots); with --expert-load, where EPLB puts replicas")
    p.add_argument("--expert-load", metavar="FILE",
                   help="JSON of LLM.expert_load().summary() or the server's statistics "
                        "({\"per_expert\": [[tokens per expert] per MoE layer]}, or {\"instances\": [...]}): "
                        "price routing with this skew instead of uniform; the output compares uniform routing, "
                        "the engine's start-up placement and EPLB")
    p.add_argument("--eplb", action="store_true",
                   help="with --expert-load: price the plan with EPLB's placement (experts + "
                        "--num-redundant-experts slots) instead of the engine's start-up placement")
    p.add_argument("--weight-dtype", choices=WEIGHT_DTYPES,
                   help="the MLPs' and experts' weights (default: fp4 for an NVFP4 checkpoint, else fp8)")
    p.add_argument("--attention-dtype", choices=WEIGHT_DTYPES,
                   help="attention's weights (default: an NVFP4 checkpoint's stored dtype, else --weight-dtype)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16")
    p.add_argument("--prompt-len", type=int, help="prompt length for the prefill estimate (default 4096)")
    p.add_argument("--sweep", action="store_true", help="sweep EP x TP x batch 1..256 (given axes stay fixed)")
    p.add_argument("--slo-speed", type=float, help="output tokens/s per request to meet")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write figures (sweep: Pareto, -roofline, -prefill)")
    g = p.add_argument_group("disaggregated prefill and decode (--disaggregated)")
    g.add_argument("--disaggregated", action="store_true",
                   help="price prefill instances and decode instances separately, the KV transfer between "
                        "them, how many prefill instances a decode instance needs, and colocated serving")
    g.add_argument("--prefill-ep", type=_positive, help="prefill instance's EP (default: the smallest that fits)")
    g.add_argument("--prefill-tp", type=_positive, help="prefill instance's TP (default 1)")
    g.add_argument("--decode-ep", type=_positive, help="decode instance's EP (default --ep)")
    g.add_argument("--decode-tp", type=_positive, help="decode instance's TP (default --tp)")
    g.add_argument("--input-len", type=_positive, help="prompt tokens per request (default --prompt-len); without "
                   "--disaggregated: price the workload end to end, prefill colocated with decode")
    g.add_argument("--output-len", type=_positive,
                   help=f"mean output tokens per request (default {DEFAULT_OUTPUT_LEN})")
    g.add_argument("--max-num-tokens", type=_positive,
                   help="end to end: the scheduler's token budget per step and DP group (default 8192)")
    actions = p.add_subparsers(dest="plan_action", metavar="{calibrate}")
    c = actions.add_parser("calibrate", help="measure kernels on this device and write a hardware file")
    c.add_argument("--quick", action="store_true", help="few shapes, short timings (seconds)")
    c.add_argument("--out", default=str(DEFAULT_LOCAL_FILE), help=f"output file (default {DEFAULT_LOCAL_FILE})")
    c.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda if available")
    c.add_argument("--world-size", type=int, default=2, help="processes for the all-to-all (0: skip)")
    c.add_argument("--ranks", type=int, default=1,
                   help="CPU: describe one of this many engine rank processes on this host (calibrated "
                        "concurrently, cores/ranks threads each, collectives timed between computing ranks)")
    c.add_argument("--no-pin", action="store_true",
                   help="--ranks: leave the processes unpinned (as the engine with EPSERVE_PIN=0); by default "
                        "each is pinned to its rank's cores, as the engine pins its CPU ranks")
    c.add_argument("--base", help="datasheet entry to express fractions against (default: by device name)")
    c.add_argument("--no-engine", action="store_true",
                   help="skip timing the engine's own steps (host overheads stay the base entry's)")
    c.add_argument("--mtp-model", default=None,
                   help="a checkpoint with an MTP layer: measure its draft acceptance on this engine (greedy, one "
                        "draft token) and record it as the planner's default --mtp-accept")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "plan_action", None) == "calibrate":
            return _calibrate(args)
        return _plan(args)
    except (PlanError, ConfigError) as e:
        print(f"epserve plan: error: {e}", file=sys.stderr)
        return 2


def _calibrate(args: argparse.Namespace) -> int:
    from epserve.planner.calibrate import calibrate, calibrate_ranks  # imports torch

    base = load_hardware(args.base) if args.base else None
    if args.ranks > 1:
        if args.device == "cuda":
            raise PlanError("--ranks describes CPU rank processes sharing one host; on CUDA each rank has its GPU")
        spec = calibrate_ranks(args.ranks, quick=args.quick, base=base, engine=not args.no_engine,
                               pin=False if args.no_pin else None)
    else:
        spec = calibrate(quick=args.quick, device=args.device, world_size=args.world_size, base=base,
                         engine=not args.no_engine)
    if args.mtp_model:
        import torch

        from epserve.planner.calibrate_engine import measure_mtp_acceptance

        stats = measure_mtp_acceptance(args.mtp_model, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        spec = replace(spec, mtp_accept=round(float(stats["acceptance_rate"]), 4))  # type: ignore[arg-type]
        print(f"MTP acceptance of {args.mtp_model}: {spec.mtp_accept:.3f} over {stats['num_draft_tokens']} drafts")
    path = save_hardware(spec, args.out)
    fr = ", ".join(f"{k} {e.compute:.0%}/{e.memory:.0%}" for k, e in spec.efficiency.items())
    bw = "; ".join(f"{k} {size / 2**20:.3g} MiB " + " ".join(f"{r:.3g}:{f * spec.memory_bandwidth / 1e9:.0f}"
                                                             for r, s, f in curve if s == size)
                   for k, curve in spec.memory_by_rows.items() for size in sorted({s for _, s, _ in curve}))
    print(f"wrote {path}: {spec.name}, {spec.flops_for('bf16') / 1e12:.3g} TFLOP/s, "
          f"{spec.memory_bandwidth / 1e9:.0f} GB/s; achievable compute/memory {fr}; "
          f"GB/s by rows: {bw}; kernel floor {spec.kernel_latency_us:.1f} us, op overhead "
          f"{spec.op_overhead_us:.1f} us + {spec.op_overhead_per_token_us:.2f} us/token, "
          f"step overhead {spec.step_overhead_us:.0f} us, "
          f"in-step streaming efficiency {spec.stream_efficiency:.2f}, all-to-all latency "
          f"{spec.nvlink_latency_us:.0f} us, count exchange {spec.dispatch_handshake_us:.0f} us, step all-reduce "
          f"{spec.step_sync_us:.0f} us; use it with --gpu {path}")
    if spec.kernel_latency_us > BUSY_FLOOR_US:
        print(f"warning: a {spec.kernel_latency_us:.0f} us kernel floor means another process was competing for "
              "the cores (threads waiting a scheduler tick); calibrate again on a quiet machine", file=sys.stderr)
    return 0


def _deployment(args: argparse.Namespace, model: Any, hw: Any) -> Deployment:
    mtp = args.mtp_draft if args.mtp_draft is not None else (1 if model.num_nextn_predict_layers else 0)
    accept = args.mtp_accept if args.mtp_accept is not None else (hw.mtp_accept if hw.mtp_accept is not None else 0.6)
    if args.requests is not None and args.requests < 1:
        raise PlanError(f"--requests must be at least 1 (requests per DP group), got {args.requests}")
    if args.eplb and not args.expert_load:
        raise PlanError("--eplb places experts by a measured load: give it with --expert-load FILE")
    kv_len = DEFAULT_KV_LEN if args.kv_len is None else args.kv_len
    base = Deployment(ep=1, kv_len=kv_len, mtp_draft=mtp, mtp_accept=accept, overlap=args.overlap,
                      num_redundant_experts=args.num_redundant_experts, weight_dtype=args.weight_dtype or "fp8",
                      attention_dtype=args.attention_dtype, dispatch=args.dispatch, kv_dtype=args.kv_dtype,
                      gpus_per_node=args.gpus_per_node or hw.gpus_per_node, eplb=args.eplb)
    tp = 1 if args.tp is None else args.tp
    batch: float = 32 if args.batch is None else args.batch
    if args.requests is not None:
        batch = batch_per_gpu(args.requests, tp)
    return replace(base, ep=default_eps(model, base)[0] if args.ep is None else args.ep, tp=tp, batch=batch)


def _stored_weights(args: argparse.Namespace, model: Any) -> StoredWeights | None:
    """An NVFP4 model's weight dtypes where the command line leaves them out: its MLPs and experts in the
    format its checkpoint stores them (fp4), attention in its stored dtype (bf16 where only a config.json
    is given: ModelOpt leaves it unquantized); the checkpoint's stored bytes, when ``--model`` is its directory."""
    if not model.is_nvfp4:
        return None
    folder = checkpoint_dir(args.model)
    stored = read_stored(folder, model) if folder is not None else None
    args.weight_dtype = args.weight_dtype or (stored and stored.ffn_dtype) or "fp4"
    args.attention_dtype = args.attention_dtype or (stored and stored.attention_dtype) or "bf16"
    return stored


def _emit(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout)


def _placements(model: Any, hw: Any, plan: DecodePlan, load: ExpertLoadFile) -> dict[str, DecodePlan]:
    """The plan under uniform routing, the engine's start-up placement and EPLB (one of them is ``plan``)."""
    d, name = plan.deployment, plan.model_name
    other = plan_decode(model, hw, replace(d, eplb=not d.eplb), name, load)
    return {"uniform": plan_decode(model, hw, replace(d, eplb=False), name),
            "without_eplb": other if d.eplb else plan, "with_eplb": plan if d.eplb else other}


def _load_json(placements: dict[str, DecodePlan], num_moe: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model_moe_layers": num_moe}
    for key in ("without_eplb", "with_eplb"):
        report = placements[key].expert_load
        assert report is not None
        out[f"imbalance_{key}"] = report.imbalance
        out[f"max_layer_imbalance_{key}"] = max(report.layer_imbalance)
        out[f"layer_imbalance_{key}"] = list(report.layer_imbalance)
    out.update({key: p.timings() for key, p in placements.items()})
    return out


def _check_disaggregated(args: argparse.Namespace) -> None:
    given = [f"--{k.replace('_', '-')}" for k in DISAGG_ONLY if getattr(args, k) is not None]
    if args.disaggregated and args.max_num_tokens is not None:
        raise PlanError("--max-num-tokens prices colocated serving: not with --disaggregated")
    if not args.disaggregated:
        if given:
            raise PlanError(f"{', '.join(given)} only appl{'y' if len(given) > 1 else 'ies'} with --disaggregated")
        return
    for flag, value in (("--sweep", args.sweep), ("--expert-load", args.expert_load), ("--eplb", args.eplb),
                        ("--plot", args.plot)):
        if value:
            raise PlanError(f"{flag} is not priced with --disaggregated")
    for flag, value, other_flag, other in (("--decode-ep", args.decode_ep, "--ep", args.ep),
                                           ("--decode-tp", args.decode_tp, "--tp", args.tp),
                                           ("--input-len", args.input_len, "--prompt-len", args.prompt_len)):
        if value is not None and other is not None and value != other:
            raise PlanError(f"{flag} {value} and {other_flag} {other} disagree: give one of them")


def _disaggregated(args: argparse.Namespace, name: str, model: Any, hw: Any) -> int:
    input_len = args.input_len or (DEFAULT_PROMPT_LEN if args.prompt_len is None else args.prompt_len)
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    kv_len = decode_kv_len(input_len, output_len) if args.kv_len is None else args.kv_len
    decode = _deployment(argparse.Namespace(**{**vars(args), "ep": args.decode_ep or args.ep,
                                               "tp": args.decode_tp or args.tp, "kv_len": kv_len}), model, hw)
    base = replace(decode, tp=args.prefill_tp or 1)
    prefill = replace(base, ep=args.prefill_ep or default_prefill_ep(model, hw, base, input_len))
    plan = plan_disaggregated(model, hw, prefill, decode, input_len, output_len, name, args.kv_len is not None)
    if args.json:
        out = plan.to_json()
        if args.slo_speed is not None:
            out["meets_slo"] = plan.fits and plan.decode.output_tokens_per_s_per_request >= args.slo_speed
        print(json.dumps(out, indent=1))
    else:
        print(format_disaggregated(plan, args.slo_speed))
    return 0 if plan.fits else 1


def _plan(args: argparse.Namespace) -> int:
    _check_disaggregated(args)
    name, model = resolve_model(args.model)
    hw = load_hardware(args.gpu)
    stored = _stored_weights(args, model)
    if args.disaggregated:
        return _disaggregated(args, name, model, hw)
    d = _deployment(args, model, hw)
    if wants_workload(args):
        return run_workload(args, name, model, hw, d, DEFAULT_PROMPT_LEN)
    load = load_expert_load(args.expert_load, model) if args.expert_load else None
    if args.sweep:
        return _sweep(args, name, model, hw, d, load)
    plan = plan_decode(model, hw, d, name, load)
    placements = _placements(model, hw, plan, load) if load is not None else None
    crossover = microbatch_crossover(model, hw, d, load=load)
    try:
        prefill = plan_prefill(model, hw, d, DEFAULT_PROMPT_LEN if args.prompt_len is None else args.prompt_len)
    except PlanError:
        prefill = None
    if args.json:
        out = plan.to_json()
        if placements is not None:
            out["expert_load"].update(_load_json(placements, len(model.moe_layer_ids)))
        out["microbatch_crossover_batch"] = crossover
        out["prefill"] = prefill and {"prompt_len": prefill.prompt_len, "prompts_per_gpu": prefill.prompts_per_gpu,
                                      "tokens_per_s_per_gpu": prefill.tokens_per_s_per_gpu}
        if args.slo_speed is not None:
            out["meets_slo"] = plan.fits and plan.output_tokens_per_s_per_request >= args.slo_speed
        if stored is not None:
            out["checkpoint"] = compare(stored, model, d)
        print(json.dumps(out, indent=1))
    else:
        print(format_plan(plan, crossover, prefill, placements))
        if stored is not None:
            print(format_compare(compare(stored, model, d)))
    if args.plot:
        from epserve.planner.plots import plot_roofline

        eps = sorted({d.ep, *(e for e in (8, 32, 128) if model.n_routed_experts % e == 0)})
        _emit(args, f"wrote {plot_roofline(model, hw, d, args.plot, eps)}")
    return 0 if plan.fits else 1


def _sweep(args: argparse.Namespace, name: str, model: Any, hw: Any, d: Deployment, load: ExpertLoadFile | None) -> int:
    def fixed(value: int | None) -> list[int] | None:
        return None if value is None else [value]

    rows = sweep(model, hw, d, eps=fixed(args.ep), tps=fixed(args.tp), batches=fixed(args.batch),
                 requests=args.requests, model_name=name, load=load)
    if args.json:
        out: dict[str, Any] = {"rows": [r.to_json(args.slo_speed) for r in rows]}
        if args.slo_speed is not None:
            best = best_plan(rows, args.slo_speed)
            out["slo_speed"] = args.slo_speed
            out["best"] = best and best.to_json()
            out["best_per_ep"] = {str(ep): (b := best_plan(rows, args.slo_speed, ep)) and b.to_json()
                                  for ep in sorted({r.plan.deployment.ep for r in rows})}
        print(json.dumps(out))
    else:
        print(format_sweep(rows, args.slo_speed))
    if args.plot:
        from epserve.planner.plots import plot_pareto, plot_prefill, plot_roofline

        path = Path(args.plot)
        mtp = f"MTP {d.mtp_draft} @ {d.mtp_accept:.0%}" if d.mtp_draft else "no MTP"
        title = f"{name} on {hw.name}: KV {d.kv_len}, {mtp}, {d.weights_label} weights"
        eps = sorted({r.plan.deployment.ep for r in rows})
        written = [
            plot_pareto(rows, path, title, args.slo_speed),
            plot_roofline(model, hw, d, path.with_name(f"{path.stem}-roofline{path.suffix}"), eps),
            plot_prefill(model, hw, d, path.with_name(f"{path.stem}-prefill{path.suffix}"), eps,
                         f"{name} prefill on {hw.name} (TP1, {d.weights_label} weights)"),
        ]
        _emit(args, "wrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epserve")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
