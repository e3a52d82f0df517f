"""Peak memory and time of loading a checkpoint, FP8 weights kept versus dequantized at load.

Each measurement runs in a fresh process: it imports epserve, reads its resident memory, loads the
model with the engine's loader (meta-device build, each tensor materialized once from positioned reads),
then reads its peak resident memory (``VmHWM``). The figure is the peak over the import baseline,
against the checkpoint's bytes on disk; the issue's bounds are 1.3x + 200 MB with FP8 kept and
2.6x + 200 MB dequantized to bf16.

    python benchmarks/load_memory.py                 # the `small` preset (~400M parameters), FP8
    python benchmarks/load_memory.py --layers 3      # shorter (what the test runs)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1e6
BOUNDS = {"fp8": 1.3, "none": 2.6}  # x checkpoint bytes, plus 200 MB


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(path: str, quantization: str) -> dict:
    """In this process (fresh): load ``path`` and report bytes and seconds."""
    import time

    import torch

    import epserve  # noqa: F401  (the baseline includes torch and epserve)
    from epserve.config import ModelConfig
    from epserve.model.load_plan import model_bytes
    from epserve.model.loader import load_model
    from epserve.moe.dispatch.local import LocalDispatcher
    from epserve.moe.placement import ExpertPlacement
    from epserve.parallel.context import ParallelContext

    base = _status("VmRSS")
    config = ModelConfig.from_hf(path)
    ctx = ParallelContext.single(torch.device("cpu"))
    placement = ExpertPlacement.build(config.n_routed_experts, 1)
    start = time.perf_counter()
    model = load_model(config, path, torch.bfloat16, ctx.device, LocalDispatcher(placement.num_local_slots),
                       placement, ctx, fp8=quantization == "fp8")
    seconds = time.perf_counter() - start
    ckpt = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    peak = _status("VmHWM") - base
    return {"quantization": quantization, "checkpoint_bytes": ckpt, "model_bytes": model_bytes(model),
            "peak_over_import_bytes": peak, "ratio": peak / ckpt, "load_s": seconds,
            "bound_bytes": BOUNDS[quantization] * ckpt + 200 * MB,
            "within_bound": peak <= BOUNDS[quantization] * ckpt + 200 * MB}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (shorter runs)")
    p.add_argument("--checkpoint", default=None, help="an FP8 checkpoint directory (default: generated)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--measure", nargs=2, metavar=("PATH", "QUANT"), help=argparse.SUPPRESS)  # child process
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            from epserve.presets import make_checkpoint

            overrides = {"num_hidden_layers": args.layers} if args.layers else None
            print(f"writing the {args.preset} FP8 checkpoint ...", file=sys.stderr)
            path = str(make_checkpoint(Path(tmp) / "ckpt", args.preset, fp8=True, overrides=overrides))
        rows = []
        for quant in ("fp8", "none"):
            proc = subprocess.run([sys.executable, __file__, "--measure", path, quant], capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"{'weights':<12}{'checkpoint MB':>14}{'kept MB':>10}{'peak MB':>10}{'peak/ckpt':>10}"
          f"{'bound MB':>10}{'load s':>8}")
    for r in rows:
        print(f"{'FP8 kept' if r['quantization'] == 'fp8' else 'bf16':<12}{r['checkpoint_bytes'] / MB:>14.0f}"
              f"{r['model_bytes'] / MB:>10.0f}{r['peak_over_import_bytes'] / MB:>10.0f}{r['ratio']:>10.2f}"
              f"{r['bound_bytes'] / MB:>10.0f}{r['load_s']:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
