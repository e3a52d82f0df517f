"""What serving costs over the offline engine: the same requests through ``LLM.generate`` and through
``epserve serve`` (router + gRPC + HTTP streaming) driven by ``epserve bench serve``, side by side.

    .venv/bin/python benchmarks/serve_overhead.py [--model DIR] [--dp 1] [--rounds 2] [--quick]

Both sides get the bench client's ``random`` dataset (round r: seed + r, so the same token-id prompts
on both sides and nothing cached from an earlier round), greedy, ``ignore_eos``, all requests at once,
each engine warmed up first by an unmeasured run of the same size (the first run on a fresh engine
also pays for touching its KV-cache pages). The offline side runs ``LLM(model, dp=...)`` in this
process (dp 1) or its spawned ranks; with dp 1, one ``epserve engine`` is also driven straight over
gRPC from this process (no router, no HTTP); the served side starts a fresh server per round. Reported:
request throughput of each and their ratio, and the CPU seconds each process of the served side used
during the run (ranks, router, bench client), which on a small host is where the difference goes.
Writes JSON (``--out``, default in the cache dir); figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import bench_serve, serving

from epserve import LLM, SamplingParams, env
from epserve.bench.datasets import make_dataset
from epserve.config import ModelConfig
from epserve.env import cache_dir
from epserve.parallel.launch import free_port
from epserve.presets import default_model_path

WARMUP_SEED = 1000  # seed offset of each side's first, unmeasured, run of the same size


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawned_children(pid: int) -> list[int]:
    """The supervisor's rank and router processes (not multiprocessing's resource tracker)."""
    kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [k for k in kids if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


def offline(model: str, dp: int, warmup: list, datasets: list[list]) -> list[float]:
    """Requests per second of ``LLM.generate`` on each dataset (each its own seed: nothing cached)."""
    out = []
    with LLM(model, dp=dp) as llm:
        for i, requests in enumerate([warmup, *datasets]):
            prompts = [r.prompt_token_ids for r in requests]
            params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
            start = time.perf_counter()
            llm.generate(prompts, params)
            if i > 0:
                out.append(len(prompts) / (time.perf_counter() - start))
    return out


def served(model: str, dp: int, args: argparse.Namespace, seed: int, tmp: Path) -> dict:
    with serving([model, "--dp", str(dp)], tmp / "serve.log") as (server, url):
        # the supervisor's children: the ranks and the router (spawned), and the resource tracker
        kids = spawned_children(server.pid)
        for run_seed in (seed + WARMUP_SEED, seed):  # the first run warms the server up (KV pages touched)
            before = {p: cpu_seconds(p) for p in kids}
            result = bench_serve(url, ["--dataset", "random", "--num-prompts", str(args.num_prompts),
                                       "--random-input-len", str(args.input_len), "--random-output-len",
                                       str(args.output_len), "--seed", str(run_seed)], tmp / "bench.json")
        cpu = sorted((cpu_seconds(p) - before[p] for p in kids), reverse=True)
        result["cpu_s"] = {"processes (most first)": cpu, "bench client": result["client_cpu_s"]}
        return result


def over_grpc(model: str, datasets: list[list], tmp: Path, token: str | None = None) -> list[float]:
    """Requests per second of one ``epserve engine`` (dp 1) driven straight over gRPC from this
    process: the engine's online loop and gRPC streaming, without the router and HTTP; with ``token``,
    over mutual TLS under it, as routers call engines (``epserve serve`` always has one)."""
    import asyncio

    from epserve.router.engine_client import EngineClient

    port = free_port()
    log = (tmp / "engine.log").open("w")
    engine = subprocess.Popen([sys.executable, "-m", "epserve.cli", "engine", model, "--engine-port", str(port),
                               *(["--engine-token", token] if token else [])],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, env.NO_PROGRESS: "1"})

    async def run() -> list[float]:
        client = EngineClient(0, f"127.0.0.1:{port}", token)
        deadline = time.monotonic() + 300
        while not await client.is_serving(timeout=1.0):
            if engine.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"engine did not start:\n{(tmp / 'engine.log').read_text()[-3000:]}")
            await asyncio.sleep(0.2)

        async def one(rid: str, r) -> None:
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            async for _ in client.generate(rid, r.prompt_token_ids, params):
                pass

        out = []
        for k, requests in enumerate(datasets):
            start, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(one(f"{k}-{i}", r) for i, r in enumerate(requests)))
            wall = time.perf_counter() - start
            out.append(len(requests) / wall)
            print(f"gRPC{' (TLS)' if token else ''} run {k} (0: warm-up): {wall:.2f} s wall; "
                  f"this client's CPU {time.process_time() - cpu:.2f} s")
        await client.close()
        return out

    try:
        return asyncio.run(run())
    finally:
        engine.send_signal(signal.SIGTERM)
        engine.wait(120)
        log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.num_prompts, args.input_len, args.output_len = 1, 16, 64, 8
    model = args.model or default_model_path()
    config = ModelConfig.from_hf(model)

    def dataset(seed: int, n: int) -> list:
        return make_dataset("random", vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings,
                            seed=seed, num_prompts=n, random_input_len=args.input_len,
                            random_output_len=args.output_len)

    seeds = [args.seed + r for r in range(args.rounds)]  # the bench client draws the same prompts per seed
    warmup = dataset(args.seed + WARMUP_SEED, args.num_prompts)
    offline_rps = offline(str(model), args.dp, warmup, [dataset(s, args.num_prompts) for s in seeds])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        grpc_data = [warmup, *(dataset(s, args.num_prompts) for s in seeds)]
        grpc_rps = over_grpc(str(model), grpc_data, Path(tmp))[1:] if args.dp == 1 else []
        tls_rps = over_grpc(str(model), grpc_data, Path(tmp), "bench-token")[1:] if args.dp == 1 else []
        for seed in seeds:
            runs.append(served(str(model), args.dp, args, seed, Path(tmp)))
    served_rps = [float(r["request_throughput"]) for r in runs]
    off, srv = statistics.median(offline_rps), statistics.median(served_rps)
    out = args.out or cache_dir() / ("serve_overhead_quick.json" if args.quick else "serve_overhead.json")
    out.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores", "args": vars(args) |
                               {"out": str(out)}, "offline_rps": offline_rps, "grpc_rps": grpc_rps,
                               "grpc_tls_rps": tls_rps,
                               "served": runs},
                              indent=2, default=str))
    print(f"| side | req/s (median of {args.rounds}) | per round |\n|---|---|---|")
    print(f"| offline `LLM.generate` | {off:.2f} | {', '.join(f'{x:.2f}' for x in offline_rps)} |")
    if grpc_rps:
        g = statistics.median(grpc_rps)
        print(f"| `epserve engine` over gRPC | {g:.2f} | {', '.join(f'{x:.2f}' for x in grpc_rps)} |")
        t = statistics.median(tls_rps)
        print(f"| `epserve engine` over gRPC, mutual TLS | {t:.2f} | {', '.join(f'{x:.2f}' for x in tls_rps)} |")
    print(f"| served (`epserve serve` + `bench serve`) | {srv:.2f} | {', '.join(f'{x:.2f}' for x in served_rps)} |")
    print(f"\nserved / offline: {srv / off:.2f}x" + (f"; gRPC / offline: {g / off:.2f}x" if grpc_rps else ""))
    for i, r in enumerate(runs):
        cpu = r["cpu_s"]
        procs = ", ".join(f"{c:.2f}" for c in cpu["processes (most first)"])
        print(f"round {i}: {r['duration_s']:.2f} s wall; CPU s: server processes {procs}; bench client "
              f"{cpu['bench client']:.2f}")
    print(f"\nJSON: {out}")


if __name__ == "__main__":
    main()
