"""The planner against our own engine: predicted vs measured decode step time on the `small` preset.

    .venv/bin/python benchmarks/planner_validation.py [--dp 1|2] [--hardware FILE | --quick-calibration]
        [--batches 1 2 4 8 16 32 64] [--steps 24 --rounds 3] [--json out.json] [--markdown] [--quantization nvfp4]
    .venv/bin/python benchmarks/planner_validation.py --public [--json out.json]   # published figures, seconds

``--public``: no engine; the planner against the published deployment and kernel figures
(``epserve.planner.validation``; the table in docs/planner.md, "Validation against public figures").

1. Builds (or reuses) the `small` checkpoint (bf16) at ``--checkpoint``; ``--quantization nvfp4``: the same
   preset in ModelOpt's NVFP4 layout (``make-checkpoint --quantization nvfp4``: MLPs and experts four-bit,
   attention bf16), run as stored (W4A16) and priced as ``epserve plan`` prices its directory: fp4 MLPs and
   experts, bf16 attention.
2. ``--rounds`` rounds, each: calibrate this machine as `epserve plan calibrate` does (unless
   ``--hardware`` gives a file), then per batch the engine's median decode step (as
   ``decode_step_profile`` in benchmarks/offline_throughput.py: ``batch`` requests of
   ``--prompt-len`` random tokens, prefill, one warm step, then ``--steps`` timed steps) and the
   planner's prediction, from that round's calibration, for the same deployment: one engine
   instance (EP 1, TP 1 -- dp 1), that batch, the mean KV length of the timed steps, bf16 weights
   and KV, the checkpoint's own config, no MTP, overlap `dispatch` (the shared expert between
   dispatch send and receive, as the engine runs it; at EP 1 the same as `none`). Calibrating in
   every round pairs each measurement with a calibration taken within seconds of it: on a shared
   machine the memory bandwidth drifts by 10-20% over minutes.
3. Reports per batch the median over rounds of the measured and predicted times and of the error,
   and the range of the error.

Prints the table (``--markdown``: as in docs/planner.md) and writes JSON (``--json``); the last
round's calibration goes to ``--save-hardware``.

``--dp 2``: the engine runs 2 rank processes (``LLM(checkpoint, dp=2, tp=1, dispatch="all_to_all",
overlap="dispatch")``, gloo, cores / 2 torch threads each); per batch ``B`` (sequences per DP group) the
measurement is rank 0's median ``seconds["step"]`` (the whole engine step: scheduling, the step's
all-reduce, forward, sampling) over the pure decode steps of ``2 B`` requests of ``--prompt-len`` tokens
(every rank decoding ``B``), the first 3 dropped. The prediction is the planner's for EP 2, TP 1,
DP 2, batch ``B`` per rank, 2 "GPUs" per node (both ranks on this host), from a calibration of one
rank under the same conditions (``calibrate_ranks(2)``: two concurrent calibrating processes of one
thread each, the collectives timed between two computing ranks). The rank processes are pinned to their
own cores, as the engine pins its CPU ranks by default, and so are the calibration's processes;
``--no-pin`` (``EPSERVE_PIN=0``) leaves both unpinned.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import start_decode_batch
from tqdm import tqdm

from epserve import LLM, SamplingParams, env
from epserve.kernels.cpu import TILE_M
from epserve.model.moe import MoE
from epserve.planner import Deployment, load_hardware, plan_decode, resolve_model, save_hardware
from epserve.planner.calibrate import calibrate, calibrate_ranks
from epserve.planner.cli import BUSY_FLOOR_US
from epserve.presets import make_checkpoint

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def measure_decode(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    """Median decode step at a fixed batch (the method of ``decode_step_profile``), the mean KV length
    of the timed steps, and how often a MoE layer sent more than the CPU kernel's tile of rows to one
    expert (the engine then runs that layer's experts through torch instead)."""
    engine = llm.engine
    model = engine.runner.model
    start_decode_batch(engine, batch, prompt_len, steps, seed, tag=f"val{seed}")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    times, kv, over_tile = [], [], 0
    for _ in range(steps):
        kv.append(statistics.mean(r.num_computed_tokens + 1 for r in engine.scheduler.running))
        before = [m.expert_load.clone() for m in moes]
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        over_tile += sum(int((m.expert_load - b).max()) > TILE_M for m, b in zip(moes, before))
    while engine.has_unfinished_requests():
        engine.step()
    return {"step_ms": 1e3 * statistics.median(times), "kv_len": statistics.mean(kv),
            "over_tile_layers": over_tile / steps}


DP2_WARMUP = 3  # pure decode steps dropped at the start (dp 2)
DP2_GROUPS = {"attention": ("input_norm", "qkv_a_proj", "q_b_proj", "append_kv", "q_absorb", "kv_b_proj",
                            "attention_core", "v_absorb", "o_proj", "attn_reduce_scatter", "post_norm"),
              "dispatch": ("dispatch_send", "dispatch_recv"), "experts": ("experts",),
              "combine": ("combine_send", "combine_recv")}


def measure_decode_dp(llm: LLM, dp: int, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    """Rank 0's median engine step over the pure decode steps of ``batch`` sequences per DP group
    (``dp * batch`` requests of ``prompt_len`` random tokens, the first ``DP2_WARMUP`` dropped), the
    mean KV length of those steps, and a few per-rank medians (ms) to see where the time went."""
    g = torch.Generator().manual_seed(seed)
    vocab = llm.config.model.vocab_size
    prompts = [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(dp * batch)]
    llm.set_profiling(True)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=steps + DP2_WARMUP + 2, temperature=0.0, ignore_eos=True))
        per_rank = llm.profile()
    finally:
        llm.set_profiling(False)
    pure = [s for s in zip(*per_rank) if all(r.is_decode and r.num_seqs == batch for r in s)][DP2_WARMUP:]
    if len(pure) < steps // 2:
        raise RuntimeError(f"only {len(pure)} pure decode steps at batch {batch}")
    # decode step i (0-based, counting the prefill's token) runs with prompt_len + i + 1 tokens in KV
    first = len([s for s in zip(*per_rank) if all(r.is_decode for r in s)]) - len(pure)
    kv = statistics.mean(prompt_len + 1 + first + i for i in range(len(pure)))

    def med(rank: int, ops: tuple[str, ...]) -> float:
        return 1e3 * statistics.median(sum(s[rank].seconds.get(op, 0.0) for op in ops) for s in pure)

    ranks = {f"rank{r}": {"step": med(r, ("step",)), "forward": med(r, ("forward",)),
                          **{k: med(r, ops) for k, ops in DP2_GROUPS.items()}} for r in range(len(per_rank))}
    return {"step_ms": ranks["rank0"]["step"], "kv_len": kv, "steps_timed": len(pure), "ranks_ms": ranks,
            "over_tile_layers": float("nan")}


def predict(model_name: str, model, hw, batch: int, kv_len: float, dp: int = 1,
            quantization: str | None = None) -> dict:
    nvfp4 = quantization == "nvfp4"
    weights = {"weight_dtype": "fp4", "attention_dtype": "bf16"} if nvfp4 else {"weight_dtype": "bf16"}
    d = Deployment(ep=dp, tp=1, batch=batch, kv_len=round(kv_len), mtp_draft=0, overlap="dispatch",
                   kv_dtype="bf16", gpus_per_node=dp if dp > 1 else 8, **weights)
    plan = plan_decode(model, hw, d, model_name)
    if not plan.fits:
        raise SystemExit(f"the planner refuses batch {batch}: {plan.refusal}")
    return {"step_ms": plan.step.step_time_us / 1e3,
            "breakdown_ms": {k: v / 1e3 for k, v in plan.step.breakdown_us.items()}}


def markdown(rows: list[dict]) -> str:
    if rows and "measured_ranks_ms" in rows[0]:
        return markdown_dp(rows)
    lines = ["| batch | KV | measured ms | predicted ms | error (range over rounds) | predicted: weights+compute / "
             "attention / other / host overhead ms | MoE layers over the kernel tile |",
             "|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        b = r["breakdown_ms"]
        parts = (f"{b['gemm'] + b['group_gemm']:.1f} / {b['attention']:.1f} / "
                 f"{b['other'] + b['dispatch'] + b['combine']:.1f} / {b['overhead']:.1f}")
        lines.append(f"{_row_head(r)} {parts} | {r['over_tile_layers']:.1f} / {r['moe_layers']} |")
    return "\n".join(lines)


def _row_head(r: dict) -> str:
    """The cells every table shares: batch, KV, measured, predicted, error (range over rounds)."""
    lo, hi = min(r["error_pct_rounds"]), max(r["error_pct_rounds"])
    return (f"| {r['batch']} | {r['kv_len']:.0f} | {r['measured_ms']:.2f} | {r['predicted_ms']:.2f} | "
            f"{r['error_pct']:+.1f}% ({lo:+.0f} .. {hi:+.0f}) |")


def markdown_dp(rows: list[dict]) -> str:
    """dp > 1: the predicted breakdown splits out dispatch and combine, and the measured ones follow."""
    lines = ["| batch/rank | KV | measured ms | predicted ms | error (range over rounds) | "
             "predicted: weights+compute / "
             "attention / dispatch / combine / other / host overhead ms | measured rank 0: dispatch / combine / "
             "experts ms |", "|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        b, m = r["breakdown_ms"], r["measured_ranks_ms"]["rank0"]
        parts = (f"{b['gemm'] + b['group_gemm']:.1f} / {b['attention']:.1f} / {b['dispatch']:.1f} / "
                 f"{b['combine']:.1f} / {b['other']:.1f} / {b['overhead']:.1f}")
        lines.append(f"{_row_head(r)} {parts} | {m['dispatch']:.1f} / {m['combine']:.1f} / {m['experts']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=1, choices=(1, 2),
                    help="1: one engine in this process; 2: two rank processes (EP 2, all_to_all, gloo)")
    ap.add_argument("--checkpoint", default=None,
                    help="default ~/.cache/epserve/bench-small (-nvfp4 with --quantization nvfp4)")
    ap.add_argument("--quantization", choices=("nvfp4",), default=None,
                    help="nvfp4: the small preset's NVFP4 checkpoint (four-bit MLPs and experts), priced in fp4")
    ap.add_argument("--hardware", help="a calibration JSON (default: calibrate in every round)")
    ap.add_argument("--quick-calibration", action="store_true", help="calibrate with --quick (seconds)")
    ap.add_argument("--save-hardware", help="write the last calibration used here")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3, help="calibration + measurement rounds; medians are kept")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--no-pin", action="store_true",
                    help="dp 2: leave the rank processes, and the calibration's, unpinned (EPSERVE_PIN=0)")
    ap.add_argument("--public", action="store_true",
                    help="the planner against published figures instead of this engine (no engine run)")
    args = ap.parse_args()
    if args.public:
        from epserve.planner import validation

        if args.json:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                validation.main(["--json"])
            Path(args.json).write_text(out.getvalue())
        validation.main([])
        return
    if args.no_pin:
        os.environ[env.PIN] = "0"  # inherited by the spawned ranks

    suffix = f"-{args.quantization}" if args.quantization else ""
    path = Path(args.checkpoint or os.path.expanduser(f"~/.cache/epserve/bench-small{suffix}"))
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype="bfloat16", seed=0, quantization=args.quantization)
    model_name, model = resolve_model(path)
    if args.dp == 1:
        llm = LLM(path, dtype="bfloat16", num_blocks=1024, enable_prefix_caching=False)
        measure_decode(llm, 2, args.prompt_len, 4, seed=999)  # warm-up: kernels built, pages touched
    else:
        top = max(args.batches)
        llm = LLM(path, dtype="bfloat16", dp=args.dp, tp=1, dispatch="all_to_all", overlap="dispatch",
                  max_num_seqs=max(top, 2), max_num_batched_tokens=max(2048, top * args.prompt_len),
                  num_blocks=1024, enable_prefix_caching=False)
        measure_decode_dp(llm, args.dp, 2, args.prompt_len, 8, seed=999)  # warm-up

    runs: dict[int, list[dict]] = {b: [] for b in args.batches}
    hardware = []
    with tqdm(total=args.rounds * (len(args.batches) + (0 if args.hardware else 1)), desc="validation") as bar:
        for rnd in range(args.rounds):
            if args.hardware:
                hw = load_hardware(args.hardware)
            else:
                bar.set_postfix_str("calibrating")
                hw = cal(args)
                for _ in range(2):  # another process competing for the 2 cores ruins a calibration
                    if hw.kernel_latency_us <= BUSY_FLOOR_US:
                        break
                    time.sleep(10)
                    hw = cal(args)
                bar.update()
            hardware.append(hw)
            for b in args.batches:
                bar.set_postfix_str(f"batch {b}")
                if args.dp == 1:
                    run = measure_decode(llm, b, args.prompt_len, args.steps, seed=1000 * rnd + b)
                else:
                    run = measure_decode_dp(llm, args.dp, b, args.prompt_len, args.steps, seed=1000 * rnd + b)
                run["predicted"] = predict(model_name, model, hw, b, run["kv_len"], args.dp, args.quantization)
                runs[b].append(run)
                bar.update()
    if args.save_hardware:
        save_hardware(hardware[-1], args.save_hardware)

    rows = []
    for b in args.batches:
        rs = runs[b]
        errors = [100 * (r["predicted"]["step_ms"] - r["step_ms"]) / r["step_ms"] for r in rs]
        mid = sorted(rs, key=lambda r: r["predicted"]["step_ms"])[len(rs) // 2]
        rows.append({"batch": b, "kv_len": statistics.mean(r["kv_len"] for r in rs),
                     "measured_ms": statistics.median(r["step_ms"] for r in rs),
                     "predicted_ms": statistics.median(r["predicted"]["step_ms"] for r in rs),
                     "error_pct": statistics.median(errors), "error_pct_rounds": errors,
                     "measured_rounds_ms": [r["step_ms"] for r in rs],
                     "predicted_rounds_ms": [r["predicted"]["step_ms"] for r in rs],
                     "breakdown_ms": mid["predicted"]["breakdown_ms"], "moe_layers": len(model.moe_layer_ids),
                     "over_tile_layers": statistics.mean(r["over_tile_layers"] for r in rs)})
        if args.dp > 1:  # the measured per-rank medians of the round whose prediction is the median one
            rows[-1]["measured_ranks_ms"] = mid["ranks_ms"]
            rows[-1]["measured_ranks_rounds_ms"] = [r["ranks_ms"] for r in rs]
    if args.dp > 1:
        llm.shutdown()

    def summary(hw) -> dict:
        return {"name": hw.name, "source": hw.source, "peak_bf16_flops": hw.flops_for("bf16"),
                "memory_bandwidth": hw.memory_bandwidth, "kernel_latency_us": hw.kernel_latency_us,
                "op_overhead_us": hw.op_overhead_us,
                "op_overhead_per_token_us": hw.op_overhead_per_token_us, "step_overhead_us": hw.step_overhead_us,
                "stream_efficiency": hw.stream_efficiency, "collective_latency_us": hw.nvlink_latency_us,
                "dispatch_handshake_us": hw.dispatch_handshake_us, "step_sync_us": hw.step_sync_us,
                "link_bandwidth": hw.nvlink_bandwidth,
                "efficiency": {k: vars(e) for k, e in hw.efficiency.items()},
                "memory_by_rows_GBps": {k: [(r, size, f * hw.memory_bandwidth / 1e9) for r, size, f in c]
                                        for k, c in hw.memory_by_rows.items()}}

    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "dp": args.dp, "threads_per_rank": (torch.get_num_threads() if args.dp == 1
                                            else max(1, (os.cpu_count() or 1) // args.dp)),
        "checkpoint": str(path), "model": model_name, "quantization": args.quantization,
        "prompt_len": args.prompt_len, "steps": args.steps,
        "rounds": args.rounds, "hardware": [summary(hw) for hw in hardware], "rows": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.markdown:
        print(markdown(rows))
    else:
        print(f"{'batch':>5} {'KV':>5} {'measured ms':>12} {'predicted ms':>13} {'error':>8}  {'range':>12}")
        for r in rows:
            lo, hi = min(r["error_pct_rounds"]), max(r["error_pct_rounds"])
            print(f"{r['batch']:>5} {r['kv_len']:>5.0f} {r['measured_ms']:>12.2f} {r['predicted_ms']:>13.2f} "
                  f"{r['error_pct']:>+7.1f}%  {lo:+5.0f} .. {hi:+.0f}")
    worst = max(abs(r["error_pct"]) for r in rows)
    print(f"worst median error {worst:.1f}% (goal: within 20%)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def cal(args):
    """This round's calibration: of the whole machine (dp 1), or of one of ``dp`` rank processes."""
    if args.dp == 1:
        return calibrate(quick=args.quick_calibration)
    return calibrate_ranks(args.dp, quick=args.quick_calibration)


if __name__ == "__main__":
    main()
