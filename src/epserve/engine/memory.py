"""Size the paged KV pool from a memory budget."""

from __future__ import annotations

import logging

import torch

from epserve.config import CacheConfig, ModelConfig

logger = logging.getLogger(__name__)

# Headroom for activations and temporaries, as a fraction of the budget after weights.
_ACTIVATION_RESERVE = 0.1


class OutOfMemoryError(RuntimeError):
    """The weights (or a single request) cannot fit in the memory budget."""


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Latent cache bytes of one block across all layers."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return model.num_hidden_layers * block_size * model.kv_cache_dim * itemsize


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OutOfMemoryError("cannot read available memory; pass num_blocks or a memory budget")


def determine_num_blocks(
    model: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_bytes: int,
    max_blocks_needed: int,
) -> int:
    """Blocks for the KV pool: explicit, or what the budget leaves after weights and headroom, never
    more than the scheduler could ever use (``max_blocks_needed``)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.memory_budget_bytes is not None:
        budget = cache.memory_budget_bytes
        source = "the memory budget"
    else:
        # Weights are already resident, so free memory excludes them.
        budget = int(available_memory(device) * cache.memory_utilization) + weight_bytes
        source = f"{cache.memory_utilization:.0%} of free memory"
    left = budget - weight_bytes
    if left <= 0:
        raise OutOfMemoryError(
            f"model weights need {weight_bytes / 2**20:.1f} MiB but {source} is {budget / 2**20:.1f} MiB"
        )
    per_block = kv_bytes_per_block(model, cache.block_size, dtype)
    num_blocks = int(left * (1 - _ACTIVATION_RESERVE)) // per_block
    if num_blocks < 1:
        raise OutOfMemoryError(
            f"after {weight_bytes / 2**20:.1f} MiB of weights, {source} leaves room for no KV block "
            f"({per_block} bytes each)"
        )
    num_blocks = min(num_blocks, max_blocks_needed)
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, cache.block_size,
                num_blocks * per_block / 2**20)
    return num_blocks
