"""The host cost of one captured decode step's inputs against ``max_model_len``, on the CPU.

    PYTHONPATH=src .venv/bin/python benchmarks/decode_inputs.py [--buckets 16 256] [--context 4096]

A step of ``bucket`` rows, each with ``--context`` tokens in 16-token blocks, staged as the captured decode
stages it: ``DecodeGraphs.stage`` (five int64 values per row copied once, each row's block table gathered
from the device tables) where the tree has it, else the older ``pad_decode`` (each row's whole table
built on the host at ``max_model_len / 16`` columns), so the same script times a checkout from before
the device tables (run it with that checkout's ``src`` on ``PYTHONPATH``). Medians of ``--repeats`` calls, in
microseconds, with the host bytes each call stages; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from epserve.engine import graphs

BLOCK = 16


def median_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[repeats // 2] * 1e6


def one(bucket: int, context: int, max_model_len: int, repeats: int) -> dict:
    ids, lens = tuple(range(bucket)), (context,) * bucket
    width = -(-max_model_len // BLOCK)
    if hasattr(graphs.DecodeGraphs, "stage"):
        from epserve.engine.block_tables import DeviceTables

        staged = DeviceTables(width, 1 << 20, torch.device("cpu"), bucket + 1)
        decode = graphs.DecodeGraphs.__new__(graphs.DecodeGraphs)  # the staging alone, no model
        decode._inputs, decode.mtp, decode.tables = {}, False, staged
        step = graphs.DecodeStep.pad(ids, ids, ids, lens, tuple(range(1, bucket + 1)), bucket, 0)
        before = staged.staged_bytes
        decode.stage(step)
        host_bytes = staged.staged_bytes - before
        us = median_us(lambda: decode.stage(step), repeats)
        how = "DecodeGraphs.stage"
    else:
        tables = tuple(tuple(range(i * 300, i * 300 + context // BLOCK)) for i in range(bucket))
        cpu = torch.device("cpu")
        us = median_us(lambda: graphs.pad_decode(ids, ids, ids, lens, tables, bucket, width, 0, cpu), repeats)
        host_bytes = 8 * bucket * (4 + width)
        how = "pad_decode"
    return {"bucket": bucket, "max_model_len": max_model_len, "us": round(us, 1), "host_bytes": host_bytes,
            "how": how}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 163840], help="max_model_len values")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [one(b, args.context, n, args.repeats) for b in args.buckets for n in args.lengths]
    for r in rows:
        print(f"{r['how']}: bucket {r['bucket']:4d}, max_model_len {r['max_model_len']:7d}: {r['us']:8.1f} us, "
              f"{r['host_bytes']} host bytes")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
