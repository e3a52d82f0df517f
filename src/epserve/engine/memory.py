"""Size the paged KV pool from a memory budget; keep the host memory a CPU step frees for the next."""

from __future__ import annotations

import ctypes
import logging

import torch

from epserve.config import CacheConfig, ModelConfig, OutOfMemoryError

logger = logging.getLogger(__name__)

# Headroom for activations and temporaries, as a fraction of the budget after weights.
_ACTIVATION_RESERVE = 0.1


def kv_cache_dtype(cache: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The latent cache's element type: the model dtype, or float8 e4m3 for ``kv_cache_dtype="fp8"``."""
    return torch.float8_e4m3fn if cache.kv_cache_dtype == "fp8" else model_dtype


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Latent cache bytes of one token across all ``num_layers`` cached layers (default: the main
    model's; one more with an MTP draft layer), what the engine allocates. The planner prices the same
    figure by KV dtype name, torch-free: ``planner.memory.planned_kv_bytes_per_token``."""
    layers = model.num_hidden_layers if num_layers is None else num_layers
    return layers * model.kv_cache_dim * dtype.itemsize


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Latent cache bytes of one block across all cached layers."""
    return block_size * kv_bytes_per_token(model, dtype, num_layers)


def available_memory(device: torch.device) -> int:
    """Free device memory now (CPU: the host's available memory)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return _meminfo("MemAvailable")


def total_memory(device: torch.device) -> int:
    """All of the device's memory (CPU: the host's)."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return int(total)
    return _meminfo("MemTotal")


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise OutOfMemoryError(f"cannot read {field} from /proc/meminfo; pass num_blocks or a memory budget")


def determine_num_blocks(
    model: ModelConfig,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    weight_bytes: int,
    max_blocks_needed: int,
    num_layers: int | None = None,
    reserved_bytes: int = 0,
) -> int:
    """Blocks for the KV pool: explicit, or what the budget leaves after weights and headroom, never
    more than the scheduler could ever use (``max_blocks_needed``). The budget: ``memory_budget_bytes``;
    else ``memory_fraction`` of the device's total memory (vLLM's ``--gpu-memory-utilization``: the
    weights, the KV cache and the activation headroom all within it; OutOfMemoryError when what it leaves
    for the cache is not free now, other processes holding it); else the weights plus
    ``memory_utilization`` of the memory free once they are loaded. ``reserved_bytes``: what else the
    rank keeps beside weights and cache and is not allocated yet (the captured decode graphs, measured by
    a probe capture), taken off what is left for the cache."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if cache.memory_budget_bytes is not None:
        budget = cache.memory_budget_bytes
        source = "the memory budget"
    elif cache.memory_fraction is not None:
        total = total_memory(device)
        budget = int(total * cache.memory_fraction)
        source = f"{cache.memory_fraction:g} of the device's {total / 2**30:.1f} GiB"
        free = available_memory(device)
        if budget - weight_bytes - reserved_bytes > free:
            raise OutOfMemoryError(
                f"{source} leaves {(budget - weight_bytes) / 2**20:.1f} MiB for the KV cache after "
                f"{weight_bytes / 2**20:.1f} MiB of weights, but only {free / 2**20:.1f} MiB is free (other "
                "processes use the device): lower --gpu-memory-utilization")
    else:
        # Weights are already resident, so free memory excludes them.
        budget = int(available_memory(device) * cache.memory_utilization) + weight_bytes
        source = f"{cache.memory_utilization:.0%} of free memory"
    left = budget - weight_bytes - reserved_bytes
    if left <= 0:
        graphs = f" and the decode graphs {reserved_bytes / 2**20:.1f} MiB" if reserved_bytes else ""
        raise OutOfMemoryError(
            f"model weights need {weight_bytes / 2**20:.1f} MiB{graphs} but {source} is {budget / 2**20:.1f} MiB"
        )
    per_block = kv_bytes_per_block(model, cache.block_size, dtype, num_layers)
    num_blocks = int(left * (1 - _ACTIVATION_RESERVE)) // per_block
    if num_blocks < 1:
        raise OutOfMemoryError(
            f"after {weight_bytes / 2**20:.1f} MiB of weights, {source} leaves room for no KV block "
            f"({per_block} bytes each)"
        )
    return min(num_blocks, max_blocks_needed)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HOST_MMAP_THRESHOLD = 32 << 20  # glibc's largest; blocks at least this big still come from mmap
HOST_TRIM_THRESHOLD = 1 << 30


def keep_freed_host_memory() -> bool:
    """Let glibc's malloc keep the memory a CPU step frees for the next step, as a caching allocator does:
    blocks under 32 MB from the heap instead of fresh ``mmap`` pages, and freed heap memory not returned
    to the kernel below 1 GiB. Without it a step's activations (a prefill's MB-sized blocks) come from
    pages the kernel maps and zeroes again every step (docs/benchmarks.md, issue 30: batch-16 prefill
    1.4x faster). Whether it applied: False off glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, HOST_TRIM_THRESHOLD) == 1
