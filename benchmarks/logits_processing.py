"""What logits processing and prompt logprobs cost, side by side in one run.

Decode: the step time (``engine.step()``: forward, processing, sampling, scheduler) of a steady decode
batch whose requests all use repetition, frequency and presence penalties, a 16-token ``logit_bias``
and ``min_tokens``, against the same batch without them; greedy and sampled (temperature 0.8, top-p
0.95), and the processing alone (``LogitsProcessor.apply`` on the same shape). Prefill: one step
prefilling ``--prefill-batch`` prompts with ``prompt_logprobs=5`` against
without. The `small` preset (bf16), with its vocabulary widened to DeepSeek-V3's 129280 by default
(processing costs batch x vocabulary; ``--vocab 0`` keeps the preset's 8192). Rounds alternate.

    .venv/bin/python benchmarks/logits_processing.py --batches 1 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import median_step_ms, start_decode_batch, wide_vocab_checkpoint

from epserve import LLM, SamplingParams
from epserve.engine.logits_processor import LogitsProcessor
from epserve.engine.request import Request

PROCESSED = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=4,
                 logit_bias={t: (-1.0) ** t * 2.0 for t in range(100, 116)})


def decode_ms(llm: LLM, batch: int, params: SamplingParams, steps: int, seed: int) -> float:
    engine = llm.engine
    start_decode_batch(engine, batch, 64, steps, seed, f"d{seed}", params)
    return median_step_ms(engine, steps)


def processor_ms(batch: int, vocab: int, device: str, steps: int = 20) -> float:
    """``LogitsProcessor.apply`` alone, in place, on [batch, vocab] logits: each request with a 64-token
    prompt and 10 outputs, one more output token per step (the median step)."""
    g = torch.Generator().manual_seed(0)
    proc = LogitsProcessor(vocab, torch.device(device))
    requests = []
    for i in range(batch):
        r = Request(f"r{i}", torch.randint(vocab, (64,), generator=g).tolist(),
                    SamplingParams(max_tokens=1000, **PROCESSED), eos_token_ids=(1,))
        for t in torch.randint(vocab, (10,), generator=g).tolist():
            r.append_output_token(t)
        requests.append(r)
    logits = torch.randn(batch, vocab, generator=g).to(device)
    times = []
    for _ in range(steps):
        x = logits.clone()
        for r in requests:
            r.append_output_token(int(torch.randint(vocab, (1,), generator=g)))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        proc.apply(x, requests, in_place=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def prefill_ms(llm: LLM, batch: int, prompt_len: int, prompt_logprobs: int | None, seed: int) -> float:
    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
    for i in range(batch):
        engine.add_request(f"p{seed}-{i}", torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params)
    t = time.perf_counter()
    engine.step()  # the whole batch fits one step's token budget
    elapsed = time.perf_counter() - t
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=129280, help="vocabulary size (0: the preset's)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = wide_vocab_checkpoint(args.vocab)
    budget = max(args.prefill_batch * args.prefill_len, max(args.batches))
    llm = LLM(path, dtype="bfloat16", device=args.device, num_blocks=4096, enable_prefix_caching=False,
              max_num_seqs=max(args.batches + [args.prefill_batch]), max_num_batched_tokens=budget)
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
                          f"{torch.__version__}, {args.device}", "vocab": llm.config.model.vocab_size, "decode": [],
               "prefill": {}}
    for batch in args.batches:
        for temperature in (0.0, 0.8):
            plain = SamplingParams(temperature=temperature, top_p=0.95, ignore_eos=True)
            processed = SamplingParams(temperature=temperature, top_p=0.95, ignore_eos=True, **PROCESSED)
            decode_ms(llm, batch, plain, 3, 0)  # warm-up
            decode_ms(llm, batch, processed, 3, 1)
            off, on = [], []
            for r in range(args.rounds):
                off.append(decode_ms(llm, batch, plain, args.steps, 10 + r))
                on.append(decode_ms(llm, batch, processed, args.steps, 20 + r))
            row = {"batch": batch, "temperature": temperature, "off_ms": statistics.median(off),
                   "on_ms": statistics.median(on), "rounds_off": off, "rounds_on": on}
            row["ratio"] = row["on_ms"] / row["off_ms"]
            row["processor_alone_ms"] = processor_ms(batch, llm.config.model.vocab_size, args.device)
            results["decode"].append(row)
            print(f"decode batch {batch} temperature {temperature}: off {row['off_ms']:.2f} ms, on "
                  f"{row['on_ms']:.2f} ms ({row['ratio']:.3f}x); the processing alone "
                  f"{row['processor_alone_ms']:.3f} ms", flush=True)
    prefill_ms(llm, args.prefill_batch, args.prefill_len, None, 0)  # warm-up
    off, on = [], []
    for r in range(args.rounds):
        off.append(prefill_ms(llm, args.prefill_batch, args.prefill_len, None, 30 + r))
        on.append(prefill_ms(llm, args.prefill_batch, args.prefill_len, 5, 40 + r))
    results["prefill"] = {"prompts": args.prefill_batch, "prompt_len": args.prefill_len,
                          "off_ms": statistics.median(off), "on_ms": statistics.median(on),
                          "rounds_off": off, "rounds_on": on}
    results["prefill"]["ratio"] = results["prefill"]["on_ms"] / results["prefill"]["off_ms"]
    print(f"prefill {args.prefill_batch} x {args.prefill_len}: off {results['prefill']['off_ms']:.1f} ms, "
          f"prompt_logprobs=5 {results['prefill']['on_ms']:.1f} ms ({results['prefill']['ratio']:.3f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
