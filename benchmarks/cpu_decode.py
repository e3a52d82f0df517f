"""CPU decode on the `small` preset (bf16): the fused small ops against the torch ops they replace, a
decode step beside a competing process, and the gaps between streamed chunks when served.

    .venv/bin/python benchmarks/cpu_decode.py steps        # captured / eager / torch ops, alternated in one engine
    .venv/bin/python benchmarks/cpu_decode.py contention   # batch-1 steps quiet, then beside a busy process
    .venv/bin/python benchmarks/cpu_decode.py streams      # epserve serve + bench: median chunk gap vs TPOT

``steps``: one engine, steady decode batches of ``--batches`` sequences; each round times ``--steps``
steps four ways, alternating, so all see the same machine: replayed as the bucket's recorded C kernel
calls (``cpu_graph``, the default: the model's head inside, greedy rows drawn by the sampling pipeline's
argmax shortcut), the same graphs without the head (``head after``: the head after the replay and the
sampling pipeline's whole path, as before both moved), eagerly with the fused ops of ``kernels/cpu_ops*.c``,
and eagerly with them reported missing (every op then runs its torch reference); medians of the rounds'
medians, with the weight-streaming floor of the step: the bytes it reads at the read bandwidth measured in
the same round, just before and just after the recorded steps (this host's bandwidth moves by 30-50% within
a minute; one reading at the start made the floor ratio swing by as much). The ratio is the median of the
rounds' ratios.
``contention``: the same step alone and beside one process spinning on the cores (a Python loop, or a
two-thread torch loop with ``--busy torch``), alternated. ``streams``: the served workload of
docs/benchmarks.md (64 requests, concurrency 16, 256 tokens in, 32 out). Figures go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import bench_serve, serving, start_decode_batch, wide_vocab_checkpoint
from offline_throughput import ReadBandwidth

from epserve import LLM
from epserve.engine import sampling
from epserve.engine.captured import CapturedDecode
from epserve.kernels import cpu
from epserve.model.moe import MoE
from epserve.presets import make_checkpoint

# the captured CPU decode; the same without its head or the greedy shortcut; eager steps with the fused ops; torch ops
VARIANTS = ("graph", "head_after", "eager", "torch")
BUSY = {"python": "while True: pass",
        "torch": "import torch\ntorch.set_num_threads(2)\na = torch.randn(64, 64)\nwhile True: a = (a @ a).tanh()"}


def checkpoint(args: argparse.Namespace) -> Path:
    """``--checkpoint`` (written there with the preset when missing), else the cached `small` one."""
    if args.checkpoint is None and not args.tiny:
        return wide_vocab_checkpoint(0)
    path = Path(args.checkpoint or Path.home() / ".cache" / "epserve" / "bench-tiny-bf16")
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="tiny" if args.tiny else "small", dtype="bfloat16", seed=0)
    return path


def timed(engine, steps: int) -> float:
    """Median ms of ``steps`` engine steps."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def step_bytes(engine, batch: int) -> float:
    """The weight bytes of one decode step of ``batch`` sequences: every weight but the routed experts and
    the embedding, plus the experts the step routed to (counted from the MoE layers' load counters)."""
    model = engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    experts = sum(p.numel() * p.element_size() for m in moes for p in m.experts.parameters())
    per_expert = experts / sum(m.experts.num_local_experts for m in moes)
    other = sum(p.numel() * p.element_size() for p in model.parameters()) - experts
    other -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    before = [m.expert_load.clone() for m in moes]
    engine.step()
    hit = sum(int(((m.expert_load - b) > 0).sum()) for m, b in zip(moes, before))
    return other + hit * per_expert


def run_steps(args: argparse.Namespace) -> dict:
    llm = LLM(checkpoint(args), dtype="bfloat16", num_blocks=1024, enable_prefix_caching=False)
    engine = llm.engine
    fused_available = cpu.available(cpu.OPS)
    read_bandwidth = ReadBandwidth()
    runner = engine.runner
    captured = runner.captured
    head_after = None if captured is None or captured.mode != "cpu_graph" else CapturedDecode(
        runner.model, runner.kv_caches, captured.mode, runner.capture_shape, runner.num_spec > 0, runner.tables,
        head=False)
    shortcut = sampling.plain_greedy
    rows = []
    for batch in args.batches:
        start_decode_batch(engine, batch, args.prompt_len, len(VARIANTS) * args.rounds * args.steps + 5, batch,
                           tag=f"b{batch}")
        nbytes = step_bytes(engine, batch)  # (also records the bucket's CPU graph)
        if head_after is not None:  # its graph recorded too, before the timed steps
            runner.captured = head_after
            engine.step()
            runner.captured = captured
        runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
        bandwidths: list[float] = []  # bytes/s, each round's (the mean of its readings around the recorded steps)
        try:
            for _ in range(args.rounds):
                for variant in VARIANTS:
                    runner.captured = {"graph": captured, "head_after": head_after}.get(variant)
                    sampling.plain_greedy = shortcut if variant != "head_after" else lambda params: False
                    cpu._available[cpu.OPS] = variant != "torch" and fused_available
                    before = read_bandwidth() if variant == "graph" else None
                    runs[variant].append(timed(engine, args.steps))
                    if before is not None:
                        bandwidths.append((before + read_bandwidth()) / 2)
        finally:
            runner.captured = captured
            sampling.plain_greedy = shortcut
            cpu._available[cpu.OPS] = fused_available
        breakdown = kernel_breakdown(captured, batch, args.steps) if captured is not None else {}
        while engine.has_unfinished_requests():
            engine.step()
        ms = {v: statistics.median(r) for v, r in runs.items()}
        floors = [1e3 * nbytes / bw for bw in bandwidths]  # each round's
        floor, bandwidth = statistics.median(floors), statistics.median(bandwidths)
        over = {v: statistics.median(t / f for t, f in zip(runs[v], floors)) for v in ("graph", "head_after")}
        rows.append({"batch": batch, **{f"{v}_ms": ms[v] for v in VARIANTS}, "floor_ms": floor,
                     "graph_over_floor": over["graph"], "head_after_over_floor": over["head_after"],
                     "eager_over_graph": ms["eager"] / ms["graph"], "rounds_floor_ms": floors,
                     "rounds_bandwidth_GBps": [bw / 1e9 for bw in bandwidths],
                     **{f"rounds_{v}_ms": runs[v] for v in VARIANTS}, "kernels_ms": breakdown})
        print(f"batch {batch:2d}: graph {ms['graph']:6.2f} ms  head after {ms['head_after']:6.2f} ms  "
              f"eager {ms['eager']:6.2f} ms  torch ops {ms['torch']:6.2f} ms  floor {floor:6.2f} ms "
              f"({nbytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s, the rounds' "
              f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}): graph {over['graph']:.2f}x the floor "
              f"(head after: {over['head_after']:.2f}x; the rounds' medians)")
        if breakdown:
            print("  where a replay goes (ms a step): " + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()))
    return {"fused_ops_available": fused_available, "capture": None if captured is None else captured.mode,
            "steps": rows}


def kernel_breakdown(captured, batch: int, replays: int) -> dict[str, float]:  # noqa: ANN001
    """ms a step per C kernel of the bucket's recorded CPU graph (each call timed in C, ``replays`` replays
    of the last step's inputs: what they compute is thrown away), largest first."""
    entry = next((e for (bucket, _), e in captured.graphs._cpu_graphs.items() if bucket == batch), None)
    if entry is None:
        return {}
    graph = entry[0]
    seconds = graph.timer()
    for _ in range(replays):
        graph.replay(seconds)
    totals: dict[str, float] = {}
    for call, s in zip(graph.calls, seconds):
        name = call.name.removeprefix("epserve_")
        totals[name] = totals.get(name, 0.0) + 1e3 * s / replays
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def run_contention(args: argparse.Namespace) -> dict:
    llm = LLM(checkpoint(args), dtype="bfloat16", num_blocks=1024, enable_prefix_caching=False)
    engine = llm.engine
    start_decode_batch(engine, 1, args.prompt_len, 2 * args.rounds * args.steps + 4, 0, tag="c")
    quiet, busy = [], []
    for _ in range(args.rounds):
        quiet.append(timed(engine, args.steps))
        proc = subprocess.Popen([sys.executable, "-c", BUSY[args.busy]])
        try:
            time.sleep(0.3)  # the competitor is running
            busy.append(timed(engine, args.steps))
        finally:
            proc.kill()
            proc.wait()
        time.sleep(0.3)
    q, b = statistics.median(quiet), statistics.median(busy)
    print(f"batch 1: quiet {q:.2f} ms, beside a busy {args.busy} process {b:.2f} ms: {b / q:.2f}x")
    return {"busy": args.busy, "quiet_ms": q, "busy_ms": b, "ratio": b / q, "rounds_quiet_ms": quiet,
            "rounds_busy_ms": busy}


def run_streams(args: argparse.Namespace) -> dict:
    bench = ["--num-prompts", str(args.num_prompts), "--max-concurrency", "16", "--random-input-len", "256",
             "--random-output-len", "32"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    with serving(["--model", str(checkpoint(args)), "--dtype", "bfloat16"], work / "serve.log") as (_, url):
        bench_serve(url, [*bench, "--num-prompts", "16"], work / "warm.json")
        r = bench_serve(url, bench, work / "streams.json")
    gap, tpot = r["median_itl_ms"], r["median_tpot_ms"]
    print(f"served: median gap between chunks {gap:.1f} ms, median TPOT {tpot:.1f} ms: {gap / tpot:.2f}x; "
          f"{r['output_token_throughput']:.1f} output tok/s")
    return {"median_chunk_gap_ms": gap, "median_tpot_ms": tpot, "gap_over_tpot": gap / tpot,
            "output_tok_per_s": r["output_token_throughput"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("steps", "contention", "streams"))
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (a quick check, not a figure)")
    ap.add_argument("--checkpoint", help="the checkpoint (made with the preset when missing)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=15, help="steps timed per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--busy", choices=sorted(BUSY), default="python", help="the competing process (contention)")
    ap.add_argument("--num-prompts", type=int, default=64, help="served requests (streams)")
    ap.add_argument("--work", default="/tmp/epserve-cpu-decode", help="server log and bench JSON (streams)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    run = {"steps": run_steps, "contention": run_contention, "streams": run_streams}[args.mode]
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}", "mode": args.mode, **run(args)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
