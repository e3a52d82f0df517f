"""Decode step time, eager against captured, side by side in one run, with the weight-streaming bound.

Captured = the decode forward as one graph per batch bucket: ``torch.compile(fullgraph=True)`` on the
CPU (``compile=True``), CUDA graphs on a GPU (``cuda_graph``). Both engines run the same steady decode
batch of the `small` preset (bf16), the step timed with ``engine.step()`` (forward, sampling and the
scheduler: what a request waits for).

    .venv/bin/python benchmarks/decode_capture.py                         # CPU, batch 16
    python3 benchmarks/decode_capture.py --device cuda --batches 1 16 64  # GPU (gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from offline_throughput import decode_step_profile, measure_bandwidth

from epserve import LLM
from epserve.presets import make_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.expanduser("~/.cache/epserve/bench-small"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds per engine")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = Path(args.checkpoint)
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype="bfloat16", seed=0)
    cuda = args.device.startswith("cuda")
    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                f"torch {torch.__version__}, device {args.device}",
                     "read_bandwidth_GBps": measure_bandwidth(args.device) / 1e9, "rows": []}
    bw = results["read_bandwidth_GBps"] * 1e9
    max_batch = max(args.batches)
    modes = {"eager": {"cuda_graph": False} if cuda else {},
             "captured": {"cuda_graph": True} if cuda else {"compile": True}}
    engines = {mode: LLM(path, dtype="bfloat16", device=args.device, num_blocks=2048, enable_prefix_caching=False,
                         max_num_seqs=max_batch, cuda_graph_max_bs=max_batch, **options)
               for mode, options in modes.items()}
    for batch in args.batches:
        rows = {}
        for mode, llm in engines.items():
            start = time.perf_counter()
            decode_step_profile(llm, batch, args.prompt_len, steps=3, seed=batch)  # warm-up: compile / capture
            rows[mode] = {"mode": mode, "batch": batch, "warmup_s": time.perf_counter() - start, "rounds_ms": []}
        for r in range(args.rounds):  # alternate the engines, so drift on a shared machine hits both alike
            for mode, llm in engines.items():
                prof = decode_step_profile(llm, batch, args.prompt_len, steps=args.steps, seed=100 * r + batch)
                rows[mode]["rounds_ms"].append(prof["step_ms_median"])
                rows[mode]["bytes_per_step"] = prof["bytes_per_step"]
        for row in rows.values():
            row["step_ms_median"] = sorted(row["rounds_ms"])[len(row["rounds_ms"]) // 2]
            row["bound_ms"] = 1e3 * row["bytes_per_step"] / bw
            results["rows"].append(row)
        ratio = rows["eager"]["step_ms_median"] / rows["captured"]["step_ms_median"]
        rows["captured"]["speedup_vs_eager"] = ratio
        print(f"batch {batch}: eager {rows['eager']['step_ms_median']:.1f} ms, captured "
              f"{rows['captured']['step_ms_median']:.1f} ms ({ratio:.2f}x; rounds {rows['eager']['rounds_ms']} vs "
              f"{rows['captured']['rounds_ms']}), bound {rows['captured']['bound_ms']:.1f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
