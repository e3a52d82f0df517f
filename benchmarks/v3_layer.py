"""DeepSeek-V3's layers at their real size on one GPU: decode step time per layer, eager and captured.

The model is DeepSeek-V3 cut to two layers, the first dense and the second MoE, at the published
dimensions (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128, dense
intermediate 18432, moe_intermediate 2048, one shared expert, top-8 routing with n_group 8 / topk_group
4), random FP8 weights (e4m3, 128x128 block scales, as published) and a small vocabulary (the head is
not what is timed). The MoE layer holds ONE EP8 expert shard: 32 routed experts, the 32 of 256 that one
rank of eight holds. With a local batch of B tokens each choosing 8 of these 32 experts, the layer's
experts receive B x 8 rows, as an EP8 rank does on average (there, 8B tokens over eight ranks each send
8 copies, 64B rows over 8 ranks); the dispatch between ranks (the all-to-all over NVLink) is not in these
figures, and the gate scores 32 experts, not 256 (n_group 8 then means 4 experts a group). Attention
runs all 128 heads, as it does per rank with data-parallel attention (EP8 x DP8).

The checkpoint is written by epserve's own writer (``presets.make_checkpoint``: ``build_config``,
``random_weights`` with a logit margin so greedy tokens are well separated, ``save_checkpoint``) once
into ``--checkpoint`` and loaded by ``LLM``: at ``--size v3`` 2.3e9 values generated and quantized on the
CPU (about 20 s per 1e9 on two busy cores here), which the GPU check runs in the background
(``--build-only``) while its earlier stages use the GPU. For each variant (``fp8``: FP8 weights, bf16 KV cache;
``bf16``: the weights dequantized at load; ``fp8-kv``: FP8 weights and an FP8 cache) two engines run:
eager, and captured (CUDA graphs on a GPU, captured at start-up; ``torch.compile`` on the CPU). Both
decode the same prompts greedily (the tokens must be equal). Then, at each ``--batches`` size (the largest
first: the goal's, kept by a run cut off after it), both engines
prefill B sequences of ``--prompt-len`` tokens (4096 at ``--size v3``: the 4k context of the issue's goal)
ONCE (in 8192-token chunks past 2048 tokens; each request's tokens also cover the steps its batch spends in
prefill, so all B sequences run through every timed step: ``min_running``) and decode on from there,
alternating the engines round by round so drift hits both alike:
``step_ms`` (``engine.step()``: forward, sampling, scheduler, what a request waits for) and ``forward_ms``
(the forward alone, CUDA events around it: the graph replay with its input copies, on the captured engine).
The eager engine then decodes a few more steps with CUDA events at each layer's start, its FFN's start and
its end (the dense and the MoE layer's attention and FFN time), then a few with each op timed alone
(``step_timers.OpTimer``: CUDA events around every op of the layers' op hooks in an eager pass, a sleep
kernel queued before each so that the op's kernels run back to back: their time, not the host's launches):
attention projections, MLA decode, ``o_proj``, gate, dispatch (local at one rank), grouped experts, shared
expert, combine (``step_timers.OP_GROUPS``).

On a GPU at ``--size v3``, each row also has the weight-and-KV streaming floor (``gpu_figures.
layer_stream_bytes``: every weight the step reads, the experts B tokens reach, the latent cache of B
sequences at their context, once, at the copy bandwidth measured here first) of the forward (both layers)
and of each op, and the captured forward over it (``key_figures["goals"]["v3_layer_vs_floor"]``: goal
<= 1.5x, at the largest batch of the first FP8-weight variant). Sized to fit an H100 80 GB as well as an
H200: two engines of ~2.3 GB of FP8 weights and a KV pool of B x (context + steps) tokens each (0.6 GB at
B = 64, 4k), the checkpoint ~2.3 GB on disk. Graph memory and capture time come from the engine's
start-up log, KV bytes from ``llm.cache_info()``.

The JSON (``--json``) is rewritten, atomically, after every measurement with ``"complete": false`` until
the end: a run cut off by a timeout leaves every figure measured so far. ``--device cuda`` without a CUDA
device (the default where there is none at ``--size v3``) writes ``{"status": "skipped"}`` and exits with
status 2; ``--build-only`` builds the checkpoint on the CPU and needs no GPU.

    python3 benchmarks/v3_layer.py --device cuda --batches 64 --json v3_layer.json  # ~2.3 GB of FP8 weights
    .venv/bin/python benchmarks/v3_layer.py --size tiny --batches 1 2                 # the same, tiny, on the CPU

Exit status 1 when a variant's captured tokens differ from its eager tokens (the JSON is written first).
"""

from __future__ import annotations

import argparse
import fcntl
import gc
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from fp8_gemm import copy_TBps as measure_copy_TBps
from gpu_figures import JsonProgress, add_floor, forward_floor, layer_key_figures, write_skipped
from step_timers import (
    WARM_STEPS,
    Clock,
    ForwardTimer,
    LogLines,
    decode_steps,
    prefill_chunk,
    prefill_steps,
    time_batch,
)

from epserve import LLM, SamplingParams
from epserve.env import cache_dir
from epserve.presets import make_checkpoint

_YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
         "original_max_position_embeddings": 4096, "type": "yarn"}  # DeepSeek-V3's config.json
SIZES: dict[str, dict[str, Any]] = {
    "v3": {"hidden_size": 7168, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
           "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 4096,
           "max_position_embeddings": 163840, "rope_scaling": _YARN},
    # the same structure with small widths (every FP8-fused dimension a multiple of 128; MLA's 512 + 64 kept)
    "tiny": {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
             "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
             "intermediate_size": 256, "moe_intermediate_size": 128, "vocab_size": 1024,
             "max_position_embeddings": 8192, "rope_scaling": _YARN},
}
SHARD = {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 32, "num_experts_per_tok": 8,
         "n_group": 8, "topk_group": 4, "n_shared_experts": 1, "num_nextn_predict_layers": 0}
VARIANTS: dict[str, dict[str, Any]] = {
    "fp8": {"quantization": "fp8"},
    "bf16": {"quantization": None},
    "fp8-kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}
LOGIT_MARGIN = 4.0
SEED = 0
TOKEN_PROMPT_LENS = (5, 17, 40, 64)  # the tokens check: a few prompts of different lengths
_GRAPHS_LINE = re.compile(r"captured (\d+) decode graphs .* in ([\d.]+) s: ([\d.]+) MiB of device memory")


def overrides(size: str) -> dict[str, Any]:
    return {**SIZES[size], **SHARD}


def build_checkpoint(path: Path, size: str) -> tuple[Path, float]:
    """The checkpoint for ``size`` in ``path`` (kept when its config matches), and the seconds spent
    building it (0 when kept). Built in a temporary folder beside it and renamed into place."""
    want = overrides(size)
    config = path / "config.json"
    if config.exists():
        have = json.loads(config.read_text())
        if all(have.get(k) == v for k, v in want.items()) and "quantization_config" in have:
            return path, 0.0
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(path.parent / f".{path.name}.lock", "w") as lock:  # another process building it: wait, then keep
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").exists():  # built meanwhile (the same size: the same name)
            return path, 0.0
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
        try:
            make_checkpoint(tmp, preset="tiny", fp8=True, seed=SEED, overrides=want, dtype="bfloat16",
                            logit_margin=LOGIT_MARGIN)
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path, time.perf_counter() - start


def streaming_floor(args: argparse.Namespace, variant: str, batch: int, copy_TBps: float) -> dict[str, Any]:
    """The forward's weight-and-KV streaming floor (``gpu_figures.forward_floor``) for ``variant``'s weights
    and cache, ``batch`` sequences at the middle of the timed rounds' context, at ``copy_TBps``."""
    options = VARIANTS[variant]
    context = args.prompt_len + WARM_STEPS + args.rounds * args.steps // 2
    return forward_floor(batch, context, copy_TBps, kv_bytes_per_elem=1 if options.get("kv_cache_dtype") == "fp8"
                         else 2, fp8=options.get("quantization") == "fp8", experts=SHARD["n_routed_experts"],
                         top_k=SHARD["num_experts_per_tok"])


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict[str, int] | None:
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return {"prompt": i, "position": j, "eager": s, "captured": t}
        if len(x) != len(y):
            return {"prompt": i, "position": min(len(x), len(y)), "eager": -1, "captured": -1}
    return None


def engine_options(args: argparse.Namespace, variant: str, mode: str, max_batch: int) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    generated = max(decode_steps(args, "eager") + prefill_steps(args, max_batch) + 2, args.tokens)
    max_len = max(args.prompt_len, max(TOKEN_PROMPT_LENS)) + generated + 16
    per_seq = -(-max_len // args.block_size)
    options: dict[str, Any] = dict(
        dtype="bfloat16", device=args.device, block_size=args.block_size, enable_prefix_caching=False,
        num_blocks=max(max_batch, len(TOKEN_PROMPT_LENS)) * per_seq + 8, max_num_seqs=max_batch,
        max_model_len=max_len, **VARIANTS[variant])
    if prefill_chunk(args) != 2048:  # the scheduler's default
        options["max_num_batched_tokens"] = prefill_chunk(args)
    if mode == "captured":
        options |= {"cuda_graph": True, "cuda_graph_max_bs": max_batch} if cuda else {"compile": True,
                                                                                       "cuda_graph_max_bs": max_batch}
    elif cuda:
        options["cuda_graph"] = False
    return options


def start_engines(args: argparse.Namespace, path: Path, variant: str, log: LogLines, out: dict[str, Any],
                  clock: Clock) -> tuple[dict[str, LLM], dict[str, ForwardTimer]]:
    cuda = args.device.startswith("cuda")
    max_batch = max(args.batches)
    engines: dict[str, LLM] = {}
    timers: dict[str, ForwardTimer] = {}
    for mode in args.modes:
        log.take()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        llm = LLM(path, **engine_options(args, variant, mode, max_batch))
        info: dict[str, Any] = {"start_s": time.perf_counter() - start, **llm.cache_info()}
        info["kv_bytes"] = int(info["num_blocks"]) * int(info["block_size"]) * int(info["bytes_per_token"])
        info["weight_bytes"] = llm.engine.runner.weight_bytes
        if cuda:
            info["allocated_bytes"] = torch.cuda.memory_allocated() - before
            info["peak_allocated_bytes"] = torch.cuda.max_memory_allocated() - before
        lines = log.take()
        kept = ("kernels:", "KV cache:", "captured ", "decode steps:")
        info["log"] = [line for line in lines if line.startswith(kept)]
        for line in lines:
            m = _GRAPHS_LINE.search(line)
            if m:
                info |= {"graphs": int(m[1]), "capture_s": float(m[2]), "graph_memory_MiB": float(m[3])}
        engines[mode], timers[mode] = llm, ForwardTimer(llm.engine.runner, clock)
        out["modes"][mode] = info
        print(f"[{variant}] {mode}: started in {info['start_s']:.1f} s; {info['log']}", flush=True)
    return engines, timers


def run_variant(args: argparse.Namespace, path: Path, variant: str, log: LogLines, out: dict[str, Any],
                save: Callable[[], None], copy_TBps: float | None) -> dict[str, Any]:
    """One variant's engines, tokens check and timed batches, filled into ``out`` (``save()`` after each part)."""
    clock = Clock(args.device.startswith("cuda"))
    out |= {"variant": variant, "options": dict(VARIANTS[variant]), "modes": {}}
    engines, timers = start_engines(args, path, variant, log, out, clock)
    save()
    # greedy tokens, eager against captured
    g = torch.Generator().manual_seed(1)
    vocab = engines[args.modes[0]].config.model.vocab_size
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in TOKEN_PROMPT_LENS]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    tokens = {mode: [o.token_ids for o in llm.generate(prompts, params)] for mode, llm in engines.items()}
    if len(tokens) == 2:
        diff = first_difference(tokens["eager"], tokens["captured"])
        out["tokens_equal"], out["first_difference"] = diff is None, diff
        print(f"[{variant}] greedy tokens, {len(prompts)} prompts x {args.tokens}: captured "
              f"{'= eager' if diff is None else f'DIFFER from eager at {diff}'}", flush=True)
    save()
    if args.no_timing:
        return out
    out["rows"] = []
    for batch in sorted(args.batches, reverse=True):  # the goal's batch (the largest) first: a cut-off run keeps it
        row: dict[str, Any] = {"batch": batch, "context": args.prompt_len}
        out["rows"].append(row)
        time_batch(args, batch, engines, timers, clock, row, save, SHARD["num_hidden_layers"])
        if copy_TBps and args.size == "v3":
            add_floor(row, streaming_floor(args, variant, batch, copy_TBps))
        save()
        floor = row.get("floor")
        print(f"[{variant}] batch {batch}, context {args.prompt_len}: " + "; ".join(
            f"{mode} step {row[mode]['step_ms']:.2f} ms, forward {row[mode]['forward_ms']:.2f} ms"
            for mode in engines)
            + (f"; floor {floor['forward_floor_ms']:.3f} ms" if floor else "")
            + (f" (captured {row['captured']['forward_vs_floor']:.2f}x)" if "forward_vs_floor" in row.get(
                "captured", {}) else "")
            + (f"; eager layers {row['eager'].get('layers')}; ops {row['eager'].get('op_groups')}"
               if "eager" in row else ""), flush=True)
    return out


def key_figures(result: dict[str, Any]) -> dict[str, Any]:
    """``gpu_figures.layer_key_figures``: what a summary shows, the goal among them."""
    return layer_key_figures(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="v3",
                    help="v3: DeepSeek-V3's widths; tiny: seconds on a CPU")
    ap.add_argument("--tiny", action="store_const", const="tiny", dest="size", help="the same as --size tiny")
    ap.add_argument("--device", default=None,
                    help="default: cuda where there is one, else cpu at --size tiny (cuda, skipped, at --size v3)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["fp8"])
    ap.add_argument("--modes", nargs="+", choices=["eager", "captured"], default=["eager", "captured"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="context of the timed batch (default 4096, DeepSeek-V3's 4k goal; tiny 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per round (default 12; tiny 3)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=12, help="greedy tokens per prompt in the eager = captured check")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-timing", action="store_true", help="only the eager = captured tokens check")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoint (or keep it) and exit")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="where the checkpoint is built once (default $EPSERVE_CACHE_DIR/v3-layer-<size>)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here (rewritten as they come)")
    args = ap.parse_args()
    tiny = args.size == "tiny"
    args.device = args.device or ("cuda" if torch.cuda.is_available() or not tiny else "cpu")
    args.prompt_len = args.prompt_len or (32 if tiny else 4096)
    args.steps = args.steps or (3 if tiny else 12)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available() and not args.build_only:
        reason = (f"v3_layer.py --device {args.device}: no CUDA device here (torch.cuda.is_available() is False): "
                  "nothing to measure; use --device cpu --size tiny")
        write_skipped(args.json, reason)
        print(reason, file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log = LogLines()
    epserve_log = logging.getLogger("epserve")
    epserve_log.setLevel(logging.INFO)
    epserve_log.addHandler(log)
    if not cuda:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    path = args.checkpoint or cache_dir() / f"v3-layer-{args.size}"
    path, build_s = build_checkpoint(path, args.size)
    built = f"built in {build_s:.1f} s" if build_s else "kept"
    if args.build_only:
        print(f"checkpoint {path} ({built})")
        return
    device_name = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    result: dict[str, Any] = {
        "machine": f"{device_name}, torch {torch.__version__}, device {args.device}",
        "size": args.size, "config": overrides(args.size), "checkpoint": str(path), "checkpoint_build_s": build_s,
        "batches": args.batches, "prompt_len": args.prompt_len, "steps": args.steps, "rounds": args.rounds,
        "status": "running", "variants": []}
    out = JsonProgress(args.json, result)

    def save() -> None:
        result["key_figures"] = key_figures(result)
        out.save()

    copy_TBps = None
    if cuda and not args.no_timing and args.size == "v3":
        result["copy_TBps"] = copy_TBps = measure_copy_TBps()
    save()
    print(f"checkpoint {path} ({built}); {result['machine']}"
          + (f"; copy {copy_TBps:.2f} TB/s (read + written)" if copy_TBps else ""), flush=True)
    for variant in args.variants:
        variant_out: dict[str, Any] = {"variant": variant}
        result["variants"].append(variant_out)
        run_variant(args, path, variant, log, variant_out, save, copy_TBps)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    result["status"] = "ok"
    result["key_figures"] = key_figures(result)
    out.finish()
    if args.json:
        print(f"wrote {args.json}")
    g = result["key_figures"]["goals"]["v3_layer_vs_floor"]
    print(f"goal v3_layer_vs_floor: {g['value']} (goal {g['goal']}, met: {g['met']})")
    if any(v.get("tokens_equal") is False for v in result["variants"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
