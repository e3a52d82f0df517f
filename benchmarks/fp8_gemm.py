"""Block-scaled FP8 GEMMs on one CUDA GPU at DeepSeek-V3's decode shapes: the Triton kernel, blockwise
``torch._scaled_mm`` and cuBLAS bf16 (``F.linear`` on the dequantized weight), then the grouped Triton GEMM
over one EP8 shard's 32 experts against the weight-streaming floor and per-expert loops.

    python3 benchmarks/fp8_gemm.py [--json out.json] [--repeats 20]

Shapes (``gpu_figures.gemm_shapes``): qkv_a_proj, q_b_proj, ``o_proj`` 7168x16384 (128 heads), the dense MLP's
gate_up 36864x7168 and down 7168x18432, an expert's gate_up and down, at M = 1, 16, 64, 128, 4096. Each row has
TFLOP/s, weight GB/s, and where measured ``pct_of_scaled_mm`` (TFLOP/s as % of ``_scaled_mm``'s at the same
shape and M) and ``weight_pct_of_copy`` (weight GB/s as % of the copy bandwidth, when ``copy_TBps`` is known).

Grouped: 32 experts with 1, 2, 4, 8, 16 real rows each, without padding (R = real rows) and with padding
(R = 32 x 64: the real rows first, the rest padding rows, as a padded dispatch hands them over), plus two skewed
prefill-sized batches; paths: the Triton grouped GEMM (with padding also as the dispatcher calls it: the row
tile from the real rows an expert gets, padding rows neither read nor written; ``tile_m`` says which), a
per-expert loop of cuBLAS bf16 and of ``_scaled_mm`` (where accepted), bf16 ``torch._grouped_mm`` where it runs;
each against the floor of streaming the active experts' FP8 weights once (``floor_us``, ``pct_of_floor``).

Each timing is the median over ``--repeats`` runs by CUDA events, with the L2 cache flushed before every
run (decode-sized GEMMs would otherwise read their weights from L2). Correctness: max |out - ref| /
max |ref| of each path against the fp32 reference (``block_fp8_gemm_ref``) and against bf16 math on the
dequantized weight. Needs CUDA: without it, says so and exits with status 2 (``{"status": "skipped"}`` to
``--json``). About a minute on an H100 or H200.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from gpu_figures import (
    GEMM_ROWS,
    GROUPED_CAPACITY,
    GROUPED_ROWS_PER_EXPERT,
    LOCAL_EXPERTS,
    V3,
    JsonProgress,
    floor_s,
    fp8_weight_bytes,
    gemm_flops,
    gemm_shapes,
    pct,
    write_skipped,
)

from epserve.kernels import fp8, fp8_scaled_mm
from epserve.kernels.fp8 import BLOCK, FP8_DTYPE, cdiv

SHAPES = gemm_shapes()  # name: (N, K) of y = x W^T, W [N, K]: DeepSeek-V3's decode GEMMs
ROWS = GEMM_ROWS
HIDDEN, MOE_INTER = V3["hidden"], V3["moe_intermediate"]
# the grouped GEMM over one EP8 shard: decode sizes (real rows per expert, without and with padding rows after
# them, as a padded layout hands them over) and two skewed prefill-sized batches
GROUPED: dict[str, Any] = {
    "local experts": LOCAL_EXPERTS, "rows per expert": GROUPED_ROWS_PER_EXPERT, "capacity": GROUPED_CAPACITY,
    "rows": (256, 4096), "shapes": {f"w13 ({2 * MOE_INTER}x{HIDDEN})": (2 * MOE_INTER, HIDDEN),
                                    f"w2 ({HIDDEN}x{MOE_INTER})": (HIDDEN, MOE_INTER)}}
DEVICE = "cuda"  # gpu_micro.py --smoke: "cpu", the Triton kernels under their interpreter, tiny shapes
Save = Callable[[], None]


def _no_save() -> None:
    pass


def timed(fn: Callable[[], object], repeats: int, flush: torch.Tensor) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after 3 warm-up runs, L2 flushed before each (CUDA events;
    off CUDA, a smoke run's host clock)."""
    for _ in range(3):
        fn()
    times = []
    if DEVICE != "cuda":
        for _ in range(repeats):
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
        return statistics.median(times)
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_TBps(repeats: int = 10, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s (``nbytes`` copied, bytes read plus written, as ``gpu_micro.py``'s
    copy part counts them): the ceiling a streaming floor is read against."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    t = timed(partial(dst.copy_, src), repeats, flush)
    del src, dst, flush
    torch.cuda.empty_cache()
    return 2 * nbytes / t / 1e12


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30))


def random_fp8_weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weight [..., N, K] with 128x128 scales, values spread like a trained layer's (~N(0, 0.02))."""
    w = (torch.randn(*shape, device=DEVICE) * 64).clamp(-448, 448).to(FP8_DTYPE)
    tiles = (*shape[:-2], cdiv(shape[-2], BLOCK), cdiv(shape[-1], BLOCK))
    return w, torch.rand(*tiles, device=DEVICE) * 6e-4 + 2e-4


def dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 of an fp8 weight [..., N, K] (one matrix at a time: a [32, 4096, 7168] stack in fp32 is 3.8 GB)."""
    if w.dim() > 2:
        return torch.stack([dequant(w[i], scale[i]) for i in range(w.shape[0])])
    n, k = w.shape
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return (w.float() * full).bfloat16()


def _compare_to_scaled_mm(rows: list[dict[str, Any]]) -> None:
    """Each row of one (shape, M) with TFLOP/s gets ``pct_of_scaled_mm`` where ``_scaled_mm`` was timed."""
    ref = next((r["tflops"] for r in rows if r["path"] == "_scaled_mm" and "tflops" in r), None)
    if ref:
        for r in rows:
            if "tflops" in r:
                r["pct_of_scaled_mm"] = pct(r["tflops"], ref)


def bench_gemm(repeats: int, flush: torch.Tensor, scaled_mm_ok: bool, rows: list[dict] | None = None,
               save: Save = _no_save, copy_TBps: float | None = None) -> list[dict]:
    """Every shape of ``SHAPES`` at every M of ``ROWS``: rows appended to ``rows`` (and ``save()`` called)
    as each is measured."""
    from epserve.kernels import fp8_triton

    rows = [] if rows is None else rows
    for name, (n, k) in SHAPES.items():
        w, ws = random_fp8_weight(n, k)
        w_bf16 = dequant(w, ws)
        for m in ROWS:
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            q, s = fp8_triton.act_quant_triton(x)
            ref = fp8.block_fp8_gemm_ref(q, s, w, ws, torch.float32)
            paths: dict[str, Callable[[], object]] = {
                "triton": partial(fp8_triton.block_fp8_gemm_triton, q, s, w, ws, torch.bfloat16),
                "cuBLAS bf16 F.linear": partial(F.linear, x, w_bf16),
                "act_quant (triton)": partial(fp8_triton.act_quant_triton, x),
            }
            if scaled_mm_ok and fp8_scaled_mm._scaled_mm_eligible(q, w, ws, torch.bfloat16):
                paths["_scaled_mm"] = partial(fp8_scaled_mm._scaled_mm, q, s, w, ws, torch.bfloat16)
            bf16_out = F.linear(x, w_bf16)
            same_shape: list[dict[str, Any]] = []
            for path, fn in paths.items():
                row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k, "path": path}
                try:
                    t = timed(fn, repeats, flush)
                except Exception as e:  # noqa: BLE001 - one path failing (a Triton compile error too) leaves the rest
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    print(f"  {name:34s} M={m:5d} {path:22s} failed: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                row["us"] = t * 1e6
                if path != "act_quant (triton)":
                    out = fn()
                    weight_bytes = n * k * 2 if path.startswith("cuBLAS") else fp8_weight_bytes(n, k)
                    row |= {"tflops": gemm_flops(m, n, k) / t / 1e12, "weight_GBps": weight_bytes / t / 1e9,
                            "rel_err_vs_ref": rel_err(out, ref), "rel_err_vs_bf16": rel_err(out, bf16_out)}
                    if copy_TBps:
                        row["weight_pct_of_copy"] = pct(row["weight_GBps"], copy_TBps * 1e3)
                rows.append(row)
                same_shape.append(row)
                _compare_to_scaled_mm(same_shape)
                print_row(row)
                save()
            del x, q, s, ref, bf16_out
        del w, ws, w_bf16
        torch.cuda.empty_cache()
    return rows


def routed_counts(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """Rows per local expert for ``rows`` routed rows, expert popularity skewed (hot and cold experts;
    at decode sizes some get none)."""
    popularity = torch.rand(experts, generator=gen) ** 2 + 0.05
    return torch.multinomial(popularity, rows, replacement=True, generator=gen).bincount(minlength=experts)


def grouped_cases(experts: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor, int]]:
    """(case, counts [E], rows R): decode sizes with every expert at 1..16 real rows, without padding
    (R = sum) and with padding rows after them (R = E x capacity); then skewed prefill-sized batches."""
    cases = []
    for per in GROUPED["rows per expert"]:
        counts = torch.full((experts,), per, dtype=torch.int64)
        cases.append((f"{per}/expert", counts, experts * per))
        cases.append((f"{per}/expert padded to {GROUPED['capacity']}", counts, experts * GROUPED["capacity"]))
    for r in GROUPED["rows"]:
        cases.append((f"{r} rows skewed", routed_counts(r, experts, gen), r))
    return cases


def _bf16_loop(parts: list[tuple[int, int, int]], x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """cuBLAS bf16, one expert at a time: ``out[lo:hi] = x[lo:hi] @ w[e]^T`` for each (e, lo, hi)."""
    for e, lo, hi in parts:
        torch.matmul(x[lo:hi], w[e].t(), out=out[lo:hi])


def _scaled_mm_loop(parts: list[tuple[int, int, int]], q: torch.Tensor, scales: list[torch.Tensor], w: torch.Tensor,
                    ws: torch.Tensor, out: torch.Tensor) -> None:
    """Blockwise ``_scaled_mm``, one expert at a time (each expert's activation scales already M-major)."""
    for (e, lo, hi), s in zip(parts, scales):
        out[lo:hi] = fp8_scaled_mm._scaled_mm(q[lo:hi], s, w[e], ws[e], torch.bfloat16)


def bench_grouped(repeats: int, flush: torch.Tensor, rows_out: list[dict] | None = None, save: Save = _no_save,
                  copy_TBps: float | None = None, scaled_mm_ok: bool = False) -> list[dict]:
    """The grouped FP8 GEMM over one EP8 shard (``grouped_cases``), rows appended to ``rows_out`` as measured."""
    from epserve.kernels import fp8_triton

    e, gen = GROUPED["local experts"], torch.Generator().manual_seed(0)
    rows_out = [] if rows_out is None else rows_out
    for name, (n, k) in GROUPED["shapes"].items():
        w, ws = random_fp8_weight(e, n, k)
        w_bf16 = dequant(w, ws)
        for case, counts_cpu, r in grouped_cases(e, gen):
            counts = counts_cpu.to(DEVICE)
            real = int(counts_cpu.sum())
            x = torch.randn(r, k, device=DEVICE, dtype=torch.bfloat16)
            q, s = fp8_triton.act_quant_triton(x)
            ref = fp8.grouped_block_fp8_gemm_ref(q, s, w, ws, counts, torch.float32)[:real]
            ends = counts_cpu.cumsum(0).tolist()
            parts = [(i, end - int(c), end) for i, (c, end) in enumerate(zip(counts_cpu.tolist(), ends)) if c]
            active = len(parts)
            grouped = fp8_triton.grouped_block_fp8_gemm_triton
            paths: dict[str, Callable[[], Any]] = {"triton grouped": partial(grouped, q, s, w, ws, counts,
                                                                             torch.bfloat16)}
            tiles = {"triton grouped": (r, None)}
            if r > real and {"rows_per_expert", "masked"} <= inspect.signature(grouped).parameters.keys():
                # as the dispatcher calls it: the tile from the real rows an expert gets, padding rows untouched
                masked = "triton grouped (real-row tile, masked)"
                paths[masked] = partial(grouped, q, s, w, ws, counts, torch.bfloat16, rows_per_expert=real / e,
                                        masked=True)
                tiles[masked] = (r, real / e)
            out_loop = torch.empty(real, n, device=DEVICE, dtype=torch.bfloat16)
            paths["cuBLAS bf16 per-expert loop"] = partial(_bf16_loop, parts, x, w_bf16, out_loop)
            if scaled_mm_ok and fp8_scaled_mm._scaled_mm_eligible(q, w[0], ws[0], torch.bfloat16):
                scales = [s[lo:hi].t().contiguous().t() for _, lo, hi in parts]  # M-major, as _scaled_mm takes
                paths["_scaled_mm per-expert loop"] = partial(_scaled_mm_loop, parts, q, scales, w, ws, out_loop)
            if hasattr(torch, "_grouped_mm"):
                offs = counts.cumsum(0).to(torch.int32)
                paths["bf16 torch._grouped_mm"] = partial(torch._grouped_mm, x, w_bf16.transpose(1, 2), offs=offs)
            floor = floor_s(active * fp8_weight_bytes(n, k), copy_TBps) if copy_TBps else None
            for path, fn in paths.items():
                row: dict[str, Any] = {"shape": name, "case": case, "M": r, "real_rows": real, "N": n, "K": k,
                                       "experts": e, "active_experts": active, "path": path}
                try:
                    t = timed(fn, repeats, flush)
                    result = fn()
                except Exception as err:  # noqa: BLE001 - e.g. _grouped_mm unsupported here
                    row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                    rows_out.append(row)
                    print(f"  {name} {case} {path}: unavailable ({str(err).splitlines()[0][:100]})", flush=True)
                    continue
                got = out_loop if result is None else result[:real]
                weight_bytes = active * (n * k * 2 if "bf16" in path else fp8_weight_bytes(n, k))
                row |= {"us": t * 1e6, "tflops": gemm_flops(real, n, k) / t / 1e12,
                        "weight_GBps": weight_bytes / t / 1e9, "rel_err_vs_ref": rel_err(got, ref)}
                tile_m = getattr(fp8_triton, "grouped_tile_m", None)
                if path in tiles and tile_m is not None:
                    row["tile_m"] = tile_m(tiles[path][0], e, tiles[path][1])
                if floor:
                    row |= {"floor_us": floor * 1e6, "pct_of_floor": pct(floor, t)}
                rows_out.append(row)
                print_row(row)
                save()
            del x, q, s, ref, out_loop
        del w, ws, w_bf16
        torch.cuda.empty_cache()
    return rows_out


def print_row(row: dict) -> None:
    extra = "".join(f" {k}={row[k]:.2e}" for k in ("rel_err_vs_ref", "rel_err_vs_bf16") if k in row)
    extra += "".join(f" {k}={row[k]:.0f}%" for k in ("pct_of_scaled_mm", "weight_pct_of_copy", "pct_of_floor")
                     if k in row)
    perf = f"{row['tflops']:7.1f} TFLOP/s {row['weight_GBps']:7.0f} GB/s" if "tflops" in row else " " * 31
    label = f"{row['shape']} {row['case']}" if "case" in row else row["shape"]
    print(f"  {label:40s} M={row['M']:5d} {row['path']:28s} {row['us']:9.1f} us {perf}{extra}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rewritten as they come)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        reason = "fp8_gemm.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing to measure"
        write_skipped(args.json, reason)
        print(reason, file=sys.stderr)
        sys.exit(2)
    import triton

    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > L2 (50 MB on H100/H200)
    scaled_mm_ok = fp8.scaled_mm_supported("cuda")
    print(f"{props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}")
    print("blockwise torch._scaled_mm (1x128, 128x128):", "supported" if scaled_mm_ok else "NOT supported")
    result: dict[str, Any] = {"device": props.name, "torch": torch.__version__, "triton": triton.__version__,
                              "cuda": torch.version.cuda, "scaled_mm_supported": scaled_mm_ok,
                              "repeats": args.repeats, "gemm": [], "grouped": []}
    out = JsonProgress(args.json, result)
    print("block FP8 GEMM, y[M, N] = x[M, K] W[N, K]^T, bf16 out:")
    bench_gemm(args.repeats, flush, scaled_mm_ok, result["gemm"], out.save)
    print(f"grouped FP8 GEMM over {GROUPED['local experts']} local experts:")
    bench_grouped(args.repeats, flush, result["grouped"], out.save, scaled_mm_ok=scaled_mm_ok)
    out.finish()
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
