"""What structured outputs cost, side by side in one run: the decode step with a JSON-schema constraint
on half the batch against none, and the grammar compile time (cold and cached) of the test schemas.

Decode: the median ``engine.step()`` of a steady batch (the `small` preset, bf16, its vocabulary widened
to DeepSeek-V3's 129280 by default; ``--vocab 0`` keeps 8192), half of whose requests (at batch 1, its one)
follow a JSON
schema that keeps them generating (an array of up to 200 small integers), against the same batch
unconstrained; rounds alternate. Compile: each schema of ``tests/engine/test_structured.py`` compiled
by a fresh compiler (cold), then again (the compiler's own cache of compiled grammars, keyed by the
constraint).

    .venv/bin/python benchmarks/structured_outputs.py --batches 1 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from common import median_step_ms, start_decode_batch, wide_vocab_checkpoint

from epserve import LLM, SamplingParams
from epserve.engine.structured import GrammarCompiler
from epserve.messages.sampling import StructuredOutput

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.engine.test_structured import SCHEMAS  # noqa: E402

LONG = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 200}},
        "required": ["xs"], "additionalProperties": False}


def decode_ms(llm: LLM, batch: int, constrained: bool, steps: int, seed: int) -> float:
    engine = llm.engine
    free = SamplingParams(temperature=0.8, top_p=0.95, ignore_eos=True)
    num_constrained = (batch // 2 or 1) if constrained else 0  # (batch 1: its one request)
    if constrained:  # queued first (compiled in the loop offline: here, by hand), prefilled with the rest
        structured = StructuredOutput("json_schema", json.dumps(LONG))
        grammar = engine.constraints.compile(structured)
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=steps + 2, structured=structured)
        for i in range(num_constrained):
            rid = f"c{seed}-{i}"
            engine.constraints.add(rid, grammar)
            engine.add_request(rid, list(range(10, 26)), params)
    start_decode_batch(engine, batch - num_constrained, 16, steps, seed, f"f{seed}", free)
    return median_step_ms(engine, steps)


def mtp_acceptance(model: str, device: str, k: int = 2) -> None:
    """Greedy MTP (k drafts) on the trained checkpoint's prose prompts: the share of drafts accepted
    unconstrained, and under a JSON schema (drafts come from the unconstrained MTP layer; verification
    masks them by the grammar)."""
    llm = LLM(model, dtype="bfloat16", device=device, speculative="mtp", num_speculative_tokens=k, num_blocks=512)
    prompts = ["The object", "In the following example, the", "A class definition", "If the", "Names"] * 2
    schema = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 200},
                                               "topics": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 30},
                                                          "maxItems": 4}},
              "required": ["summary", "topics"], "additionalProperties": False}
    for label, structured in (("unconstrained", None), ("json_schema", StructuredOutput("json_schema",
                                                                                        json.dumps(schema)))):
        before = llm.speculative_stats()
        llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, structured=structured))
        after = llm.speculative_stats()
        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        print(f"MTP k={k} {label}: {accepted}/{drafted} drafts accepted ({accepted / max(drafted, 1):.1%})",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=129280, help="vocabulary size (0: the preset's)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mtp-model", default=None,
                    help="a trained checkpoint with an MTP layer (epserve make-checkpoint DIR --train): MTP acceptance "
                    "with and without a JSON-schema constraint (and nothing else)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.mtp_model:
        mtp_acceptance(args.mtp_model, args.device)
        return
    path = wide_vocab_checkpoint(args.vocab)
    llm = LLM(path, dtype="bfloat16", device=args.device, num_blocks=4096, enable_prefix_caching=False,
              max_num_seqs=max(args.batches))
    mc = llm.config.model
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
                                f"{torch.__version__}, {args.device}", "vocab": mc.vocab_size, "decode": [],
                     "compile": {}}
    for batch in args.batches:
        decode_ms(llm, batch, False, 3, 0), decode_ms(llm, batch, True, 3, 1)  # warm-up
        off, on = [], []
        for r in range(args.rounds):
            off.append(decode_ms(llm, batch, False, args.steps, 10 + r))
            on.append(decode_ms(llm, batch, True, args.steps, 20 + r))
        row = {"batch": batch, "off_ms": statistics.median(off), "on_ms": statistics.median(on),
               "rounds_off": off, "rounds_on": on}
        row["ratio"] = row["on_ms"] / row["off_ms"]
        results["decode"].append(row)
        print(f"decode batch {batch} (half constrained): off {row['off_ms']:.2f} ms, on {row['on_ms']:.2f} ms "
              f"({row['ratio']:.3f}x)", flush=True)
    for name, schema in SCHEMAS.items():
        compiler = GrammarCompiler(path, mc.vocab_size, mc.eos_token_ids)
        compiler.compile(StructuredOutput("json_object"))  # (the tokenizer's tables, made once per compiler)
        spec = StructuredOutput("json_schema", json.dumps(schema))
        t = time.perf_counter()
        compiler.compile(spec)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        compiler.compile(spec)
        cached = time.perf_counter() - t
        results["compile"][name] = {"cold_ms": 1e3 * cold, "cached_ms": 1e3 * cached}
        print(f"compile {name}: cold {1e3 * cold:.1f} ms, cached {1e3 * cached:.2f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
