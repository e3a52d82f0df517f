"""EPLB on a model skewed on purpose: expert-load imbalance, decode step time and dispatch bytes before
and after a rebalance, at dp 2 and dp 4.

    .venv/bin/python benchmarks/eplb_serving.py [--preset small] [--dp 2 4] [--quick] [--out FILE]

The checkpoint is ``--preset`` with a large correction bias (``--hot-bias``) on ``--hot-experts``
(default 4 and 5: one group, one rank's, and not among the start-up replicas): the router sends them
nearly every token. For each dp (tp 1, ``all_to_all``,
overlap ``dispatch``, prefix caching off so every round runs the same tokens), one engine per row:

- ``no EPLB``: no redundant experts, the start-up placement (expert e in slot e);
- ``replicas, start-up``: ``--redundant`` (default: dp) redundant slots holding copies of experts
  0..R-1 (they take their share of tokens), before any rebalance;
- ``rebalanced (position)`` / ``rebalanced (local)``: the same engine after ``llm.rebalance_experts()``
  on the load of one round, with each replica selection rule.

Each row runs ``--rounds`` rounds of ``--batch`` requests per DP group (prompt ``--prompt-len``,
``--max-tokens`` greedy tokens) and reports: the imbalance (max/mean token copies per rank over every
MoE layer, from ``llm.expert_load()``), the mean per-layer imbalance, rank 0's median pure-decode step
time (profiler ``step``; every rank runs every step), and the bytes dispatch sent across ranks per
round; rebalance rows add the experts moved, bytes moved and the rebalance's wall time. Tokens are
checked equal to the first row's in every row. Prints a markdown table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from epserve import LLM, SamplingParams
from epserve.env import cache_dir
from epserve.presets import make_checkpoint


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _round(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    llm.reset_expert_load()
    llm.reset_comm_stats()
    llm.set_profiling(True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    steps = [s for s in llm.profile()[0] if s.is_decode]
    llm.set_profiling(False)
    load = llm.expert_load()
    return {
        "tokens": tokens,
        "imbalance": load.imbalance,
        "layer_imbalance": statistics.fmean(load.layer_imbalance),
        "decode_step_ms": 1e3 * statistics.median(s.seconds["step"] for s in steps),
        "dispatch_bytes": sum(r["dispatch"] for r in llm.comm_bytes()),
    }


def _rounds(llm: LLM, prompts: list[list[int]], params: SamplingParams, rounds: int) -> dict:
    runs = [_round(llm, prompts, params) for _ in range(rounds)]
    out = {k: statistics.median(r[k] for r in runs) for k in ("imbalance", "layer_imbalance", "decode_step_ms",
                                                              "dispatch_bytes")}
    out["tokens"] = runs[0]["tokens"]
    return out


def run(args: argparse.Namespace) -> dict:
    preset = "tiny" if args.quick else args.preset
    hot = {e: args.hot_bias for e in args.hot_experts}
    path = cache_dir() / f"eplb-skewed-{preset}-{'-'.join(map(str, args.hot_experts))}-{args.hot_bias}"
    if not (path / "config.json").exists():
        make_checkpoint(path, preset, dtype="bfloat16", hot_experts=hot)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = {"dtype": "bfloat16", "enable_prefix_caching": False, "dispatch": "all_to_all", "overlap": "dispatch",
              "max_num_seqs": max(args.batch, 1), "memory_budget_bytes": args.memory_gb * 2**30}
    rows = []
    bar = tqdm(total=len(args.dp) * 4, desc="EPLB rows")
    for dp in args.dp:
        prompts = _prompts(args.batch * dp, args.prompt_len, vocab, seed=dp)
        redundant = args.redundant if args.redundant is not None else dp
        reference = None
        with LLM(path, dp=dp, **engine) as llm:
            llm.generate(prompts[:dp], params)  # warm-up
            base = _rounds(llm, prompts, params, args.rounds)
            reference = base.pop("tokens")
            rows.append({"dp": dp, "row": "no EPLB", "redundant": 0, **base})
        bar.update()
        for selection in ("position", "local"):
            with LLM(path, dp=dp, num_redundant_experts=redundant, eplb_replica_selection=selection, **engine) as llm:
                llm.generate(prompts[:dp], params)
                if selection == "position":
                    start = _rounds(llm, prompts, params, args.rounds)
                    assert start.pop("tokens") == reference, "tokens changed with replicas"
                    rows.append({"dp": dp, "row": "replicas, start-up", "redundant": redundant, **start})
                    bar.update()
                else:
                    _round(llm, prompts, params)  # load to balance by
                t = time.perf_counter()
                report = llm.rebalance_experts()
                wall = time.perf_counter() - t
                after = _rounds(llm, prompts, params, args.rounds)
                assert after.pop("tokens") == reference, "tokens changed by the rebalance"
                rows.append({"dp": dp, "row": f"rebalanced ({selection})", "redundant": redundant, **after,
                             "experts_moved": report.experts_moved, "bytes_moved": report.bytes_moved,
                             "rebalance_s": wall, "predicted_layer_imbalance": report.imbalance_after})
                bar.update()
    bar.close()
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
               f"torch {torch.__version__}")
    return {"preset": preset, "hot_experts": args.hot_experts, "hot_bias": args.hot_bias, "batch_per_dp": args.batch,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds, "machine": machine,
            "rows": rows}


def table(result: dict) -> str:
    lines = ["| dp | placement | redundant | imbalance | mean layer imbalance | decode step ms | dispatch MiB/round "
             "| experts moved | MiB moved | rebalance s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        moved = (f"{r['experts_moved']} | {r['bytes_moved'] / 2**20:.1f} | {r['rebalance_s']:.2f}"
                 if "experts_moved" in r else "| |")
        lines.append(f"| {r['dp']} | {r['row']} | {r['redundant']} | {r['imbalance']:.3f} | {r['layer_imbalance']:.3f} "
                     f"| {r['decode_step_ms']:.1f} | {r['dispatch_bytes'] / 2**20:.2f} | {moved} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--redundant", type=int, default=None, help="redundant experts (default: dp)")
    p.add_argument("--hot-experts", type=int, nargs="+", default=[4, 5])
    p.add_argument("--hot-bias", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=16, help="requests per DP group")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--memory-gb", type=float, default=4.0, help="weights + KV budget per rank")
    p.add_argument("--quick", action="store_true", help="the tiny preset, few tokens: a smoke run")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.rounds, args.prompt_len = 4, 6, 1, 8
    result = run(args)
    out = args.out or cache_dir() / "eplb_serving.json"
    out.write_text(json.dumps(result, indent=1))
    hot = ", ".join(map(str, result["hot_experts"]))
    print(f"{result['preset']} with experts {hot} biased by {result['hot_bias']}; {result['machine']}\n")
    print(table(result))
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
