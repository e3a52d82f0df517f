"""Calibration of host overhead: decode steps of the engine itself on a model too small to do work.

On the CPU the cores' private caches are flushed before every attention and FFN block (and the
flush's time taken off), because in a real model the weights each block streams evict the runtime's
own state from the caches the host shares with the kernels.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from epserve.planner.hardware import MeasuredPoint


def engine_config(layers: int) -> dict:
    from epserve.presets import build_config

    return build_config("tiny", overrides={"num_hidden_layers": layers}, dtype="bfloat16")


def measure_engine(
    device: str, depths: Sequence[int], batches: Sequence[int], steps: int, prompt_len: int = 32
) -> list[MeasuredPoint]:
    """Median decode step of the engine on the ``tiny`` preset at each depth and batch."""
    from epserve import LLM, SamplingParams
    from epserve.presets import make_checkpoint

    pts = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in depths:
            cfg = engine_config(layers)
            path = make_checkpoint(Path(tmp) / f"tiny-{layers}", preset="tiny", dtype="bfloat16",
                                   overrides={"num_hidden_layers": layers})
            engine = LLM(path, dtype="bfloat16", device=device, num_blocks=512, enable_prefix_caching=False).engine
            flushed = flush_before_blocks(engine.runner.model) if device == "cpu" else [0.0]
            params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
            prompt = [10 + i % (cfg["vocab_size"] - 10) for i in range(prompt_len)]
            for batch in batches:
                for i in range(batch):
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
                pts.append(MeasuredPoint("engine_step", f"tiny {layers} layers b{batch} kv{kv}", 0.0, 0.0,
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
