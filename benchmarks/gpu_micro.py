"""The kernel figures of one CUDA GPU against its ceilings, in one JSON.

    python3 benchmarks/gpu_micro.py [--json micro.json] [--repeats 10] [--parts copy gemm grouped mla]

- copy: device-to-device copy bandwidth (``dst.copy_(src)`` of 2 GiB, bytes read plus written, as the
  4.3 TB/s seen on the H200 counts them) and a bf16 8192^3 ``torch.matmul`` (the dense TFLOP/s ceiling).
- gemm: the block-scaled FP8 GEMM on DeepSeek-V3 shapes at M = 1, 16, 128, 4096: our Triton kernel,
  blockwise ``torch._scaled_mm`` (where the probe accepts it) and bf16 ``F.linear`` on the dequantized
  weight (``fp8_gemm.bench_gemm``: TFLOP/s, weight GB/s, error against the fp32 reference).
- grouped: the grouped FP8 GEMM over one EP8 shard's 32 experts (``fp8_gemm.bench_grouped``).
- mla: paged MLA decode (DeepSeek's 512 + 64 latent, 16 heads: one TP-8 shard of 128) at batch 1, 16 and
  64 with 4096-token contexts, 16-token blocks in shuffled order: our Triton kernel (bf16 and FP8
  caches) and FlashInfer's (bf16; where it imports and its self-test passes; its plan, one per step, timed
  apart), in GB/s of cache read, each checked against the torch reference.

Each timing is the median over ``--repeats`` runs by CUDA events after warm-ups, the L2 cache flushed
before each run (``fp8_gemm.timed``). Needs CUDA: without it, says so and exits with status 2 (after
writing ``{"status": "skipped"}`` to ``--json``). About a minute on an H200, the first Triton and
FlashInfer builds included when their caches are warm.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from fp8_gemm import bench_gemm, bench_grouped, rel_err, timed

PARTS = ("copy", "gemm", "grouped", "mla")
COPY_BYTES = 2 << 30
MATMUL = 8192
MLA = {"batches": (1, 16, 64), "context": 4096, "heads": 16, "block_size": 16, "kv_lora_rank": 512, "rope": 64}


def bench_copy(repeats: int, flush: torch.Tensor) -> dict[str, Any]:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    t = timed(partial(dst.copy_, src), repeats, flush)
    assert torch.equal(dst[:4096], src[:4096])
    del src, dst
    a, b = (torch.randn(MATMUL, MATMUL, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tm = timed(partial(torch.matmul, a, b), repeats, flush)
    out = {"copy_bytes": COPY_BYTES, "copy_us": t * 1e6, "copy_TBps": 2 * COPY_BYTES / t / 1e12,
           "bf16_matmul_shape": [MATMUL] * 3, "bf16_matmul_us": tm * 1e6,
           "bf16_matmul_tflops": 2 * MATMUL**3 / tm / 1e12}
    print(f"  copy {COPY_BYTES / 2**30:.0f} GiB: {out['copy_TBps']:.2f} TB/s (read + written); bf16 matmul "
          f"{MATMUL}^3: {out['bf16_matmul_tflops']:.0f} TFLOP/s", flush=True)
    return out


def _mla_case(batch: int, cache_dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    ctx, bs, d = MLA["context"], MLA["block_size"], MLA["kv_lora_rank"] + MLA["rope"]
    blocks = batch * ctx // bs
    tables = torch.randperm(blocks, generator=gen).view(batch, ctx // bs).to("cuda", torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, MLA["heads"], d, generator=gen).cuda()
    latent = torch.randn(blocks, bs, d, device="cuda")
    if cache_dtype == torch.bfloat16:
        return q, latent.to(cache_dtype), tables, lens, None
    kv_scale = torch.tensor(0.02, device="cuda")  # latent / 0.02 in e4m3, as the engine's FP8 cache holds it
    return q, (latent / kv_scale).clamp(-448, 448).to(cache_dtype), tables, lens, kv_scale


def bench_mla(repeats: int, flush: torch.Tensor, use_flashinfer: bool) -> dict[str, Any]:
    from epserve.kernels import backends
    from epserve.kernels import mla_decode_triton as mt
    from epserve.kernels.fp8 import FP8_DTYPE
    from epserve.kernels.mla_decode import paged_mla_decode_ref

    r = MLA["kv_lora_rank"]
    scale = (MLA["rope"] + 128) ** -0.5
    flashinfer: dict[str, Any] = {"used": False}
    if use_flashinfer:
        lines: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger(backends.__name__).addHandler(handler)
        try:
            from epserve.kernels import mla_flashinfer as mf

            mf.import_flashinfer()
            start = time.perf_counter()
            chosen = backends.select("mla_decode", torch.device("cuda"), torch.bfloat16)  # its self-test
            flashinfer = {"used": chosen == "flashinfer", "selected": chosen, "decided_s": time.perf_counter() - start,
                          "log": lines}
            if chosen != "flashinfer":
                flashinfer["why"] = "; ".join(lines) or f"the registry chose {chosen}"
        except ImportError as e:
            flashinfer = {"used": False, "why": f"{type(e).__name__}: {e}"}
        finally:
            logging.getLogger(backends.__name__).removeHandler(handler)
    else:
        flashinfer["why"] = "--no-flashinfer"
    print(f"  FlashInfer MLA: {'used' if flashinfer['used'] else 'not used: ' + flashinfer['why']}", flush=True)
    gen, rows = torch.Generator().manual_seed(0), []
    for cache_dtype, dtype_name in ((torch.bfloat16, "bf16"), (FP8_DTYPE, "fp8")):
        for batch in MLA["batches"]:
            q, cache, tables, lens, kv_scale = _mla_case(batch, cache_dtype, gen)
            ref = paged_mla_decode_ref(q, cache, tables, lens, scale, r, kv_scale)
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "triton": partial(mt.paged_mla_decode_triton, q, cache, tables, lens, scale, r, kv_scale)}
            plan_us = None
            if flashinfer["used"] and kv_scale is None:
                planner = mf._planner(q.device)
                planner.plans.clear()
                torch.cuda.synchronize()
                start = time.perf_counter()
                mf.paged_mla_decode_flashinfer(q, cache, tables, lens, scale, r)  # plans (a host sync), runs
                torch.cuda.synchronize()
                plan_us = (time.perf_counter() - start) * 1e6
                paths["flashinfer"] = partial(mf.paged_mla_decode_flashinfer, q, cache, tables, lens, scale, r)
            cache_bytes = batch * MLA["context"] * cache.shape[-1] * cache.element_size()
            for path, fn in paths.items():
                try:
                    t = timed(fn, repeats, flush)
                    err = rel_err(fn(), ref)
                except RuntimeError as e:
                    print(f"  mla {dtype_name} B={batch} {path}: failed ({str(e).splitlines()[0][:120]})", flush=True)
                    rows.append({"cache": dtype_name, "batch": batch, "path": path, "error": str(e)[:300]})
                    continue
                row = {"cache": dtype_name, "batch": batch, "context": MLA["context"], "heads": MLA["heads"],
                       "block_size": MLA["block_size"], "path": path, "us": t * 1e6,
                       "cache_GBps": cache_bytes / t / 1e9, "rel_err_vs_ref": err}
                if path == "flashinfer":
                    row["first_call_with_plan_us"] = plan_us
                rows.append(row)
                print(f"  mla {dtype_name:4s} B={batch:3d} ctx={MLA['context']} h={MLA['heads']} {path:10s} "
                      f"{t * 1e6:8.1f} us {cache_bytes / t / 1e9:7.0f} GB/s  rel_err {err:.1e}", flush=True)
            del q, cache, tables, lens, ref
    return {"shape": dict(MLA), "flashinfer": flashinfer, "rows": rows}


def key_figures(result: dict[str, Any]) -> dict[str, Any]:
    """What a summary shows: the copy and matmul ceilings, the best FP8 GEMM TFLOP/s per path at M = 4096
    and weight GB/s at M = 1, and the MLA decode GB/s per cache, path and batch."""
    f: dict[str, Any] = {}
    if "copy" in result:
        f["copy_TBps"] = round(result["copy"]["copy_TBps"], 3)
        f["bf16_matmul_tflops"] = round(result["copy"]["bf16_matmul_tflops"], 1)
    for row in result.get("gemm", []):
        if "tflops" not in row:
            continue
        if row["M"] == 4096:
            key = f"gemm M=4096 {row['path']} max TFLOP/s"
            f[key] = round(max(f.get(key, 0.0), row["tflops"]), 1)
        if row["M"] == 1:
            key = f"gemm M=1 {row['path']} max weight GB/s"
            f[key] = round(max(f.get(key, 0.0), row["weight_GBps"]), 0)
    for row in result.get("grouped", []):
        f[f"grouped {row['shape'].split()[0]} rows={row['M']} {row['path']} TFLOP/s"] = round(row["tflops"], 1)
    for row in result.get("mla", {}).get("rows", []):
        if "cache_GBps" in row:
            f[f"mla {row['cache']} B={row['batch']} {row['path']} GB/s"] = round(row["cache_GBps"], 0)
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--no-flashinfer", action="store_true", help="time the Triton MLA decode only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        reason = "gpu_micro.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing to measure"
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"status": "skipped", "reason": reason}))
        print(reason, file=sys.stderr)
        sys.exit(2)
    import triton

    from epserve.kernels import fp8

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("epserve").setLevel(logging.INFO)  # the kernel registry's decisions

    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # > L2 (50-60 MB on H100/H200)
    result: dict[str, Any] = {"device": props.name, "sm": f"{props.major}{props.minor}", "torch": torch.__version__,
                              "triton": triton.__version__, "cuda": torch.version.cuda, "repeats": args.repeats}
    print(f"{props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    failures = []
    for part in args.parts:
        start = time.perf_counter()
        print(f"{part}:", flush=True)
        try:
            if part == "copy":
                result["copy"] = bench_copy(args.repeats, flush)
            elif part == "gemm":
                result["scaled_mm_supported"] = ok = fp8.scaled_mm_supported("cuda")
                print(f"  blockwise torch._scaled_mm (1x128, 128x128): {'supported' if ok else 'NOT supported'}")
                result["gemm"] = bench_gemm(args.repeats, flush, ok)
            elif part == "grouped":
                result["grouped"] = bench_grouped(args.repeats, flush)
            else:
                result["mla"] = bench_mla(args.repeats, flush, not args.no_flashinfer)
        except Exception as e:  # noqa: BLE001 - one part failing leaves the others' figures
            failures.append(part)
            result[f"{part}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"  {part} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        result.setdefault("seconds", {})[part] = round(time.perf_counter() - start, 2)
        torch.cuda.empty_cache()
    result["key_figures"] = key_figures(result)
    result["status"] = "failed: " + ", ".join(failures) if failures else "ok"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
