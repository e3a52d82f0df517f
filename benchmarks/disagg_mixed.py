"""Colocated vs prefill/decode-disaggregated serving on a mixed workload, on the same cores.

Many requests decode (short prompts, long outputs) while long prompts keep arriving (short outputs).
Colocated, each long prompt's prefill runs in the same lockstep steps as every decode of its EP world,
so the decodes' inter-token latency jumps while it runs; disaggregated, the prefill runs on a prefill
instance and only its KV reaches the decode instance. Both deployments use the same number of rank
processes: ``serve --dp 2`` (one world of two instances) against ``serve --disaggregate --prefill-dp 1
--decode-dp 1`` (two worlds of one); and ``serve --dp 1`` (one rank, every core, no collectives).
Reports, per deployment: the decoders' ITL p50/p99 and mean, their
output throughput, the long prompts' TTFT p50/p99, total output tokens/s.

    python benchmarks/disagg_mixed.py                       # tiny model, 16 decoders, 12 long prompts
    python benchmarks/disagg_mixed.py --decoders 32 --long-prompts 24 --long-len 1500 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serving  # noqa: E402

from epserve.bench.datasets import BenchRequest  # noqa: E402
from epserve.bench.roles import role_figures  # noqa: E402
from epserve.bench.serve import completion_payload, send_request  # noqa: E402

DEPLOYMENTS = {
    "colocated": ["--dp", "2"],
    "disaggregated": ["--disaggregate", "--prefill-dp", "1", "--decode-dp", "1"],
    # One rank with every core: no collectives at all (a CPU's gloo exchanges in every MoE layer of the
    # two-rank world are not what disaggregation removes), prefills still inside the decode steps.
    "colocated-1rank": ["--dp", "1"],
}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def workload(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    vocab = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["vocab_size"]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 1) for _ in range(n)]

    decoders = [BenchRequest(prompt(args.short_len), args.decode_len) for _ in range(args.decoders)]
    longs = [BenchRequest(prompt(args.long_len), args.long_output) for _ in range(args.long_prompts)]
    url = f"{url}/v1/completions"
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        start = time.perf_counter()

        async def long_after(i: int, req: BenchRequest):
            await asyncio.sleep(args.warmup + i * args.long_interval)  # the decoders are decoding by then
            return await send_request(client, url, completion_payload(args.model_name, req, 0.0), {}, start)

        tasks = [send_request(client, url, completion_payload(args.model_name, r, 0.0), {}, start) for r in decoders]
        tasks += [long_after(i, r) for i, r in enumerate(longs)]
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        metrics = (await client.get(url.replace("/v1/completions", "/metrics"))).text
    dec, lng = records[: len(decoders)], records[len(decoders) :]
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    window = (args.warmup, args.warmup + args.long_prompts * args.long_interval)
    itl = [gap for r in dec for gap in r.itl]
    # ITL of decode steps while the long prompts arrive (a token's time: start + ttft + the gaps so far).
    during = []
    for r in dec:
        t = r.start_time + r.ttft
        for gap in r.itl:
            t += gap
            if window[0] <= t <= window[1]:
                during.append(gap)
    out_tokens = sum(r.output_tokens for r in records)
    # The decode side's transfer times since the server started (the warm-up's included).
    transfer_ms = [r.transfer_mean_ms for r in role_figures("", metrics, records) if r.transfer_mean_ms is not None]
    return {
        "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99),
        "itl_during_p50_ms": 1e3 * pct(during, 0.5), "itl_during_p99_ms": 1e3 * pct(during, 0.99),
        "itl_mean_ms": 1e3 * statistics.fmean(itl),
        "decode_tok_s": sum(r.output_tokens for r in dec) / max(r.e2e + r.start_time for r in dec),
        "long_ttft_p50_s": pct([r.ttft for r in lng], 0.5), "long_ttft_p99_s": pct([r.ttft for r in lng], 0.99),
        "total_tok_s": out_tokens / wall, "wall_s": wall,
        "kv_transfer_mean_s": transfer_ms[0] / 1e3 if transfer_ms else float("nan"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: built-in tiny model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--deployments", nargs="+", choices=list(DEPLOYMENTS), default=list(DEPLOYMENTS),
                   help="which to run (one GPU: disaggregated only; two ranks of one world cannot share it)")
    p.add_argument("--decoders", type=int, default=16)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--decode-len", type=int, default=256)
    p.add_argument("--long-prompts", type=int, default=12)
    p.add_argument("--long-len", type=int, default=1000)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--long-interval", type=float, default=0.5, help="seconds between long prompts")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of decoding before the first long prompt")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    args.model_name = args.model or "epserve-tiny"  # the served model id
    common = [*([args.model] if args.model else []), "--dtype", args.dtype, "--device", args.device,
              "--num-blocks", "1024",
              "--max-model-len", str(max(2048, args.long_len + 64)), "--max-num-seqs", "64"]
    results: dict[str, list[dict]] = {name: [] for name in args.deployments}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in args.deployments:
                extra = DEPLOYMENTS[name]
                with serving([*common, *extra], Path(tmp) / f"{name}{rep}.log") as (_, url):
                    asyncio.run(workload(url, argparse.Namespace(**{**vars(args), "long_prompts": 1})))  # warm
                    results[name].append(asyncio.run(workload(url, args)))
                print(name, json.dumps(results[name][-1]), flush=True)
    keys = list(next(iter(results.values()))[0])
    print("\n| deployment | " + " | ".join(keys) + " |")
    print("|---|" + "---|" * len(keys))
    for name, runs in results.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[k] for r in runs):.3g}" for k in keys) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
