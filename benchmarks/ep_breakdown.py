"""Expert parallelism on the `small` preset (bf16): where a decode step's time goes, how many bytes
dispatch and combine move against theory, and where two micro-batches beat dispatch overlap.

    .venv/bin/python benchmarks/ep_breakdown.py [--out FILE] [--quick]

1. **Stage breakdown** of pure decode steps (every rank decoding the same batch, after the prefill,
   the first ``--warmup`` decode steps dropped) for dp 1 and dp 2 (tp 1, all_to_all, overlap
   ``dispatch``) at ``--breakdown-batches`` sequences per DP group: the profiler's op times grouped
   into attention, gate, dispatch, experts, combine, shared expert, dense MLP, sampling, and other
   (the forward minus every op timed inside it: embedding, final norm, schedule and Python), median
   ms per step on rank 0, plus both ranks' forward. dp 1 runs in this process with all the cores'
   threads; each dp 2 rank gets cores / 2 threads.
2. **Bytes** each dispatch backend (``all_to_all``, ``padded``) sent to other ranks during one
   ``generate`` (prefill and decode), summed over ranks, against
   ``tokens x top_k x hidden x bytes x (EP-1)/EP`` with tokens = the tokens all DP groups ran
   through the model, counted from the step records, times the number of MoE layers.
3. **Overlap crossover** (dp 2, all_to_all): the median ``forward`` of rank 0 at each
   ``--overlap-batches`` per DP group, overlap ``dispatch`` vs ``microbatch`` (switched with
   ``set_overlap`` in one engine, alternated over ``--rounds`` rounds; each round's ratio is shown
   too), plus one prefill step of 2 x ``--prefill-len``-token prompts per DP group (split into two
   micro-batches of one prompt).

Prints markdown tables and writes every number as JSON (``--out``, default in the cache dir).
``--quick``: the `tiny` preset and few steps, a smoke run (< 60 s); ``--tables-from FILE`` reprints
an earlier run's tables. Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from epserve import LLM, SamplingParams, env
from epserve.config import ModelConfig
from epserve.engine.profiler import StepRecord
from epserve.env import cache_dir
from epserve.parallel.launch import threads_per_rank
from epserve.presets import default_model_path, make_checkpoint

# Op names of src/epserve/parallel/stages.py, grouped for the breakdown ("other" = forward - the rest).
GROUPS: dict[str, tuple[str, ...]] = {
    "attention": (
        "input_norm", "qkv_a_proj", "q_b_proj", "append_kv", "q_absorb", "kv_b_proj", "attention_core",
        "v_absorb", "o_proj", "attn_reduce_scatter", "post_norm",
    ),
    "gate": ("gate",),
    "dispatch": ("dispatch_send", "dispatch_recv"),
    "experts": ("experts",),
    "combine": ("combine_send", "combine_recv"),
    "shared expert": ("shared_expert",),
    "dense mlp": ("mlp", "ffn_all_gather"),
}
KNOWN_OPS = {op for ops in GROUPS.values() for op in ops}
COLUMNS = (*GROUPS, "other", "forward", "sampling")

Step = tuple[StepRecord, ...]  # one step, every rank's record


# ---- measurement -------------------------------------------------------------------------------
def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def profiled_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[Step]:
    """Run ``prompts`` to completion with profiling on; every step's records, rank by rank."""
    llm.set_profiling(True)  # a fresh record
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        per_rank = llm.profile()
    finally:
        llm.set_profiling(False)
    assert all(len(o.token_ids) == max_tokens for o in outs)
    lengths = {len(r) for r in per_rank}
    assert len(lengths) == 1, f"ranks recorded different numbers of steps: {lengths}"
    return list(zip(*per_rank))


def pure_decode_steps(llm: LLM, dp: int, batch: int, prompt_len: int, max_tokens: int, warmup: int,
                      vocab: int, seed: int) -> list[Step]:
    """``batch`` sequences per DP group decoding together; the steps in which every rank decoded
    exactly ``batch`` sequences, less the first ``warmup`` of them."""
    steps = profiled_generate(llm, random_prompts(batch * dp, prompt_len, vocab, seed), max_tokens)
    pure = [s for s in steps if all(r.is_decode and r.num_seqs == batch for r in s)]
    if len(pure) <= warmup:
        raise RuntimeError(f"only {len(pure)} pure decode steps at batch {batch} (dp {dp}); raise --max-tokens")
    return pure[warmup:]


def grouped(record: StepRecord) -> dict[str, float]:
    """One rank's step in ms per group; ``other`` is the forward less every op timed inside it."""
    s = record.seconds
    out = {g: 1e3 * sum(s.get(op, 0.0) for op in ops) for g, ops in GROUPS.items()}
    out["forward"] = 1e3 * s.get("forward", 0.0)
    out["other"] = out["forward"] - sum(out[g] for g in GROUPS)
    out["sampling"] = 1e3 * s.get("sample", 0.0)
    return out


def summarize(steps: list[Step]) -> dict:
    """Median ms per group on rank 0 and the median forward of every rank."""
    per_step = [grouped(s[0]) for s in steps]
    unknown = sorted({op for s in steps for r in s for op in r.seconds} - KNOWN_OPS - {"forward", "sample"})
    return {
        "steps": len(steps),
        "rank0_median_ms": {c: statistics.median(p[c] for p in per_step) for c in COLUMNS},
        "forward_median_ms_per_rank": [
            statistics.median(1e3 * s[r].seconds["forward"] for s in steps) for r in range(len(steps[0]))
        ],
        "ops_in_other": unknown,  # timed ops outside GROUPS (their time lands in "other")
    }


def make_llm(path: Path, dp: int, dispatch: str, max_seqs: int, max_batched: int, num_blocks: int) -> LLM:
    return LLM(path, dtype="bfloat16", dp=dp, tp=1, dispatch=dispatch, overlap="dispatch",
               max_num_seqs=max_seqs, max_num_batched_tokens=max_batched, num_blocks=num_blocks,
               enable_prefix_caching=False)


def breakdown(llm: LLM, dp: int, args, vocab: int, bar: tqdm) -> list[dict]:
    llm.set_overlap("dispatch")
    rows = []
    for b in args.breakdown_batches:
        steps = pure_decode_steps(llm, dp, b, args.prompt_len, args.max_tokens, args.warmup, vocab, seed=100 + b)
        rows.append({"dp": dp, "batch_per_group": b, **summarize(steps)})
        bar.update(1)
    return rows


def comm_bytes(llm: LLM, dispatch: str, cfg: ModelConfig, args, vocab: int, itemsize: int) -> dict:
    """Bytes sent to other ranks in one generate (overlap ``dispatch``), against theory."""
    dp = 2
    llm.set_overlap("dispatch")
    llm.reset_comm_stats()
    prompts = random_prompts(args.bytes_batch * dp, args.prompt_len, vocab, seed=7)
    steps = profiled_generate(llm, prompts, args.max_tokens)
    sent = llm.comm_bytes()
    num_moe_layers = len(cfg.moe_layer_ids)
    tokens = sum(r.num_tokens for s in steps for r in s)  # tp 1: every rank is one DP group
    layer_tokens = tokens * num_moe_layers
    ep = dp
    theory = layer_tokens * cfg.num_experts_per_tok * cfg.hidden_size * itemsize * (ep - 1) / ep
    out = {"dispatch_backend": dispatch, "batch_per_group": args.bytes_batch, "tokens": tokens,
           "moe_layers": num_moe_layers, "layer_tokens": layer_tokens, "theory_bytes": theory,
           "per_rank": sent}
    for phase in ("dispatch", "combine"):
        measured = sum(r[phase] for r in sent)
        out[phase] = {"measured_bytes": measured, "ratio": measured / theory}
    return out


def compare_modes(llm: LLM, rounds: int, run, bar: tqdm) -> dict:
    """``run(round)`` -> the steps to compare, once per overlap mode per round; the two modes
    alternate which goes first. Pools every round's steps, and pairs the rounds: the ratio of the
    two modes' median rank-0 forward within a round (seconds apart) is immune to slow drift."""
    steps: dict[str, list[list[Step]]] = {"dispatch": [], "microbatch": []}
    for rnd in range(rounds):
        for mode in ("dispatch", "microbatch") if rnd % 2 == 0 else ("microbatch", "dispatch"):
            llm.set_overlap(mode)
            ss = run(rnd)
            assert ss and all(r.overlap == mode for s in ss for r in s)
            steps[mode].append(ss)
            bar.update(1)
    out: dict = {m: summarize([s for ss in per_round for s in ss]) for m, per_round in steps.items()}
    for m, per_round in steps.items():
        out[m]["round_forward_ms"] = [statistics.median(1e3 * s[0].seconds["forward"] for s in ss)
                                      for ss in per_round]
    out["round_ratios"] = [mb / d for d, mb in zip(out["dispatch"]["round_forward_ms"],
                                                     out["microbatch"]["round_forward_ms"])]
    d, mb = (out[k]["rank0_median_ms"]["forward"] for k in ("dispatch", "microbatch"))
    out["microbatch_over_dispatch"] = mb / d
    return out


def overlap_sweep(llm: LLM, args, vocab: int, bar: tqdm) -> dict:
    dp = 2
    decode = []
    for b in args.overlap_batches:
        def run(rnd: int, b: int = b) -> list[Step]:
            return pure_decode_steps(llm, dp, b, args.prompt_len, args.max_tokens, args.warmup, vocab,
                                     seed=1000 * rnd + b)
        decode.append({"batch_per_group": b, **compare_modes(llm, args.rounds, run, bar)})

    prefill = None
    if args.prefill_len:
        def run_prefill(rnd: int) -> list[Step]:
            prompts = random_prompts(2 * dp, args.prefill_len, vocab, seed=5000 + rnd)
            steps = profiled_generate(llm, prompts, 2)
            steps = [s for s in steps if all(not r.is_decode and r.num_tokens == 2 * args.prefill_len for r in s)]
            if not steps:
                raise RuntimeError("no step ran both prefills of a DP group at once; raise max_num_batched_tokens")
            return steps
        prefill = {"prompts_per_group": 2, "prompt_len": args.prefill_len,
                   **compare_modes(llm, args.rounds, run_prefill, bar)}
    llm.set_overlap("dispatch")
    return {"decode": decode, "prefill": prefill}


# ---- tables ------------------------------------------------------------------------------------
def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def f(x: float, nd: int = 2) -> str:
    return f"{x:.{nd}f}"


def breakdown_table(rows: list[dict], threads: dict[int, int]) -> str:
    header = ["dp", "threads/rank", "batch/group", *COLUMNS, "fwd rank 1"]
    body = []
    for r in rows:
        med = r["rank0_median_ms"]
        fwd = r["forward_median_ms_per_rank"]
        body.append([str(r["dp"]), str(threads[r["dp"]]), str(r["batch_per_group"]),
                     *(f(med[c]) for c in COLUMNS), f(fwd[1]) if len(fwd) > 1 else "-"])
    return md_table(header, body)


def bytes_table(rows: list[dict]) -> str:
    header = ["backend", "phase", "layer-tokens", "measured MB", "theory MB", "measured / theory"]
    body = []
    for r in rows:
        for phase in ("dispatch", "combine"):
            body.append([r["dispatch_backend"], phase, str(r["layer_tokens"]),
                         f(r[phase]["measured_bytes"] / 1e6), f(r["theory_bytes"] / 1e6), f(r[phase]["ratio"], 3)])
    return md_table(header, body)


def overlap_table(res: dict) -> str:
    header = ["step", "tokens/group", "dispatch fwd ms", "microbatch fwd ms", "microbatch / dispatch",
              "per-round ratios", "rank 1: dispatch", "rank 1: microbatch"]
    body = []
    rows = [(f"decode, batch {r['batch_per_group']}", r["batch_per_group"], r) for r in res["decode"]]
    if res["prefill"]:
        p = res["prefill"]
        rows.append((f"prefill, 2 x {p['prompt_len']}", 2 * p["prompt_len"], p))
    for name, tokens, r in rows:
        d, m = r["dispatch"], r["microbatch"]
        body.append([name, str(tokens), f(d["rank0_median_ms"]["forward"]), f(m["rank0_median_ms"]["forward"]),
                     f(r["microbatch_over_dispatch"], 3), " ".join(f(x) for x in r["round_ratios"]),
                     f(d["forward_median_ms_per_rank"][1]),
                     f(m["forward_median_ms_per_rank"][1])])
    return md_table(header, body)


def mode_breakdown_table(res: dict) -> str:
    """Rank 0's grouped median ms under each overlap mode, for every step of the sweep."""
    rows = [(f"decode, batch {r['batch_per_group']}", r) for r in res["decode"]]
    if res["prefill"]:
        rows.append((f"prefill, 2 x {res['prefill']['prompt_len']}", res["prefill"]))
    header = ["step", "overlap", *COLUMNS]
    body = [[name, mode, *(f(r[mode]["rank0_median_ms"][c]) for c in COLUMNS)]
            for name, r in rows for mode in ("dispatch", "microbatch")]
    return md_table(header, body)


def print_tables(results: dict) -> None:
    threads = {int(k): v for k, v in results["threads_per_rank"].items()}
    overlap = results["overlap"]
    d = overlap["decode"]
    wins = [r["batch_per_group"] for r in d if r["microbatch_over_dispatch"] < 1]
    print(f"\n{results['machine']}; threads per rank: dp 1 -> {threads[1]}, dp 2 -> {threads[2]}\n")
    print("### Decode step breakdown (rank 0, median ms per step; overlap dispatch, all_to_all)\n")
    print(breakdown_table(results["breakdown"], threads))
    print("\n### Bytes sent to other ranks (dp 2, one generate, summed over ranks)\n")
    print(bytes_table(results["bytes"]))
    print("\n### Overlap: dispatch vs microbatch (dp 2, all_to_all, median forward ms)\n")
    print(overlap_table(overlap))
    print(f"\nmicrobatch faster at batch/group: {wins or 'none'}; "
          f"ratio at the largest decode batch ({d[-1]['batch_per_group']}): {d[-1]['microbatch_over_dispatch']:.3f}")
    print("\n### Breakdown by overlap mode (dp 2, rank 0, median ms per step)\n")
    print(mode_breakdown_table(overlap))
    print(f"\nwall time {results['wall_s']:.0f} s")


# ---- main --------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=None, help="default: cache_dir()/bench-small (made if missing)")
    ap.add_argument("--breakdown-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--overlap-batches", type=int, nargs="+", default=[2, 8, 32, 64, 128, 256])
    ap.add_argument("--bytes-batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3, help="pure decode steps dropped at the start")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two overlap modes")
    ap.add_argument("--prefill-len", type=int, default=256, help="0: skip the prefill comparison")
    ap.add_argument("--out", default=None, help="JSON results (default: cache_dir()/ep_breakdown.json)")
    ap.add_argument("--quick", action="store_true", help="tiny preset, few steps: a smoke run")
    ap.add_argument("--tables-from", default=None, help="only print the tables of an earlier run's JSON")
    ap.add_argument("--no-pin", action="store_true", help="leave rank processes unpinned (EPSERVE_PIN=0)")
    args = ap.parse_args()
    if args.no_pin:
        os.environ[env.PIN] = "0"  # inherited by the spawned ranks
    if args.tables_from:
        print_tables(json.loads(Path(args.tables_from).read_text()))
        return
    if args.quick:
        args.breakdown_batches, args.overlap_batches, args.bytes_batch = [1, 4], [2, 8], 4
        args.prompt_len, args.max_tokens, args.warmup, args.rounds, args.prefill_len = 8, 6, 1, 1, 16
        path = Path(args.checkpoint) if args.checkpoint else default_model_path()
    else:
        path = Path(args.checkpoint) if args.checkpoint else cache_dir() / "bench-small"
        if not (path / "config.json").exists():
            make_checkpoint(path, preset="small", dtype="bfloat16", seed=0)
    default_name = "ep_breakdown_quick.json" if args.quick else "ep_breakdown.json"
    out_path = Path(args.out) if args.out else cache_dir() / default_name

    cfg = ModelConfig.from_hf(str(path))
    vocab, itemsize = cfg.vocab_size, torch.bfloat16.itemsize
    max_batch = max(args.breakdown_batches + args.overlap_batches + [args.bytes_batch])
    max_seqs = max(max_batch, 2)
    max_batched = max(2048, max_batch * args.prompt_len, 2 * args.prefill_len)
    seq_blocks = -(-max(args.prompt_len + args.max_tokens, args.prefill_len + 2) // 16)
    num_blocks = max_seqs * seq_blocks + 16
    threads = {1: torch.get_num_threads(),
               2: threads_per_rank(2)}
    results: dict = {
        "pinned_ranks": not args.no_pin,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"gloo on CPU",
        "threads_per_rank": threads,
        "checkpoint": str(path),
        "args": vars(args),
    }
    t_start = time.perf_counter()
    num_units = (2 * len(args.breakdown_batches) + 2 * args.rounds * len(args.overlap_batches)
                 + (2 * args.rounds if args.prefill_len else 0) + 2)
    bar = tqdm(total=num_units, desc="ep_breakdown")
    warm = random_prompts(2, args.prompt_len, vocab, seed=1)

    with make_llm(path, 1, "all_to_all", max_seqs, max_batched, num_blocks) as llm:
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
        rows = breakdown(llm, 1, args, vocab, bar)
    with make_llm(path, 2, "all_to_all", max_seqs, max_batched, num_blocks) as llm:
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
        rows += breakdown(llm, 2, args, vocab, bar)
        byte_rows = [comm_bytes(llm, "all_to_all", cfg, args, vocab, itemsize)]
        bar.update(1)
        overlap = overlap_sweep(llm, args, vocab, bar)
    with make_llm(path, 2, "padded", max_seqs, max_batched, num_blocks) as llm:
        byte_rows.append(comm_bytes(llm, "padded", cfg, args, vocab, itemsize))
        bar.update(1)
    bar.close()
    results.update(breakdown=rows, bytes=byte_rows, overlap=overlap, wall_s=time.perf_counter() - t_start)
    print_tables(results)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    print(f"JSON: {out_path}")


if __name__ == "__main__":
    main()
