"""MTP speculative decoding against plain decoding on a trained checkpoint: draft acceptance per position
for each number of draft tokens, and output tokens/s at several batch sizes, side by side in one run
(alternating rounds, the median of each); with ``--breakdown``, where a batch-1 step's time goes.

    python benchmarks/mtp_decode.py --model /tmp/trained [--k 1 2 3] [--batches 1 4 16] [--json out.json]
    python benchmarks/mtp_decode.py --model /tmp/trained --k 1 --breakdown

Prompts are the opening words of the training corpus's held-out paragraphs (greedy, ``ignore_eos``).
Acceptance is measured one request at a time (where every step drafts). The MTP engines switch drafting
off per step as the engine does (``spec_manager.DraftRule``): above its batch they run plain steps.
``--breakdown``: each engine's steady batch-1 decode steps, the step's phases timed around the engine's
calls (the forward, sampling, the MTP passes, the draft graph replays, the MTP head where it runs outside the
draft graph: "-" where every pass replays a recorded graph, which holds it), alternated, medians;
then each recorded CPU graph's kernels, timed in C (``cpu_decode.kernel_breakdown``'s timer), alternated.
Train the checkpoint first: ``epserve make-checkpoint /tmp/trained --train``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))  # (cpu_decode's kernel timer, run from anywhere)

from epserve import LLM, SamplingParams  # noqa: E402
from epserve.training.corpus import load_corpus  # noqa: E402


def prompts(n: int, words: int) -> list[str]:
    paragraphs = [p for p in load_corpus().heldout if len(p.split()) > words]
    return [" ".join(paragraphs[i % len(paragraphs)].split()[:words]) for i in range(n)]


def tokens_per_s(llm: LLM, texts: list[str], batch: int, params: SamplingParams) -> float:
    """Output tokens/s over ``texts`` run ``batch`` at a time (several batches, so a batch of one does not
    measure a single prompt's acceptance)."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        tokens += sum(len(o.token_ids) for o in llm.generate(texts[i : i + batch], params))
    return tokens / (time.perf_counter() - start)


def _timed_calls(engine, times: dict[str, list[float]]) -> None:  # noqa: ANN001
    """Wrap the engine's phases (instance attributes) so each call's seconds land in ``times``."""
    runner = engine.runner
    phases = {"step": (engine, "step"), "forward": (runner, "forward"), "sample": (engine.sampling, "sample"),
              "schedule": (engine.scheduler, "schedule"), "update": (engine.scheduler, "update")}
    if runner.proposer is not None:
        phases |= {"MTP passes": (runner, "propose"), "draft graph": (runner.proposer, "_run"),
                   "MTP head": (runner.model, "compute_mtp_logits")}
    for name, (obj, attr) in phases.items():
        setattr(obj, attr, _timing(getattr(obj, attr), times.setdefault(name, [])))


def _timing(f, out: list[float]):  # noqa: ANN001, ANN202
    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        t = time.perf_counter()
        result = f(*args, **kwargs)
        out.append(time.perf_counter() - t)
        return result
    return timed


def breakdown(engines: dict[str, LLM], words: int, rounds: int, steps: int = 50) -> None:
    """Steady batch-1 decode in every engine, steps alternated between them: each phase's median ms a step
    and tokens a step; then each recorded CPU graph's kernels (ms a replay, medians of alternated rounds)."""
    from cpu_decode import kernel_breakdown

    params = SamplingParams(temperature=0.0, max_tokens=10**6, ignore_eos=True)
    times: dict[str, dict[str, list[float]]] = {name: {} for name in engines}
    tokens = {name: 0 for name in engines}
    for name, llm in engines.items():
        llm.engine.add_request(f"breakdown-{name}", llm.tokenizer.encode(prompts(1, words)[0]), params)
        for _ in range(20):
            llm.engine.step()
        _timed_calls(llm.engine, times[name])
    for _ in range(rounds):
        for name, llm in engines.items():
            for _ in range(steps):
                tokens[name] += sum(len(u.new_token_ids) for u in llm.engine.step())
    print("\n| engine | tokens a step | " + " | ".join(f"{p} ms" for p in times["plain"]) + " | MTP passes ms | "
          "draft graph ms | MTP head ms |")
    print("|---" * (len(times["plain"]) + 5) + "|")
    for name, t in times.items():
        med = {p: f"{1e3 * statistics.median(v):.3f}" for p, v in t.items() if v}  # (no MTP head call: "-")
        extra = [med.get(p, "-") for p in ("MTP passes", "draft graph", "MTP head")]
        print(f"| {name} | {tokens[name] / (rounds * steps):.2f} | " + " | ".join(med[p] for p in times["plain"]) +
              " | " + " | ".join(extra) + " |")
    graphs = {}
    for name, llm in engines.items():
        captured = llm.engine.runner.captured
        if captured is None:
            continue
        for label, g in (("target", captured.graphs), ("draft", captured.drafts)):
            for bucket, _overlap in (g._cpu_graphs if g is not None else {}):
                graphs[f"{name} {label} batch {bucket}"] = (g, bucket)
    kernels: dict[str, list[dict[str, float]]] = {k: [] for k in graphs}
    for _ in range(max(rounds, 5)):
        for key, (g, bucket) in graphs.items():
            kernels[key].append(kernel_breakdown(SimpleNamespace(graphs=g), bucket, 30))
    print("\n| recorded graph | kernels ms a replay | largest |\n|---|---|---|")
    for key, runs in kernels.items():
        med = {n: statistics.median(r[n] for r in runs) for n in runs[0]}
        top = ", ".join(f"{n} {v:.3f}" for n, v in sorted(med.items(), key=lambda kv: -kv[1])[:4])
        print(f"| {key} | {statistics.median(sum(r.values()) for r in runs):.3f} | {top} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/trained")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="draft tokens per step to compare")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=8, help="prompts per measurement (in batches of B)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--breakdown", action="store_true", help="where a batch-1 step's time goes, per engine")
    args = ap.parse_args()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(dtype=args.dtype, device=args.device, num_blocks=2048, max_num_seqs=max(args.batches))
    engines = {"plain": LLM(args.model, num_speculative_tokens=0, **engine)}
    for k in args.k:
        engines[f"mtp k={k}"] = LLM(args.model, speculative="mtp", num_speculative_tokens=k, **engine)

    if args.breakdown:
        breakdown(engines, args.prompt_words, args.rounds)
        return
    accept = {}
    for name, llm in engines.items():  # acceptance over every held-out prompt (also the warm-up)
        if name != "plain":
            for text in prompts(32, args.prompt_words):  # one at a time: every step drafts
                llm.generate([text], params)
            stats = llm.speculative_stats()
            accept[name] = {
                "acceptance_rate": round(stats["acceptance_rate"], 4),
                "per_position": [round(a / stats["num_drafts"], 4) for a in stats["accepted_per_position"]],
                "tokens_per_step": round(1 + stats["num_accepted_tokens"] / stats["num_drafts"], 3),
            }
        else:
            llm.generate(prompts(4, args.prompt_words), params)

    speed: dict[int, dict[str, float]] = {}
    with tqdm(total=len(args.batches) * args.rounds * len(engines), desc="rounds") as bar:
        for b in args.batches:
            texts = prompts(b * max(1, args.min_prompts // b), args.prompt_words)
            samples: dict[str, list[float]] = {name: [] for name in engines}
            for llm in engines.values():  # untimed: the batch's recorded graphs made (a bucket records at first use)
                tokens_per_s(llm, texts[:b], b, params)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    samples[name].append(tokens_per_s(llm, texts, b, params))
                    bar.update(1)
            speed[b] = {name: statistics.median(v) for name, v in samples.items()}

    print(f"\nmodel {args.model}, {args.dtype}, greedy, {args.max_tokens} tokens per request\n")
    print("| draft tokens | acceptance | accepted per position | tokens per step |")
    print("|---|---|---|---|")
    for name, a in accept.items():
        print(f"| {name} | {a['acceptance_rate']:.3f} | {' / '.join(f'{x:.3f}' for x in a['per_position'])} | "
              f"{a['tokens_per_step']:.2f} |")
    print("\n| batch | " + " | ".join(f"{n} tok/s" for n in engines) + " | " +
          " | ".join(f"{n} / plain" for n in engines if n != "plain") + " |")
    print("|---" * (2 * len(engines)) + "|")
    for b, row in speed.items():
        print(f"| {b} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " | " +
              " | ".join(f"{row[n] / row['plain']:.2f}x" for n in engines if n != "plain") + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "acceptance": accept, "tokens_per_s": speed}, f, indent=1)
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
