"""The CPU decode step with NVFP4 weights beside the same weights in bf16 and FP8, alternated in one run
(issue 42's goals).

    .venv/bin/python benchmarks/nvfp4_decode.py [--batches 1 16] [--rounds 8 --steps 10] [--json out.json]
    .venv/bin/python benchmarks/nvfp4_decode.py --quick        # the tiny128 preset: a check, not a figure

Three checkpoints of the `small` preset's weights (seed 0), made once into the cache: bf16 (the one the
other CPU benchmarks use, ``common.wide_vocab_checkpoint``), FP8 as DeepSeek publishes it (e4m3, 128x128 block
scales; ``fp8_engine.py``'s) and NVFP4 as ModelOpt exports it (``make-checkpoint --quantization nvfp4``: the
routed experts, shared experts and the dense MLP in four bits, attention, gate and lm_head as stored). One
engine each, in this process (bf16; ``quantization="fp8"`` keeps FP8 weights on the CPU; NVFP4 runs as
stored), each brought to a steady decode batch of ``--batches`` sequences; every round times ``--steps`` steps
of each engine (fewer, at least one, where they would take more than ``--round-budget-s``: a torch reference's
steps), the engines' order rotating between rounds so that all see the same machine; medians of the rounds'
medians. Each step's weight-streaming floor is the bytes it reads (every weight but the embedding, plus the
routed experts the step's tokens chose, counted from the MoE layers' load counters, as ``cpu_decode.py steps``
counts) at the read bandwidth measured in each round (their median). Whether each engine's decode replays a
recorded CPU graph (``cpu_graph``) or runs eagerly (a torch reference inside the step: FP8 on the CPU, NVFP4
without its C kernels) is reported beside its time.

From the checkpoint files: the routed experts' share of the bf16 bytes, and the NVFP4 bytes (packed weights,
e4m3 block scales, fp32 global and input scales) of the modules ModelOpt quantized over those modules' bf16
bytes.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import struct
import time
from pathlib import Path

import torch
from common import small_checkpoint, start_decode_batch
from cpu_decode import step_bytes, timed
from offline_throughput import measure_bandwidth
from tqdm import tqdm

from epserve import LLM
from epserve.presets import make_checkpoint

VARIANTS = ("bf16", "fp8", "nvfp4")
GOALS = {"b1_vs_bf16": 0.45, "b1_vs_fp8": 0.75, "b1_over_floor": 1.3, "b16_vs_bf16": 0.6, "bytes_vs_bf16": 0.29}
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


# ---- the checkpoints and their bytes ------------------------------------------------------------


def checkpoints(cache: Path, quick: bool) -> dict[str, Path]:
    """{variant: checkpoint directory}, each written once: `small` (``common.small_checkpoint``: the cache the
    other benchmarks use), or tiny128 into ``cache`` (quick)."""
    if not quick:
        return {v: small_checkpoint(None if v == "bf16" else v) for v in VARIANTS}
    paths = {v: cache / f"bench-tiny128-{v}" for v in VARIANTS}
    for variant, path in paths.items():
        if not (path / "config.json").exists():
            make_checkpoint(path, preset="tiny128", dtype="bfloat16", seed=0,
                            quantization=None if variant == "bf16" else variant)
    return paths


def tensor_table(path: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """{name: (dtype, shape, bytes)} of every tensor in ``path``'s safetensors files (their headers only)."""
    table = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                table[name] = (info["dtype"], tuple(info["shape"]), end - start)
    return table


def checkpoint_bytes(bf16: Path, nvfp4: Path, num_layers: int) -> dict:
    """The routed experts' share of the bf16 checkpoint (all of it, and the main model's layers without the MTP
    layer and the embedding), and the NVFP4 bytes of the quantized modules over their bf16 bytes."""
    dense, quant = tensor_table(bf16), tensor_table(nvfp4)
    total = sum(b for _, _, b in dense.values())
    main = {n: b for n, (_, _, b) in dense.items() if not n.startswith("model.embed_tokens")
            and not (n.startswith("model.layers.") and int(n.split(".")[2]) >= num_layers)}
    experts = sum(b for n, b in main.items() if ".mlp.experts." in n)
    modules = sorted(n.removesuffix(".weight_scale_2") for n in quant if n.endswith(".weight_scale_2"))
    suffixes = (".weight", ".weight_scale", ".weight_scale_2", ".input_scale")
    four_bit = sum(quant[m + s][2] for m in modules for s in suffixes if m + s in quant)
    as_bf16 = sum(dense[m + ".weight"][2] for m in modules)
    return {"checkpoint_bytes_bf16": total, "expert_share_all": sum(b for n, (_, _, b) in dense.items()
                                                                    if ".mlp.experts." in n) / total,
            "expert_share_main_model": experts / sum(main.values()), "quantized_modules": len(modules),
            "quantized_bf16_bytes": as_bf16, "quantized_nvfp4_bytes": four_bit, "bytes_vs_bf16": four_bit / as_bf16}


# ---- the engines ---------------------------------------------------------------------------------


def engines(paths: dict[str, Path], num_blocks: int) -> dict[str, LLM]:
    options = {"bf16": {}, "fp8": {"quantization": "fp8"}, "nvfp4": {}}
    return {v: LLM(paths[v], dtype="bfloat16", num_blocks=num_blocks, enable_prefix_caching=False, **options[v])
            for v in VARIANTS}


def recorded(llm: LLM, batch: int) -> bool:
    """Whether ``batch``'s decode bucket replays a recorded CPU graph (after its first step)."""
    captured = llm.engine.runner.captured
    if captured is None or captured.mode != "cpu_graph":
        return False
    graphs = captured.graphs
    bucket = graphs.bucket_for(batch)
    return any(b == bucket for b, _ in graphs._cpu_graphs)


def measure(llms: dict[str, LLM], batch: int, args: argparse.Namespace) -> dict:
    """One batch size: every engine at a steady decode batch, ``--rounds`` rounds of ``--steps`` steps each,
    the engines' order rotating, the read bandwidth measured in each round too; medians, floors, ratios."""
    for v, llm in llms.items():
        start_decode_batch(llm.engine, batch, args.prompt_len, args.rounds * args.steps + 6, batch, tag=f"{v}{batch}")
    nbytes = {v: step_bytes(llm.engine, batch) for v, llm in llms.items()}  # (also records each bucket's graph)
    # steps a round: --steps, fewer for an engine whose step is slow (a torch reference: seconds at batch 16)
    steps = {v: max(1, min(args.steps, int(args.round_budget_s * 1e3 / timed(llm.engine, 1))))
             for v, llm in llms.items()}
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    bandwidths = []
    for r in tqdm(range(args.rounds), desc=f"batch {batch}, alternated", disable=args.quick):
        bandwidths.append(measure_bandwidth("cpu", num_bytes=(64 << 20) if args.quick else 1 << 30, repeats=3))
        for v in VARIANTS[r % 3:] + VARIANTS[: r % 3]:
            runs[v].append(timed(llms[v].engine, steps[v]))
    rec = {v: recorded(llm, batch) for v, llm in llms.items()}
    for v, llm in llms.items():  # the rest of the requests aborted (a slow engine timed fewer of their steps)
        for i in range(batch):
            llm.engine.abort_request(f"{v}{batch}-{i}")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    ms = {v: statistics.median(runs[v]) for v in VARIANTS}
    bandwidth = statistics.median(bandwidths)
    floor = {v: 1e3 * nbytes[v] / bandwidth for v in VARIANTS}
    return {"batch": batch, "read_bandwidth_GBps": bandwidth / 1e9, **{f"{v}_ms": ms[v] for v in VARIANTS},
            **{f"{v}_floor_ms": floor[v] for v in VARIANTS},
            **{f"{v}_step_bytes": nbytes[v] for v in VARIANTS}, **{f"{v}_recorded": rec[v] for v in VARIANTS},
            **{f"{v}_steps_a_round": steps[v] for v in VARIANTS},
            **{f"{v}_best_round_ms": min(runs[v]) for v in VARIANTS},
            "nvfp4_vs_bf16": ms["nvfp4"] / ms["bf16"], "nvfp4_vs_fp8": ms["nvfp4"] / ms["fp8"],
            "nvfp4_over_floor": ms["nvfp4"] / floor["nvfp4"], "bytes_bound_vs_bf16": nbytes["nvfp4"] / nbytes["bf16"],
            **{f"rounds_{v}_ms": runs[v] for v in VARIANTS}}


def verdicts(rows: list[dict], sizes: dict) -> dict[str, dict]:
    """Each goal of issue 42 with its measured value and whether it holds."""
    by = {row["batch"]: row for row in rows}
    found = {"bytes_vs_bf16": sizes["bytes_vs_bf16"]}
    if 1 in by:
        found.update(b1_vs_bf16=by[1]["nvfp4_vs_bf16"], b1_vs_fp8=by[1]["nvfp4_vs_fp8"],
                     b1_over_floor=by[1]["nvfp4_over_floor"])
    if 16 in by:
        found["b16_vs_bf16"] = by[16]["nvfp4_vs_bf16"]
    return {k: {"value": v, "goal": GOALS[k], "met": v <= GOALS[k]} for k, v in found.items()}


def markdown(result: dict, command: str) -> str:
    lines = ["| batch | bf16 (ms) | FP8 (ms) | NVFP4 (ms) | NVFP4 floor (ms) | NVFP4 / bf16 | NVFP4 / FP8 | "
             "NVFP4 / floor | bytes read, NVFP4 / bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["steps"]:
        mark = {v: "" if row[f"{v}_recorded"] else "*" for v in VARIANTS}
        lines.append(f"| {row['batch']} | {row['bf16_ms']:.2f}{mark['bf16']} | {row['fp8_ms']:.2f}{mark['fp8']} | "
                     f"{row['nvfp4_ms']:.2f}{mark['nvfp4']} | {row['nvfp4_floor_ms']:.2f} | "
                     f"**{row['nvfp4_vs_bf16']:.2f}×** | **{row['nvfp4_vs_fp8']:.2f}×** | "
                     f"**{row['nvfp4_over_floor']:.2f}×** | {row['bytes_bound_vs_bf16']:.2f}× |")
    s = result["sizes"]
    bandwidth = " and ".join(f"{row['read_bandwidth_GBps']:.1f}" for row in result["steps"])
    goals = ", ".join(f"{k} {g['value']:.2f} (goal ≤ {g['goal']}: {'met' if g['met'] else 'not met'})"
                      for k, g in result["goals"].items())
    best = "; ".join(f"batch {row['batch']}: " + ", ".join(f"{v} {row[f'{v}_best_round_ms']:.2f}" for v in VARIANTS)
                     + f" ms (NVFP4 / bf16 {row['nvfp4_best_round_ms'] / row['bf16_best_round_ms']:.2f}×)"
                     for row in result["steps"])
    lines += ["", f"Best round (the least of the rounds' medians, the least disturbed by other load): {best}.",
              "", "\\* eager steps (a torch reference in the step); the others replay the recorded CPU graph. "
              f"Routed experts hold {100 * s['expert_share_main_model']:.0f}% of the main model's bf16 bytes "
              f"({100 * s['expert_share_all']:.0f}% of the checkpoint's with the MTP layer and embedding). NVFP4 "
              f"weights + scales of the {s['quantized_modules']} quantized modules: "
              f"{s['quantized_nvfp4_bytes'] / 1e6:.0f} MB against {s['quantized_bf16_bytes'] / 1e6:.0f} MB in bf16 "
              f"(**{s['bytes_vs_bf16']:.3f}×**). Goals: {goals}. {result['machine']}, read bandwidth (median of the "
              f"rounds') {bandwidth} GB/s; `{command}`, {result['date']}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "epserve"), help="the quick run's checkpoints")
    ap.add_argument("--quick", action="store_true", help="tiny128 preset, 1 round of 2 steps (a check)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="steps timed per engine per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--round-budget-s", type=float, default=5.0,
                    help="an engine whose step is slow times fewer steps a round (at least one): about this long")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.prompt_len = 1, 2, 8
    paths = checkpoints(Path(args.cache), args.quick)
    config = json.loads((paths["bf16"] / "config.json").read_text())
    sizes = checkpoint_bytes(paths["bf16"], paths["nvfp4"], config["num_hidden_layers"])
    llms = engines(paths, num_blocks=64 if args.quick else 512)
    rows = [measure(llms, batch, args) for batch in args.batches]
    result = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                         f"torch {torch.__version__}", "date": time.strftime("%Y-%m-%d"),
              "checkpoints": {v: str(p) for v, p in paths.items()},
              "sizes": sizes, "steps": rows, "goals": verdicts(rows, sizes)}
    print(markdown(result, "python benchmarks/nvfp4_decode.py " + " ".join(__import__("sys").argv[1:])))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
