"""Calibration from decode steps of the engine itself.

- ``engine_step``: the ``tiny`` preset, a model too small to do work, so that what a step spends
  beyond the priced kernels is host overhead. On the CPU the cores' private caches are flushed before
  every attention and FFN block (and the flush's time taken off), because in a real model the
  weights each block streams evict the runtime's own state from the caches the host shares with the
  kernels.
- ``engine_stream``: a synthetic *wide* model (the ``tiny`` preset's attention and routing with
  ``WIDE`` overrides: hidden 1024, 32-64 experts of 3 MiB, 8 active per token) whose weights exceed
  the last-level cache several times and whose step at batch 1 streams 2-3x that cache. What its steps
  spend beyond the planner's price (host overhead included) is the weight streaming being slower
  inside a step than the back-to-back kernel timings: ``stream_efficiency``. No flushing: its own
  weights evict the caches.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from epserve.planner.hardware import MeasuredPoint

WIDE = {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts_per_tok": 8}


def engine_config(layers: int, experts: int = 0) -> dict:
    """``config.json`` of the ``tiny`` preset at ``layers`` layers; with ``experts``, of the wide
    streaming model with that many routed experts."""
    from epserve.presets import build_config

    return build_config("tiny", overrides=_overrides(layers, experts), dtype="bfloat16")


def _overrides(layers: int, experts: int) -> dict:
    wide = {**WIDE, "n_routed_experts": experts} if experts else {}
    return {**wide, "num_hidden_layers": layers}


def measure_engine(
    device: str, depths: Sequence[int], batches: Sequence[int], steps: int, prompt_len: int = 32, experts: int = 0
) -> list[MeasuredPoint]:
    """Median decode step of the engine on the ``tiny`` preset (``engine_step`` points) or, with
    ``experts``, on the wide streaming model (``engine_stream``) at each depth and batch."""
    from epserve import LLM, SamplingParams
    from epserve.presets import make_checkpoint

    kind, label = ("engine_stream", f"wide{experts}") if experts else ("engine_step", "tiny")
    pts = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in depths:
            cfg = engine_config(layers, experts)
            path = make_checkpoint(Path(tmp) / f"{label}-{layers}", preset="tiny", dtype="bfloat16",
                                   overrides=_overrides(layers, experts))
            engine = LLM(path, dtype="bfloat16", device=device, num_blocks=512, enable_prefix_caching=False).engine
            flush = device == "cpu" and not experts
            flushed = flush_before_blocks(engine.runner.model) if flush else [0.0]
            params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
            vocab = cfg["vocab_size"] - 10
            for batch in batches:
                for i in range(batch):  # the wide model's requests differ, so that they route as a batch does
                    prompt = [10 + (j + 97 * i * bool(experts)) * (1 + 2 * i * bool(experts)) % vocab
                              for j in range(prompt_len)]
                    engine.add_request(f"calibrate-{batch}-{i}", prompt, params)
                for _ in range(3):  # prefill and two warm decode steps
                    engine.step()
                times = []
                for _ in range(steps):
                    before, start = flushed[0], time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - start - (flushed[0] - before))
                while engine.has_unfinished_requests():
                    engine.step()
                times.sort()
                kv = prompt_len + 2 + steps // 2
                pts.append(MeasuredPoint(kind, f"{label} {layers} layers b{batch} kv{kv}", 0.0, 0.0,
                                         times[len(times) // 2] * 1e6))
            del engine
    return pts


def private_cache_bytes() -> int:
    """This CPU's per-core caches (the largest level not shared between cores, from sysfs) summed
    over the cores torch uses; 1 MiB per core if unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        if shared != "0":  # shared with other cores: the last level
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        best = max(best, int(size.rstrip("KM")) * scale)
    return (best or 1 << 20) * torch.get_num_threads()


def flush_before_blocks(model: torch.nn.Module) -> list[float]:
    """Before every attention and FFN block of ``model``, read twice the cores' private caches, as
    streaming a block's weights does to the runtime's state; returns a one-element list accumulating
    the seconds spent doing so."""
    buffer = torch.ones(2 * private_cache_bytes() // 4)
    spent = [0.0]

    def flush(*_: object) -> None:
        start = time.perf_counter()
        buffer.sum()
        spent[0] += time.perf_counter() - start

    for layer in model.layers:
        layer.self_attn.register_forward_pre_hook(flush)
        layer.mlp.register_forward_pre_hook(flush)
    return spent
