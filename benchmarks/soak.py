"""Soak: thousands of mixed requests against a running server, with aborts and preemption; resident
memory of the router and of every rank before and after, and the KV cache back to empty.

Requests: token-id prompts (mostly short, a third 200-400 tokens so the KV cache overflows and the
scheduler preempts), 1-11 new tokens, ``n`` 1 or 2, random temperature, streamed or not; 15% are
abandoned (a stream dropped after its first events, or a whole response given up after 0.2 s).

    python benchmarks/soak.py                                  # starts `epserve serve --dp 2`, 5000 requests
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid PID --requests 1200   # a running server
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from epserve.parallel.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
MB = 1 << 20


async def _one(client: httpx.AsyncClient, rng: random.Random) -> str:
    length = rng.choice([rng.randrange(1, 40), rng.randrange(1, 40), rng.randrange(200, 400)])
    body = {"prompt": [rng.randrange(3, 500) for _ in range(length)], "max_tokens": rng.randrange(1, 12),
            "n": rng.choice([1, 1, 1, 2]), "temperature": rng.random(), "ignore_eos": True,
            "stream": rng.random() < 0.5}
    drop = rng.random() < 0.15
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data: {")
                    if drop and events >= 1:
                        return "dropped"
                return str(r.status_code)
        r = await client.post("/v1/completions", json=body, timeout=0.2 if drop else 120)
        return str(r.status_code)
    except httpx.TimeoutException:
        return "gave up"


async def _run(url: str, n: int, concurrency: int, seed: int) -> collections.Counter:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=2 * concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        async def gated() -> str:
            async with gate:
                return await _one(client, rng)

        return collections.Counter(await asyncio.gather(*(gated() for _ in range(n))))


def processes(pid: int) -> dict[str, psutil.Process]:
    """The router and the ranks of the server whose main process is ``pid``, by process name
    (``epserve-router``, ``epserve-rank0``, …)."""
    return {p.name().removeprefix("epserve-"): p for p in psutil.Process(pid).children(recursive=True)
            if p.name().startswith("epserve-")}


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            out[head.split("{")[0]] += float(value)
    return out


def wait_idle(url: str, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["epserve:num_requests_running"] == 0 and m["epserve:kv_cache_usage_perc"] == 0) or \
                time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def soak(url: str, pid: int, requests: int, concurrency: int = 32, seed: int = 0) -> dict:
    asyncio.run(_run(url, 100, concurrency, seed + 1))  # warm up: allocator pools, compiled paths
    wait_idle(url)
    procs = processes(pid)
    before = {name: p.memory_info().rss for name, p in procs.items()}
    preempted = metrics(url)["epserve:num_preemptions_total"]
    start = time.monotonic()
    outcomes = asyncio.run(_run(url, requests, concurrency, seed))
    seconds = time.monotonic() - start
    m = wait_idle(url)
    after = {name: p.memory_info().rss for name, p in procs.items()}
    return {"requests": requests, "seconds": seconds, "outcomes": dict(outcomes),
            "preemptions": m["epserve:num_preemptions_total"] - preempted,
            "kv_cache_usage_after": m["epserve:kv_cache_usage_perc"],
            "running_after": m["epserve:num_requests_running"],
            "rss_before": before, "rss_after": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (with --pid, its main process)")
    p.add_argument("--pid", type=int, default=None)
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    proc = None
    if args.url is None:
        port = free_port()
        env = {**os.environ, "EPSERVE_THREADS_PER_RANK": "1", "EPSERVE_NO_PROGRESS": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "epserve.cli", "serve", "--dp", "2", "--port", str(port),
                                 "--dtype", "float32", "--num-blocks", "128", "--max-model-len", "1024"],
                                env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        args.url, args.pid = f"http://127.0.0.1:{port}", proc.pid
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{args.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                print("the server did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
    try:
        result = soak(args.url, args.pid, args.requests, args.concurrency, args.seed)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    rate = result['requests'] / result['seconds']
    print(f"{result['requests']} requests in {result['seconds']:.0f} s ({rate:.0f}/s): "
          f"{result['outcomes']}; {result['preemptions']:.0f} preemptions; KV in use after: "
          f"{result['kv_cache_usage_after']:.0%}")
    for name, rss in result["rss_before"].items():
        print(f"  {name:<7} RSS {rss / MB:7.1f} MB -> {result['rss_after'][name] / MB:7.1f} MB "
              f"({(result['rss_after'][name] - rss) / MB:+.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0



if __name__ == "__main__":
    sys.exit(main())
