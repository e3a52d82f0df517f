"""epserve vs transformers `generate` on the `small` preset, in one run, plus decode step times
against the weight-streaming bound.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 16 --prompt-len 64 --max-tokens 32]

Prints a table and writes JSON (``--json``). Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
from common import start_decode_batch
from tqdm import tqdm

from epserve import LLM, SamplingParams
from epserve.model.moe import MoE
from epserve.presets import make_checkpoint


class ReadBandwidth:
    """The device's memory read bandwidth now, in bytes/s: the best of ``repeats`` reductions over one array
    (1 GiB: far larger than any cache), which is what streaming weights needs; the array is kept between
    readings (``cpu_decode.py steps`` reads it every round)."""

    def __init__(self, device: str = "cpu", num_bytes: int = 1 << 30) -> None:
        self.data = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        self.num_bytes = num_bytes
        float(self.data.sum())

    def __call__(self, repeats: int = 3) -> float:
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            float(self.data.sum())  # float() waits for the device
            best = min(best, time.perf_counter() - t)
        return self.num_bytes / best


def measure_bandwidth(device: str, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """One reading of :class:`ReadBandwidth`, its array made for it."""
    return ReadBandwidth(device, num_bytes)(repeats)


def decode_step_profile(llm: LLM, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    """Time ``steps`` decode steps at a fixed batch; count the weight bytes each step touches."""
    engine = llm.engine
    model = engine.runner.model
    start_decode_batch(engine, batch, prompt_len, steps, seed, tag=f"dec{batch}")
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    expert_bytes = sum(p.numel() * p.element_size() for m in moes for p in m.experts.parameters())
    per_expert = expert_bytes // sum(m.experts.num_local_experts for m in moes)
    other_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_bytes
    other_bytes -= model.embed_tokens.numel() * model.embed_tokens.element_size()  # only B rows are read
    times, touched = [], []
    for _ in range(steps):
        before = [m.expert_load.clone() for m in moes]
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        hit = sum(int(((m.expert_load - b) > 0).sum()) for m, b in zip(moes, before))
        touched.append(other_bytes + hit * per_expert)
    while engine.has_unfinished_requests():
        engine.step()
    times.sort()
    return {
        "batch": batch,
        "step_ms_median": 1e3 * times[len(times) // 2],
        "bytes_per_step": sum(touched) / len(touched),
    }


def load_transformers(path: Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> torch.nn.Module:
    """transformers' ``DeepseekV3ForCausalLM`` of the checkpoint at ``path``, in ``dtype``, for inference (the
    checkpoint's MTP layer, which it has no module for, left out without its load report)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def transformers_generate_s(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds of one greedy ``generate`` of exactly ``max_tokens`` tokens after each of ``prompts`` (one batch)."""
    x = torch.tensor(prompts, device=next(model.parameters()).device)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        elapsed = time.perf_counter() - t
    assert out.shape[1] == x.shape[1] + max_tokens
    return elapsed


def run_transformers(path: Path, prompts: list[list[int]], max_tokens: int, device: str) -> float:
    model = load_transformers(path, torch.bfloat16, device)
    transformers_generate_s(model, prompts[:2], 4)  # warm-up
    return transformers_generate_s(model, prompts, max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=os.path.expanduser("~/.cache/epserve/bench-small"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()

    path = Path(args.checkpoint)
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype="bfloat16", seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 8000, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    num_out = args.num_prompts * args.max_tokens
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    results: dict = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                                f"torch {torch.__version__}, {torch.get_num_threads()} threads"}
    results["read_bandwidth_GBps"] = measure_bandwidth(args.device) / 1e9
    if args.device != "cpu":
        results["machine"] += f", {torch.cuda.get_device_name(args.device)}"
    llm = LLM(path, dtype="bfloat16", device=args.device, num_blocks=1024, enable_prefix_caching=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    best = float("inf")
    for _ in tqdm(range(args.repeats), desc="epserve"):
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - t)
    assert all(len(o.token_ids) == args.max_tokens for o in outs)
    results["epserve_s"] = best
    results["epserve_tok_per_s"] = num_out / best
    bw = results["read_bandwidth_GBps"] * 1e9
    results["decode"] = []
    for batch in tqdm((1, 16), desc="decode steps"):
        prof = decode_step_profile(llm, batch, args.prompt_len, steps=16, seed=batch)
        prof["bound_ms"] = 1e3 * prof["bytes_per_step"] / bw
        prof["ratio_to_bound"] = prof["step_ms_median"] / prof["bound_ms"]
        results["decode"].append(prof)
    del llm
    if not args.skip_transformers:
        hf = min(run_transformers(path, prompts, args.max_tokens, args.device)
                 for _ in tqdm(range(args.repeats), desc="transformers"))
        results["transformers_s"] = hf
        results["transformers_tok_per_s"] = num_out / hf
        results["speedup"] = hf / best

    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
