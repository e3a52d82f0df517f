"""Train the ``tiny`` checkpoint on the corpus (``epserve.training.train_checkpoint``), then print its
timing, losses, held-out MTP accuracy and the engine's greedy continuations of held-out paragraphs.

    python benchmarks/train_checkpoint.py --out /tmp/trained [--max-seconds 540] [--skip-train]
    python benchmarks/train_checkpoint.py --out /tmp/distilled --distill-from /tmp/trained --steps 40

``--distill-from``: only the second phase (the MTP module self-distilled on the main model's predictions,
``epserve.training.train.distill_checkpoint``) on a checkpoint trained before, for ``--steps`` steps or
``--max-seconds``; the held-out MTP agreement before and after it is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

# OpenMP threads that sleep instead of spinning: on a shared two-core machine a spinning thread waiting
# for one that another process has descheduled made steps 10-25x slower (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from epserve import LLM, SamplingParams  # noqa: E402
from epserve.training import train_checkpoint  # noqa: E402
from epserve.training.corpus import load_corpus  # noqa: E402
from epserve.training.train import distill_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/trained")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--max-seconds", type=float, default=540.0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-train", action="store_true", help="only generate from an existing --out")
    ap.add_argument("--distill-from", default=None, help="only self-distil the MTP of this trained checkpoint")
    ap.add_argument("--prompt-words", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=60)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    out = Path(args.out)
    if args.distill_from:
        t0 = time.perf_counter()
        distill_checkpoint(args.distill_from, out, steps=args.steps, max_seconds=args.max_seconds, seed=args.seed)
        print(f"distill_checkpoint: {time.perf_counter() - t0:.1f} s wall")
        print("before:", json.dumps(json.loads((out / "training.json").read_text())["main_phase_heldout"]))
    elif not args.skip_train:
        t0 = time.perf_counter()
        train_checkpoint(out, args.preset, steps=args.steps, max_seconds=args.max_seconds, seed=args.seed)
        print(f"train_checkpoint: {time.perf_counter() - t0:.1f} s wall")
    summary = json.loads((out / "training.json").read_text())
    keys = ("parameters", "steps", "train_seconds", "total_seconds", "tokens_seen", "train_tokens")
    print(json.dumps({k: summary[k] for k in keys}, indent=1))
    print("final train:  ", json.dumps(summary["final_train"]))
    print("final heldout:", json.dumps(summary["final_heldout"]))

    llm = LLM(str(out), dtype="float32", device="cpu")
    paragraphs = [p for p in load_corpus().heldout if len(p.split()) > 3 * args.prompt_words][:3]
    prompts = [" ".join(p.split()[: args.prompt_words]) for p in paragraphs]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    print(f"generation: {time.perf_counter() - t0:.2f} s for {len(prompts)} prompts")
    for prompt, paragraph, o in zip(prompts, paragraphs, outputs):
        print(f"\nPROMPT:   {prompt}\nMODEL:    {o.text!r} ({o.finish_reason})")
        print(f"ORIGINAL: {paragraph[len(prompt):][:300]!r}")


if __name__ == "__main__":
    main()
