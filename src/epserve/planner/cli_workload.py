"""``epserve plan --input-len I --output-len O`` (colocated, end to end) and its ``--sweep``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from epserve.planner.deployment import Deployment
from epserve.planner.disagg import DEFAULT_OUTPUT_LEN
from epserve.planner.errors import PlanError
from epserve.planner.workload import DEFAULT_MAX_NUM_TOKENS, plan_workload, workload_kv_len
from epserve.planner.workload_sweep import format_workload, format_workload_sweep, sweep_workload


def wants_workload(args: argparse.Namespace) -> bool:
    """End-to-end pricing: an I/O mix or a token budget given without ``--disaggregated``."""
    given = (args.input_len, args.output_len, getattr(args, "max_num_tokens", None))
    return not args.disaggregated and any(v is not None for v in given)


def run_workload(args: argparse.Namespace, name: str, model: Any, hw: Any, d: Deployment,
                 default_input: int) -> int:
    for flag, value in (("--expert-load", args.expert_load), ("--eplb", args.eplb)):
        if value:
            raise PlanError(f"{flag} is not priced end to end (--input-len/--output-len without --disaggregated)")
    if args.input_len is not None and args.prompt_len is not None and args.input_len != args.prompt_len:
        raise PlanError(f"--input-len {args.input_len} and --prompt-len {args.prompt_len} disagree: give one of them")
    input_len = args.input_len or args.prompt_len or default_input
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    budget = args.max_num_tokens or DEFAULT_MAX_NUM_TOKENS
    kv_len = args.kv_len if args.kv_len is not None else workload_kv_len(input_len, output_len)
    if args.sweep:
        rows = sweep_workload(model, hw, d, input_len, output_len, eps=None if args.ep is None else [args.ep],
                              tps=None if args.tp is None else [args.tp],
                              batches=None if args.batch is None else [args.batch], requests=args.requests,
                              max_num_tokens=budget, model_name=name)
        if args.json:
            print(json.dumps({"rows": [r.to_json() for r in rows]}))
        else:
            print(format_workload_sweep(rows))
        if args.plot:
            from epserve.planner.plots import plot_workload_pareto

            title = f"{name} on {hw.name}, colocated {input_len}/{output_len}, budget {budget} tokens/step"
            path = plot_workload_pareto(rows, Path(args.plot), title)
            print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
        return 0
    if args.plot:
        raise PlanError("--plot with --input-len/--output-len needs --sweep (the Pareto front)")
    plan = plan_workload(model, hw, d, input_len, output_len, budget, name, kv_len)
    if args.json:
        out = plan.to_json()
        if args.slo_speed is not None:
            out["meets_slo"] = plan.fits and plan.interactivity >= args.slo_speed
        print(json.dumps(out, indent=1))
    else:
        print(format_workload(plan))
    return 0 if plan.fits else 1
