"""The kernel figures of one CUDA GPU at DeepSeek-V3's real shapes, against its measured ceilings, in one JSON
rewritten after every measurement.

    python3 benchmarks/gpu_micro.py [--json micro.json] [--repeats 10] [--parts copy mla gemm grouped]
                                    [--mla-heads 128 16] [--flashinfer] [--smoke]

- copy: device-to-device copy bandwidth (``dst.copy_(src)`` of 2 GiB, bytes read plus written, as the
  3.0 TB/s seen on the H100 and 4.3 TB/s on the H200 count them: the floor for everything after it) and a bf16
  8192^3 ``torch.matmul`` (the dense TFLOP/s ceiling).
- mla: paged MLA decode (DeepSeek's 512 + 64 latent) at 128 heads (DP attention: every head on a rank) and 16
  (one TP-8 shard), batch 1, 16 and 64, 4096-token contexts, 16-token blocks in shuffled order, bf16 and FP8
  caches: every Triton implementation the ``mla_decode`` op lists for CUDA (the many-head kernel where it
  exists, the split-K one; ``mla_decode_triton`` by name if the op's list cannot be read), each checked against
  the torch reference: GB/s of cache read and % of the copy bandwidth. ``--flashinfer`` adds FlashInfer's
  (bf16; where it imports and its self-test passes; its plan, one per step, timed apart): off by default, so
  no FlashInfer JIT build happens unless asked for (the GPU check asks in its last stage).
- gemm: the block-scaled FP8 GEMM at V3's decode shapes (``gpu_figures.gemm_shapes``: qkv_a, q_b, ``o_proj``
  7168x16384, the dense MLP's gate_up 36864x7168 and down 7168x18432, an expert's) at M = 1, 16, 64, 128, 4096:
  our Triton kernel, blockwise ``torch._scaled_mm`` (where the probe accepts it) and cuBLAS bf16 on the
  dequantized weight (``fp8_gemm.bench_gemm``): TFLOP/s, % of ``_scaled_mm``, weight GB/s as % of the copy.
- grouped: the grouped FP8 GEMM over one EP8 shard's 32 experts at decode sizes (1..16 real rows an expert,
  with and without padding rows) and two prefill sizes, against the weight-streaming floor and per-expert
  cuBLAS / ``_scaled_mm`` loops (``fp8_gemm.bench_grouped``).

The parts run in that order (copy always, first: the others are read against it), the goals' parts first.
``key_figures`` carries the ceilings, the best MLA and GEMM ratios, and the issue's goals (``gpu_figures.GOALS``,
each with its value, goal and whether it is met). Each timing is the median over ``--repeats`` runs by CUDA
events after warm-ups, the L2 cache flushed before each run (``fp8_gemm.timed``). The JSON is rewritten
(atomically) after every measurement with ``"complete": false`` until the end, so a run cut off by a timeout
leaves every figure measured so far. Needs CUDA: without it, says so and exits with status 2 (after writing
``{"status": "skipped"}`` to ``--json``); ``--smoke`` runs every part at tiny shapes instead (on the CPU with
the Triton kernels under their interpreter: the script's own code checked without a GPU). Not yet timed on a
GPU: expect a minute or two on an H100, the first Triton builds included.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import fp8_gemm
import torch
from fp8_gemm import bench_gemm, bench_grouped, rel_err, timed
from gpu_figures import GOALS, MLA, JsonProgress, goal, mla_cache_bytes, pct, write_skipped

PARTS = ("copy", "mla", "gemm", "grouped")  # in the order they run: the goals first
COPY_BYTES = 2 << 30
MATMUL = 8192
Save = Callable[[], None]
# --smoke: every part end to end at tiny shapes, in seconds (on the CPU the Triton kernels under their
# interpreter): the script's own code checked before a lease is spent on it
SMOKE: dict[str, Any] = {
    "copy_bytes": 1 << 20, "matmul": 128, "gemm_shapes": {"smoke (256x512)": (256, 512)}, "gemm_rows": (1, 16),
    "grouped": {"local experts": 4, "rows per expert": (1, 2), "capacity": 4, "rows": (16,),
                "shapes": {"smoke w13 (256x256)": (256, 256)}},
    "mla": {"heads": (64, 4), "batches": (1, 2), "context": 64, "block_size": 16, "kv_lora_rank": 64, "rope": 32},
}


def smoke(device: str) -> None:
    """Shrink every part to ``SMOKE``'s shapes, on ``device`` (the CPU: Triton under its interpreter)."""
    global COPY_BYTES, MATMUL, DEVICE
    if device != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported
    COPY_BYTES, MATMUL, DEVICE = SMOKE["copy_bytes"], SMOKE["matmul"], device
    fp8_gemm.DEVICE = device
    fp8_gemm.SHAPES.clear()
    fp8_gemm.SHAPES.update(SMOKE["gemm_shapes"])
    fp8_gemm.ROWS = SMOKE["gemm_rows"]
    fp8_gemm.GROUPED.update(SMOKE["grouped"])
    MLA.update(SMOKE["mla"])


DEVICE = "cuda"


def bench_copy(repeats: int, flush: torch.Tensor) -> dict[str, Any]:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=DEVICE).random_(0, 255)
    dst = torch.empty_like(src)
    t = timed(partial(dst.copy_, src), repeats, flush)
    assert torch.equal(dst[:4096], src[:4096])
    del src, dst
    a, b = (torch.randn(MATMUL, MATMUL, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    tm = timed(partial(torch.matmul, a, b), repeats, flush)
    out = {"copy_bytes": COPY_BYTES, "copy_us": t * 1e6, "copy_TBps": 2 * COPY_BYTES / t / 1e12,
           "bf16_matmul_shape": [MATMUL] * 3, "bf16_matmul_us": tm * 1e6,
           "bf16_matmul_tflops": 2 * MATMUL**3 / tm / 1e12}
    print(f"  copy {COPY_BYTES / 2**30:.0f} GiB: {out['copy_TBps']:.2f} TB/s (read + written); bf16 matmul "
          f"{MATMUL}^3: {out['bf16_matmul_tflops']:.0f} TFLOP/s", flush=True)
    return out


def mla_kernels() -> tuple[list[tuple[str, Callable[..., torch.Tensor], Callable[..., bool] | None]], list[str]]:
    """The Triton implementations the ``mla_decode`` op lists for CUDA, in the op's order, as (name, function,
    takes): FlashInfer (a ``kernels.backends`` backend) is left to its own path. One that does not import is
    left out; where none is left, the split-K kernel by name. The second item says what was left out and why."""
    notes: list[str] = []
    found = []
    try:
        from epserve.kernels import ops

        impls = ops.mla_decode.impls.get("cuda", [])
    except (ImportError, AttributeError) as e:
        impls = []
        notes.append(f"the mla_decode op's implementations unreadable ({type(e).__name__}: {e})")
    for impl in impls:
        if impl.backend is not None:
            continue
        module, _, fn = impl.target.partition(":")
        try:
            found.append((f"{module.rsplit('.', 1)[-1]}:{fn}", impl.function(), impl.takes))
        except (ImportError, AttributeError) as e:
            notes.append(f"{impl.target} does not import ({type(e).__name__}: {e})")
    if not found:
        from epserve.kernels import mla_decode_triton as mt

        notes.append("the op lists no Triton implementation for cuda that imports: the split-K kernel by name")
        found.append(("mla_decode_triton:paged_mla_decode_triton", mt.paged_mla_decode_triton, None))
    return found, notes


def _mla_case(batch: int, heads: int, cache_dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    ctx, bs, d = MLA["context"], MLA["block_size"], MLA["kv_lora_rank"] + MLA["rope"]
    blocks = batch * ctx // bs
    tables = torch.randperm(blocks, generator=gen).view(batch, ctx // bs).to(DEVICE, torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(batch, heads, d, generator=gen).to(DEVICE)
    latent = torch.randn(blocks, bs, d, device=DEVICE)
    if cache_dtype == torch.bfloat16:
        return q, latent.to(cache_dtype), tables, lens, None
    kv_scale = torch.tensor(0.02, device=DEVICE)  # latent / 0.02 in e4m3, as the engine's FP8 cache holds it
    return q, (latent / kv_scale).clamp(-448, 448).to(cache_dtype), tables, lens, kv_scale


def _flashinfer_choice() -> dict[str, Any]:
    """Whether FlashInfer's MLA decode imports and passes the registry's self-test here (its JIT build the
    first time: then it is timed), which backend the registry chooses, and its log lines."""
    from epserve.kernels import backends

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(backends.__name__).addHandler(handler)
    try:
        from epserve.kernels import mla_flashinfer as mf

        mf.import_flashinfer()
        start = time.perf_counter()
        passed = backends.passes("mla_decode", "flashinfer", torch.device("cuda"), torch.bfloat16)  # its self-test
        out: dict[str, Any] = {"used": passed, "self_test_passed": passed, "decided_s": time.perf_counter() - start}
        out["selected"] = backends.select("mla_decode", torch.device("cuda"), torch.bfloat16)
        out["log"] = lines
        if not passed:
            out["why"] = "; ".join(lines) or "its self-test did not pass"
        return out
    except Exception as e:  # noqa: BLE001 - not importable, or its build or self-test broke: not timed
        return {"used": False, "why": f"{type(e).__name__}: {str(e)[:300]}", "log": lines}
    finally:
        logging.getLogger(backends.__name__).removeHandler(handler)


def bench_mla(repeats: int, flush: torch.Tensor, use_flashinfer: bool, heads_list: list[int], out: dict[str, Any],
              save: Save, copy_TBps: float | None) -> dict[str, Any]:
    """MLA decode rows into ``out["rows"]`` (``save()`` after each)."""
    from epserve.kernels.fp8 import FP8_DTYPE
    from epserve.kernels.mla_decode import paged_mla_decode_ref

    r = MLA["kv_lora_rank"]
    scale = (MLA["rope"] + 128) ** -0.5
    kernels, notes = mla_kernels()
    out |= {"shape": {**MLA, "heads": heads_list}, "kernels": [k[0] for k in kernels], "rows": []}
    if notes:
        out["kernels_notes"] = notes
    out["flashinfer"] = _flashinfer_choice() if use_flashinfer else {"used": False, "why": "not asked (--flashinfer)"}
    save()
    fi = out["flashinfer"]
    print(f"  Triton MLA kernels: {out['kernels']}{f' ({notes})' if notes else ''}; FlashInfer: "
          f"{'used' if fi['used'] else 'not used: ' + fi['why']}", flush=True)
    gen, rows = torch.Generator().manual_seed(0), out["rows"]
    for heads in heads_list:
        for cache_dtype, dtype_name in ((torch.bfloat16, "bf16"), (FP8_DTYPE, "fp8")):
            for batch in MLA["batches"]:
                q, cache, tables, lens, kv_scale = _mla_case(batch, heads, cache_dtype, gen)
                ref = paged_mla_decode_ref(q, cache, tables, lens, scale, r, kv_scale)
                args = (q, cache, tables, lens, scale, r, kv_scale)
                paths: dict[str, tuple[Callable[[], torch.Tensor], bool | None]] = {}
                chosen = False
                for name, fn, takes in kernels:
                    took = None if takes is None else bool(takes(*args))
                    picked = not chosen and took is not False
                    chosen = chosen or picked
                    paths[name] = (partial(fn, *args), picked)
                plan_us = None
                if fi["used"] and kv_scale is None:
                    from epserve.kernels import mla_flashinfer as mf

                    planner = getattr(mf, "_planner", None)
                    if planner is not None:
                        planner(q.device).plans.clear()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    try:
                        mf.paged_mla_decode_flashinfer(q, cache, tables, lens, scale, r)  # plans (a host sync), runs
                        torch.cuda.synchronize()
                        plan_us = (time.perf_counter() - start) * 1e6
                    except Exception as e:  # noqa: BLE001 - recorded as its row's error below
                        print(f"  flashinfer h={heads} B={batch}: first call failed ({type(e).__name__})", flush=True)
                    paths["flashinfer"] = (partial(mf.paged_mla_decode_flashinfer, q, cache, tables, lens, scale, r),
                                           None)
                cache_bytes = mla_cache_bytes(batch, MLA["context"], cache.element_size())
                for path, (fn, picked) in paths.items():
                    row: dict[str, Any] = {"cache": dtype_name, "batch": batch, "context": MLA["context"],
                                           "heads": heads, "block_size": MLA["block_size"], "path": path,
                                           "chosen_by_op": picked}
                    try:
                        t = timed(fn, repeats, flush)
                        err = rel_err(fn(), ref)
                    except Exception as e:  # noqa: BLE001 - a kernel that fails here (a Triton compile error too)
                        print(f"  mla {dtype_name} h={heads} B={batch} {path}: failed "
                              f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})", flush=True)
                        rows.append(row | {"error": f"{type(e).__name__}: {str(e)[:300]}"})
                        save()
                        continue
                    gbps = cache_bytes / t / 1e9
                    row |= {"us": t * 1e6, "cache_bytes": cache_bytes, "cache_GBps": gbps, "rel_err_vs_ref": err}
                    if copy_TBps:
                        row["pct_of_copy"] = pct(gbps, copy_TBps * 1e3)
                    if path == "flashinfer":
                        row["first_call_with_plan_us"] = plan_us
                    rows.append(row)
                    save()
                    of_copy = f" {row['pct_of_copy']:4.0f}% of copy" if "pct_of_copy" in row else ""
                    print(f"  mla {dtype_name:4s} h={heads:3d} B={batch:3d} ctx={MLA['context']} {path:44s} "
                          f"{t * 1e6:8.1f} us {gbps:7.0f} GB/s{of_copy}  rel_err {err:.1e}", flush=True)
                del q, cache, tables, lens, ref, paths
    return out


def key_figures(result: dict[str, Any]) -> dict[str, Any]:
    """What a summary shows: the copy and matmul ceilings; per FP8 GEMM shape at M = 4096 Triton's % of
    ``_scaled_mm`` and at M = 1 its weight GB/s as % of the copy; the grouped GEMM's % of its floor at decode
    sizes; per MLA (cache, heads, batch) the best kernel's GB/s and % of the copy; and ``goals``."""
    f: dict[str, Any] = {}
    copy = result.get("copy", {})
    if copy:
        f["copy_TBps"] = round(copy["copy_TBps"], 3)
        f["bf16_matmul_tflops"] = round(copy["bf16_matmul_tflops"], 1)
    goals: dict[str, Any] = {}
    gemm_pcts: dict[str, float] = {}
    for row in result.get("gemm", []):
        if row.get("path") != "triton" or "tflops" not in row:
            continue
        if row["M"] == 4096 and "pct_of_scaled_mm" in row:
            gemm_pcts[row["shape"]] = row["pct_of_scaled_mm"]
            f[f"gemm {row['shape']} M=4096 triton % of _scaled_mm"] = round(row["pct_of_scaled_mm"], 1)
        if row["M"] == 1 and "weight_pct_of_copy" in row:
            f[f"gemm {row['shape']} M=1 triton weight % of copy"] = round(row["weight_pct_of_copy"], 1)
    if gemm_pcts:
        worst = min(gemm_pcts, key=gemm_pcts.__getitem__)
        goals["fp8_gemm_pct_of_scaled_mm"] = goal("fp8_gemm_pct_of_scaled_mm", gemm_pcts[worst], shape=worst)
    for row in result.get("grouped", []):
        if row.get("path") == "triton grouped" and "pct_of_floor" in row and "/expert" in row["case"]:
            f[f"grouped {row['shape'].split()[0]} {row['case']} triton % of floor"] = round(row["pct_of_floor"], 1)
    best: dict[tuple[str, int, int], dict[str, Any]] = {}
    for row in result.get("mla", {}).get("rows", []):
        key = (row["cache"], row["heads"], row["batch"])
        if "cache_GBps" in row and row["cache_GBps"] > best.get(key, {}).get("cache_GBps", 0.0):
            best[key] = row
    for (cache, heads, batch), row in sorted(best.items()):
        f[f"mla {cache} h={heads} B={batch} best GB/s"] = round(row["cache_GBps"])
        if "pct_of_copy" in row:
            f[f"mla {cache} h={heads} B={batch} best % of copy"] = round(row["pct_of_copy"], 1)
    top = max((k for k in best if k[0] == "bf16" and k[1] == 128), key=lambda k: k[2], default=None)
    if top is not None and "pct_of_copy" in best[top]:
        goals["mla_128h_4k_pct_of_copy"] = goal("mla_128h_4k_pct_of_copy", best[top]["pct_of_copy"],
                                                batch=top[2], kernel=best[top]["path"])
    for name in GOALS:
        if name != "v3_layer_vs_floor" and name not in goals:
            goals[name] = goal(name, None, note="not measured in this run")
    f["goals"] = goals
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rewritten as they come)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                    help="what to time (copy runs first whatever is asked: the others are read against it)")
    ap.add_argument("--mla-heads", type=int, nargs="+", default=list(MLA["heads"]),
                    help="MLA decode heads to time (default 128 16: DP attention, then a TP-8 shard)")
    ap.add_argument("--flashinfer", action="store_true", help="also time FlashInfer's MLA decode (its JIT build)")
    ap.add_argument("--no-flashinfer", action="store_false", dest="flashinfer",
                    help="time the Triton MLA decode only (the default)")
    ap.add_argument("--smoke", action="store_true",
                    help="every part at tiny shapes, in seconds: the script checked (on the CPU without CUDA)")
    args = ap.parse_args()
    if args.smoke:
        smoke("cuda" if torch.cuda.is_available() else "cpu")
        args.mla_heads = list(MLA["heads"])
    elif not torch.cuda.is_available():
        reason = "gpu_micro.py needs a CUDA GPU (torch.cuda.is_available() is False): nothing to measure"
        write_skipped(args.json, reason)
        print(reason, file=sys.stderr)
        sys.exit(2)
    import triton

    from epserve.kernels import fp8

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("epserve").setLevel(logging.INFO)  # the kernel registry's decisions

    cuda = DEVICE == "cuda"
    props = torch.cuda.get_device_properties(0) if cuda else None
    name, sm = (props.name, f"{props.major}{props.minor}") if props else ("cpu (smoke, Triton interpreter)", None)
    flush = torch.empty(256 * 2**20 if cuda else 1, dtype=torch.uint8, device=DEVICE)  # > L2 (50-60 MB on Hopper)
    result: dict[str, Any] = {"device": name, "sm": sm, "torch": torch.__version__, "triton": triton.__version__,
                              "cuda": torch.version.cuda, "repeats": args.repeats, "smoke": args.smoke,
                              "status": "running"}
    out = JsonProgress(args.json, result)

    def save() -> None:
        result["key_figures"] = key_figures(result)
        out.save()

    save()
    print(f"{name} (sm_{sm}), torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    failures = []
    parts = ["copy", *[p for p in PARTS if p in args.parts and p != "copy"]]  # the ceilings first, always
    for part in parts:
        start = time.perf_counter()
        print(f"{part}:", flush=True)
        copy_TBps = result.get("copy", {}).get("copy_TBps")
        try:
            if part == "copy":
                result["copy"] = bench_copy(args.repeats, flush)
            elif part == "gemm":
                result["scaled_mm_supported"] = ok = cuda and fp8.scaled_mm_supported("cuda")
                print(f"  blockwise torch._scaled_mm (1x128, 128x128): {'supported' if ok else 'NOT supported'}")
                bench_gemm(args.repeats, flush, ok, result.setdefault("gemm", []), save, copy_TBps)
            elif part == "grouped":
                ok = result.get("scaled_mm_supported")
                ok = (cuda and fp8.scaled_mm_supported("cuda")) if ok is None else ok
                bench_grouped(args.repeats, flush, result.setdefault("grouped", []), save, copy_TBps, ok)
            else:
                bench_mla(args.repeats, flush, args.flashinfer, args.mla_heads, result.setdefault("mla", {}), save,
                          copy_TBps)
        except Exception as e:  # noqa: BLE001 - one part failing leaves the others' figures
            failures.append(part)
            result[f"{part}_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"  {part} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
        result.setdefault("seconds", {})[part] = round(time.perf_counter() - start, 2)
        save()
        torch.cuda.empty_cache()
    result["status"] = "failed: " + ", ".join(failures) if failures else "ok"
    result["key_figures"] = key_figures(result)
    out.finish()
    if args.json:
        print(f"wrote {args.json}")
    for name, g in result["key_figures"]["goals"].items():
        print(f"goal {name}: {g['value']} (goal {g['goal']}, met: {g['met']})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
