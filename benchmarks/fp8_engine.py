"""The FP8 runtime against the same checkpoint dequantized at load, side by side in one run: offline
throughput, weight bytes per rank, KV blocks in the same memory, and how long greedy paths run together.

    .venv/bin/python benchmarks/fp8_engine.py [--device cuda] [--num-prompts 16 --max-tokens 32]

Builds the `small` preset as published (FP8 e4m3, 128x128 block scales) once into the cache. On the CPU
the FP8 GEMMs run the torch reference (dequantizing a block at a time: correct, not fast), so there the
figure says what that reference costs; on CUDA they run the Triton / ``torch._scaled_mm`` kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from epserve import LLM, SamplingParams
from epserve.presets import make_checkpoint

VARIANTS = {  # label: LLM options
    "bf16 weights (dequantized), bf16 KV": {"quantization": None},
    "FP8 weights, bf16 KV": {"quantization": "fp8"},
    "FP8 weights, FP8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.expanduser("~/.cache/epserve/bench-small-fp8"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--memory-budget-gb", type=float, default=0.9, help="weights + KV, for the blocks figure")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    path = Path(args.checkpoint)
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", fp8=True, dtype="bfloat16", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 8000, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    num_out = args.num_prompts * args.max_tokens
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                f"torch {torch.__version__}, device {args.device}", "variants": {}}
    tokens = {}
    for label, options in VARIANTS.items():
        llm = LLM(path, device=args.device, memory_budget_bytes=int(args.memory_budget_gb * 2**30),
                  enable_prefix_caching=False, **options)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (and kernel builds)
        best = float("inf")
        for _ in tqdm(range(args.repeats), desc=label):
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            best = min(best, time.perf_counter() - start)
        tokens[label] = [o.token_ids for o in outs]
        runner = llm.engine.runner
        results["variants"][label] = {"tok_per_s": num_out / best, "weight_bytes": runner.weight_bytes,
                                      **llm.cache_info()}
        del llm, runner
    base_label = next(iter(VARIANTS))
    base = results["variants"][base_label]
    for label, row in results["variants"].items():
        row["speed_vs_bf16"] = row["tok_per_s"] / base["tok_per_s"]
        # Random weights have no logit margins: greedy paths part once a top-2 gap is smaller than the
        # numeric difference, and differ after. How long they run together is the comparable figure.
        lead = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                for x, y in zip(tokens[label], tokens[base_label])]
        row["greedy_tokens_before_parting_from_bf16"] = sum(lead) / len(lead)
    print(f"{'variant':<40}{'tok/s':>8}{'x bf16':>8}{'weights MB':>12}{'KV blocks':>10}{'tokens together':>16}")
    for label, row in results["variants"].items():
        print(f"{label:<40}{row['tok_per_s']:>8.1f}{row['speed_vs_bf16']:>8.2f}{row['weight_bytes'] / 1e6:>12.0f}"
              f"{row['num_blocks']:>10}{row['greedy_tokens_before_parting_from_bf16']:>16.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
