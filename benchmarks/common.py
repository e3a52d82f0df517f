"""Shared by the benchmark scripts: bring an engine to a steady decode batch."""

from __future__ import annotations

import torch

from epserve.engine.engine import LLMEngine
from epserve.engine.request import SamplingParams


def start_decode_batch(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int, tag: str) -> None:
    """Queue ``batch`` requests of ``prompt_len`` random tokens that will decode for at least ``steps``
    more steps, run their prefills, then one warm decode step: the next ``engine.step()`` is a pure
    decode step of ``batch`` sequences."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()
