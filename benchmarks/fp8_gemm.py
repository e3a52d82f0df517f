"""Block-scaled FP8 GEMMs on one CUDA GPU: the Triton kernel, blockwise ``torch._scaled_mm`` and a
bf16 ``F.linear`` on DeepSeek-V3 shapes, then the grouped Triton GEMM on a routed-expert batch.

    python3 benchmarks/fp8_gemm.py [--json out.json] [--repeats 20]

Each timing is the median over ``--repeats`` runs by CUDA events, with the L2 cache flushed before every
run (decode-sized GEMMs would otherwise read their weights from L2). Correctness: max |out - ref| /
max |ref| of each path against the fp32 reference (``block_fp8_gemm_ref``) and against bf16 math on the
dequantized weight. Needs CUDA; exits with a message otherwise. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from epserve.kernels import fp8, fp8_scaled_mm
from epserve.kernels.fp8 import BLOCK, FP8_DTYPE, cdiv

HIDDEN, MOE_INTER, Q_LORA = 7168, 2048, 1536  # DeepSeek-V3
SHAPES = {  # name: (N, K) of y = x W^T, W [N, K]
    "expert w2 / down (7168x2048)": (HIDDEN, MOE_INTER),
    "q_b (24576x1536)": (128 * 192, Q_LORA),
    "expert w13 / gate_up (4096x7168)": (2 * MOE_INTER, HIDDEN),
}
ROWS = (1, 16, 128, 4096)
GROUPED = {"local experts": 32, "rows": (256, 4096)}


def timed(fn: Callable[[], object], repeats: int, flush: torch.Tensor) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after 3 warm-up runs, L2 flushed before each."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def random_fp8_weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weight [..., N, K] with 128x128 scales, values spread like a trained layer's (~N(0, 0.02))."""
    w = (torch.randn(*shape, device="cuda") * 64).clamp(-448, 448).to(FP8_DTYPE)
    tiles = (*shape[:-2], cdiv(shape[-2], BLOCK), cdiv(shape[-1], BLOCK))
    return w, torch.rand(*tiles, device="cuda") * 6e-4 + 2e-4


def dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w.shape[-2:]
    full = scale.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[..., :n, :k]
    return (w.float() * full).bfloat16()


def bench_gemm(repeats: int, flush: torch.Tensor, scaled_mm_ok: bool) -> list[dict]:
    from epserve.kernels import fp8_triton

    rows = []
    for name, (n, k) in SHAPES.items():
        w, ws = random_fp8_weight(n, k)
        w_bf16 = dequant(w, ws)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q, s = fp8_triton.act_quant_triton(x)
            ref = fp8.block_fp8_gemm_ref(q, s, w, ws, torch.float32)
            paths: dict[str, Callable[[], object]] = {
                "triton": partial(fp8_triton.block_fp8_gemm_triton, q, s, w, ws, torch.bfloat16),
                "bf16 F.linear": partial(F.linear, x, w_bf16),
                "act_quant (triton)": partial(fp8_triton.act_quant_triton, x),
            }
            if scaled_mm_ok and fp8_scaled_mm._scaled_mm_eligible(q, w, ws, torch.bfloat16):
                paths["_scaled_mm"] = partial(fp8_scaled_mm._scaled_mm, q, s, w, ws, torch.bfloat16)
            bf16_out = F.linear(x, w_bf16)
            for path, fn in paths.items():
                t = timed(fn, repeats, flush)
                row = {"shape": name, "M": m, "N": n, "K": k, "path": path, "us": t * 1e6}
                if path != "act_quant (triton)":
                    out = fn()
                    weight_bytes = n * k * (2 if path.startswith("bf16") else 1)
                    row |= {"tflops": 2 * m * n * k / t / 1e12, "weight_GBps": weight_bytes / t / 1e9,
                            "rel_err_vs_ref": rel_err(out, ref), "rel_err_vs_bf16": rel_err(out, bf16_out)}
                rows.append(row)
                print_row(row)
    return rows


def routed_counts(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per local expert for ``rows`` routed rows, expert popularity skewed (hot and cold experts;
    at decode sizes some get none)."""
    popularity = torch.rand(experts, generator=gen) ** 2 + 0.05
    return torch.multinomial(popularity, rows, replacement=True, generator=gen).bincount(minlength=experts)


def bench_grouped(repeats: int, flush: torch.Tensor) -> list[dict]:
    from epserve.kernels import fp8_triton

    e, gen, rows_out = GROUPED["local experts"], torch.Generator().manual_seed(0), []
    weights = {"w13 (4096x7168)": random_fp8_weight(e, 2 * MOE_INTER, HIDDEN),
               "w2 (7168x2048)": random_fp8_weight(e, HIDDEN, MOE_INTER)}
    for name, (w, ws) in weights.items():
        n, k = w.shape[1:]
        w_bf16 = dequant(w, ws)
        for r in GROUPED["rows"]:
            counts = routed_counts(r, e, gen).cuda()
            x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
            q, s = fp8_triton.act_quant_triton(x)
            ref = fp8.grouped_block_fp8_gemm_ref(q, s, w, ws, counts, torch.float32)
            offs = counts.cumsum(0).to(torch.int32)
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "triton grouped": partial(fp8_triton.grouped_block_fp8_gemm_triton, q, s, w, ws, counts,
                                          torch.bfloat16)}
            if hasattr(torch, "_grouped_mm"):
                w_t = w_bf16.transpose(1, 2)
                paths["bf16 torch._grouped_mm"] = partial(torch._grouped_mm, x, w_t, offs=offs)
            for path, fn in paths.items():
                try:
                    t = timed(fn, repeats, flush)
                except RuntimeError as err:  # e.g. _grouped_mm unsupported here
                    print(f"  {path}: unavailable ({str(err).splitlines()[0][:100]})")
                    continue
                active = int((counts > 0).sum())
                weight_bytes = active * n * k * (2 if path.startswith("bf16") else 1)
                row = {"shape": name, "M": r, "N": n, "K": k, "experts": e, "active_experts": active,
                       "path": path, "us": t * 1e6, "tflops": 2 * r * n * k / t / 1e12,
                       "weight_GBps": weight_bytes / t / 1e9, "rel_err_vs_ref": rel_err(fn(), ref)}
                rows_out.append(row)
                print_row(row)
    return rows_out


def print_row(row: dict) -> None:
    extra = "".join(f" {k}={row[k]:.2e}" for k in ("rel_err_vs_ref", "rel_err_vs_bf16") if k in row)
    perf = f"{row['tflops']:7.1f} TFLOP/s {row['weight_GBps']:7.0f} GB/s" if "tflops" in row else " " * 31
    print(f"  {row['shape']:34s} M={row['M']:5d} {row['path']:22s} {row['us']:9.1f} us {perf}{extra}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing to measure")
    import triton

    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > L2 (50 MB on H100/H200)
    scaled_mm_ok = fp8.scaled_mm_supported("cuda")
    print(f"{props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}")
    print("blockwise torch._scaled_mm (1x128, 128x128):", "supported" if scaled_mm_ok else "NOT supported")
    print("block FP8 GEMM, y[M, N] = x[M, K] W[N, K]^T, bf16 out:")
    gemm = bench_gemm(args.repeats, flush, scaled_mm_ok)
    print(f"grouped FP8 GEMM over {GROUPED['local experts']} local experts (skewed routing):")
    grouped = bench_grouped(args.repeats, flush)
    if args.json:
        result = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
                  "cuda": torch.version.cuda, "scaled_mm_supported": scaled_mm_ok, "repeats": args.repeats,
                  "gemm": gemm, "grouped": grouped}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
