"""CPU decoding beside other work: batch-1 generation and an offline batch, quiet and beside busy processes,
epserve with its OpenMP waits following the load (``kernels/cpu_threads.py``) and with libgomp's own
(``EPSERVE_CPU_ADAPT=0``, what epserve did before), and vLLM's CPU build under the same loads in the same run.

    .venv/bin/python benchmarks/cpu_contention.py                      # epserve, adapted and not
    .venv/bin/python benchmarks/cpu_contention.py --peers vllm         # and vLLM (benchmarks/peer_vllm.py's venv)
    .venv/bin/python benchmarks/cpu_contention.py --tiny --rounds 1    # a quick check, not a figure

A load is a number of busy processes started beside the engines: Python ``while True: pass`` loops
(``python``), or two-thread torch matmul loops (``torch``, OpenMP spinning of their own). Each round starts
each load in turn and, while it runs, measures every system (their order turns each round): a batch-1
generation (``--b1-tokens`` tokens after a ``--prompt-len``-token prompt: ms a token, its prefill
included) and an offline batch (``--num-prompts`` prompts: output tokens a second). Medians of the rounds;
a system's slowdown under a load is its figure under the first load (``quiet``) over the loaded one. Short
generations by default: libgomp's spinning waits under three busy processes run at a few tokens a second.
Both engines run bf16 on the `small` preset with the host's cores (vLLM bound to cores 0..threads-1, as
``peer_vllm.vllm_env`` sets). Figures go in docs/benchmarks.md.

Each busy process runs in a session of its own, as other jobs on a host do. Where the kernel groups
scheduling by session (``/proc/sys/kernel/sched_autogroup_enabled``), a session's processes share one fair share
of the CPU: loads in the benchmark's own session would compete with epserve (which runs in this process) thread
by thread, while vLLM's child, in its own session, would get half the cores whatever the load.
``--shared-session`` starts them in this session, to show that difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from common import wide_vocab_checkpoint

from epserve import LLM, SamplingParams
from epserve.kernels import cpu_threads
from epserve.presets import make_checkpoint

BUSY = {"python": "while True: pass",
        "torch": "import torch\ntorch.set_num_threads(2)\na = torch.randn(64, 64)\nwhile True: a = (a @ a).tanh()"}
LOADS = ("quiet", "python:1", "python:3", "torch:1", "torch:3")
SETTLE_S = 0.6  # after a load starts or the waits' mode changes: the monitor's readings see it (PERIOD_S 0.15)


@contextlib.contextmanager
def load(spec: str, own_session: bool = True) -> Iterator[None]:
    """``quiet``, or ``KIND:N``: N busy processes of BUSY[KIND] for the block's duration, each in a session of its
    own unless ``own_session`` is False."""
    procs = []
    if spec != "quiet":
        kind, n = spec.split(":")
        procs = [subprocess.Popen([sys.executable, "-c", BUSY[kind]], start_new_session=own_session)
                 for _ in range(int(n))]
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()
    time.sleep(0.2)


def adapt(on: bool) -> None:
    """epserve's waits follow the load (the monitor runs) or are libgomp's own (no monitor, spinning)."""
    cpu_threads.stop()  # (the waits spin)
    os.environ["EPSERVE_CPU_ADAPT"] = "1" if on else "0"
    cpu_threads.threads()  # starts a new monitor when on
    time.sleep(SETTLE_S)


Generate = Callable[[list[list[int]], int], float]  # (prompts, tokens each) -> seconds


def measure(generate: Generate, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, float]:
    b1 = generate(prompts[:1], args.b1_tokens)
    batch = generate(prompts, args.max_tokens)
    return {"b1_ms_per_token": 1e3 * b1 / args.b1_tokens, "offline_tok_s": len(prompts) * args.max_tokens / batch}


def epserve_generate(llm: LLM) -> Generate:
    def run(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        assert all(len(o.token_ids) == tokens for o in outs)
        return elapsed
    return run


def checkpoint(args: argparse.Namespace) -> Path:
    if not args.tiny:
        return wide_vocab_checkpoint(0)
    path = Path.home() / ".cache" / "epserve" / "bench-tiny-bf16"
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="tiny", dtype="bfloat16", seed=0)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny preset (a quick check, not a figure)")
    ap.add_argument("--loads", nargs="+", default=list(LOADS), help="quiet or KIND:N, KIND one of " + str(list(BUSY)))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--b1-tokens", type=int, default=16, help="tokens of the batch-1 generation")
    ap.add_argument("--num-prompts", type=int, default=16, help="prompts of the offline batch")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens each of the offline batch's prompts")
    ap.add_argument("--peers", nargs="*", default=[], choices=["vllm"], help="vLLM's CPU build beside epserve")
    ap.add_argument("--shared-session", action="store_true",
                    help="the busy processes in this process's session (see the module's docstring)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    path = checkpoint(args)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]
    threads = torch.get_num_threads()
    llm = LLM(path, dtype="bfloat16", num_blocks=1024, enable_prefix_caching=False)
    run = epserve_generate(llm)
    run(prompts[:2], 4)  # warm: the recorded steps
    systems: dict[str, Callable[[], dict[str, float]]] = {}
    for name, on in (("epserve", True), ("epserve, libgomp's waits", False)):
        systems[name] = lambda on=on: (adapt(on), measure(run, args, prompts))[1]
    with contextlib.ExitStack() as stack:
        if "vllm" in args.peers:
            from peer_vllm import VllmOffline

            vllm = stack.enter_context(VllmOffline(path, threads=threads, dtype="bfloat16"))
            systems[f"vLLM {vllm.info['version']}"] = lambda: measure(
                lambda p, n: vllm.generate(p, n)["seconds"], args, prompts)
        results: dict[str, dict[str, list[dict[str, float]]]] = {s: {spec: [] for spec in args.loads} for s in systems}
        names = list(systems)
        for r in range(args.rounds):
            for spec in args.loads:
                with load(spec, own_session=not args.shared_session):
                    for name in names[r % len(names):] + names[: r % len(names)]:
                        results[name][spec].append(systems[name]())
                        print(f"round {r + 1} {spec:9s} {name}: {results[name][spec][-1]}", flush=True)
    cpu_threads.stop()
    rows = report(results, args.loads)
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {threads} threads, "
                      f"torch {torch.__version__}, autogroup {autogroup()}",
           "checkpoint": str(path), "args": vars(args), "rows": rows, "rounds": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def autogroup() -> str:
    """Whether the kernel groups scheduling by session (``1``), ``0``, or ``unknown``."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        return "unknown"


def report(results: dict[str, dict[str, list[dict[str, float]]]], loads: list[str]) -> list[dict]:
    """Medians a (system, load), with the slowdown against the system's quiet figures; printed as a table."""
    rows = []
    print(f"\n{'system':28s} {'load':9s} {'b1 ms/token':>12s} {'x quiet':>8s} {'offline tok/s':>14s} {'x quiet':>8s}")
    for system, by_load in results.items():
        base = None
        for spec in loads:
            b1 = statistics.median(m["b1_ms_per_token"] for m in by_load[spec])
            tok = statistics.median(m["offline_tok_s"] for m in by_load[spec])
            if base is None:
                base = (b1, tok)
            row = {"system": system, "load": spec, "b1_ms_per_token": b1, "b1_slowdown": b1 / base[0],
                   "offline_tok_s": tok, "offline_slowdown": base[1] / tok}
            rows.append(row)
            print(f"{system:28s} {spec:9s} {b1:12.2f} {row['b1_slowdown']:8.2f} {tok:14.1f} "
                  f"{row['offline_slowdown']:8.2f}")
    return rows


if __name__ == "__main__":
    main()
