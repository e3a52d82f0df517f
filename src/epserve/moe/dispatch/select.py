"""The dispatcher a rank runs, chosen once at start-up from the engine's configuration."""

from __future__ import annotations

import torch

from epserve.checkpoint.nvfp4 import is_excluded
from epserve.config import EngineConfig, ModelConfig
from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.dispatch.payload import payload_kind
from epserve.moe.dispatch.symm_mem import SymmMemDispatcher
from epserve.parallel.context import ParallelContext


def nvfp4_routed_experts(model: ModelConfig) -> bool:
    """Whether the routed experts of every MoE layer run as four-bit weights: an NVFP4 checkpoint whose
    ``exclude_modules`` name none of them (the MTP layer's, which ModelOpt excludes, aside)."""
    layers = model.moe_layer_ids
    return model.is_nvfp4 and bool(layers) and not any(
        is_excluded(f"model.layers.{i}.mlp.experts.0.gate_proj", model.nvfp4_exclude) for i in layers)


def build_dispatcher(config: EngineConfig, num_local_slots: int, ctx: ParallelContext, fp8_weights: bool,
                     dtype: torch.dtype) -> Dispatcher:
    """``local`` for EP = 1 (whatever was asked: there is nobody to send to); ``padded``, ``symm_mem``, or
    ``all_to_all`` (also for ``auto``), across ranks; FP8 rows with ``dispatch_dtype='fp8'``, NVFP4 rows with
    ``'nvfp4'`` (refused unless the routed experts are NVFP4: :func:`nvfp4_routed_experts`). ``symm_mem``'s
    NVSHMEM buffers hold the most tokens a rank feeds one MoE layer in a decode step (the captured ones:
    ``max_num_seqs`` sequences with their speculative tokens, or ``cuda_graph_max_bs``); a step with more
    goes through its exact ``all_to_all`` fallback."""
    pc = config.parallel
    kind = payload_kind(pc.dispatch_dtype, fp8_weights, nvfp4_routed_experts(config.model))
    fp8, nvfp4 = kind == "fp8", kind == "nvfp4"
    if ctx.ep_size == 1:
        return LocalDispatcher(num_local_slots, fp8, nvfp4=nvfp4)
    if pc.dispatch == "padded":
        return PaddedDispatcher(num_local_slots, ctx.ep_group, fp8, nvfp4=nvfp4)
    if pc.dispatch == "symm_mem":  # buffers for a decode step's tokens; larger (prefill) steps run all_to_all
        sched = config.scheduler
        rows = max(sched.max_num_seqs * (1 + config.num_spec_tokens), config.cuda_graph_max_bs or 0)
        return SymmMemDispatcher(num_local_slots, ctx.ep_group, config.model.num_experts_per_tok,
                                 -(-rows // ctx.tp), config.model.hidden_size, dtype, ctx.device, fp8, nvfp4=nvfp4)
    return AllToAllDispatcher(num_local_slots, ctx.ep_group, fp8, nvfp4=nvfp4)
