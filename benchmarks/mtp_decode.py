"""MTP speculative decoding against plain decoding on a trained checkpoint: draft acceptance per position
for each number of draft tokens, and output tokens/s at several batch sizes, side by side in one run
(alternating rounds, the median of each).

    python benchmarks/mtp_decode.py --model /tmp/trained [--k 1 2 3] [--batches 1 4 16] [--json out.json]

Prompts are the opening words of the training corpus's held-out paragraphs (greedy, ``ignore_eos``).
Train the checkpoint first: ``epserve make-checkpoint /tmp/trained --train``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tqdm import tqdm

from epserve import LLM, SamplingParams
from epserve.training.corpus import load_corpus


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
    args = ap.parse_args()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = dict(dtype=args.dtype, device=args.device, num_blocks=2048, max_num_seqs=max(args.batches))
    engines = {"plain": LLM(args.model, **engine)}
    for k in args.k:
        engines[f"mtp k={k}"] = LLM(args.model, speculative="mtp", num_speculative_tokens=k, **engine)

    accept = {}
    for name, llm in engines.items():  # acceptance over every held-out prompt (also the warm-up)
        if name != "plain":
            llm.generate(prompts(32, args.prompt_words), params)
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
