"""Router policies on a shared-prefix workload: cache hit rate, TTFT and throughput of ``cache_aware``
vs ``round_robin`` vs ``least_load`` on an ``epserve serve --dp 2`` server.

    .venv/bin/python benchmarks/serve_policies.py [MODEL options] [--rounds 2] [--out FILE] [--quick]

For each round and each policy (the order rotates every round) a fresh server is started (empty
caches), ``epserve bench serve --dataset shared-prefix`` runs against it (``--num-groups`` groups of
``--prompts-per-group`` prompts sharing a ``--system-prompt-len``-token system prompt, each with its
own ``--question-len``-token question and ``--output-len`` output tokens, all sent at once with
``--max-concurrency`` in flight), and the server is stopped. Prints a markdown table of the median
over rounds (and each round's figures) and writes every run as JSON (``--out``, default in the
cache dir). ``--quick``: a small workload and one round (a smoke run). Figures go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from common import bench_serve, serving
from tqdm import tqdm

from epserve import env
from epserve.env import cache_dir

POLICIES = ("cache_aware", "round_robin", "least_load")
METRICS = ("cache_hit_rate", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_e2e_ms", "request_throughput",
           "output_token_throughput")


def bench_args(args: argparse.Namespace) -> list[str]:
    return ["--dataset", "shared-prefix", "--num-groups", str(args.num_groups), "--prompts-per-group",
            str(args.prompts_per_group), "--system-prompt-len", str(args.system_prompt_len), "--question-len",
            str(args.question_len), "--output-len", str(args.output_len), "--request-rate", "inf",
            "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-groups", type=int, default=16)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.num_groups, args.prompts_per_group, args.system_prompt_len = 1, 4, 4, 128
        args.question_len, args.output_len, args.max_concurrency = 16, 8, 4
    out = args.out or cache_dir() / ("serve_policies_quick.json" if args.quick else "serve_policies.json")
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    with tempfile.TemporaryDirectory() as tmp:
        bar = tqdm(total=args.rounds * len(POLICIES), desc="policy runs", disable=env.progress_disabled())
        for r in range(args.rounds):
            order = POLICIES[r % len(POLICIES):] + POLICIES[: r % len(POLICIES)]
            for policy in order:
                serve_args = [*([args.model] if args.model else []), "--dp", "2", "--policy", policy,
                              "--dtype", args.dtype]
                with serving(serve_args, Path(tmp) / f"{policy}-{r}.log") as (_, url):
                    runs[policy].append(bench_serve(url, bench_args(args), Path(tmp) / f"{policy}-{r}.json"))
                bar.update(1)
        bar.close()
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "args": vars(args) | {"out": str(out)},
              "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(table(runs))
    print(f"\nJSON: {out}")


def table(runs: dict[str, list[dict]]) -> str:
    def med(policy: str, key: str) -> float:
        return statistics.median(float(run[key]) for run in runs[policy])

    base = "round_robin"
    lines = ["| policy | cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | E2E p50 (ms) | req/s "
             "| output tok/s | throughput vs round_robin |",
             "|---|---|---|---|---|---|---|---|---|"]
    for policy in POLICIES:
        v = {k: med(policy, k) for k in METRICS}
        ratio = v["request_throughput"] / med(base, "request_throughput")
        lines.append(f"| {policy} | {v['cache_hit_rate']:.3f} | {v['median_ttft_ms']:.0f} | {v['p99_ttft_ms']:.0f} "
                     f"| {v['median_tpot_ms']:.1f} | {v['median_e2e_ms']:.0f} | {v['request_throughput']:.2f} "
                     f"| {v['output_token_throughput']:.1f} | {ratio:.2f}x |")
    lines.append("")
    lines.append("Each round (cache hit rate / TTFT p50 ms / req/s):")
    for policy in POLICIES:
        rounds = ", ".join(f"{run['cache_hit_rate']:.3f} / {float(run['median_ttft_ms']):.0f} / "
                           f"{float(run['request_throughput']):.2f}" for run in runs[policy])
        lines.append(f"- {policy}: {rounds}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
