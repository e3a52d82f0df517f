"""The dispatcher a rank runs, chosen once at start-up from the engine's configuration."""

from __future__ import annotations

import torch

from epserve.config import EngineConfig
from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.dispatch.payload import use_fp8_payload
from epserve.moe.dispatch.symm_mem import SymmMemDispatcher
from epserve.parallel.context import ParallelContext


def build_dispatcher(config: EngineConfig, num_local_slots: int, ctx: ParallelContext, fp8_weights: bool,
                     dtype: torch.dtype) -> Dispatcher:
    """``local`` for EP = 1 (whatever was asked: there is nobody to send to); ``padded``, ``symm_mem``, or
    ``all_to_all`` (also for ``auto``), across ranks; FP8 rows with ``dispatch_dtype='fp8'``. ``symm_mem``'s
    NVSHMEM buffers hold the most tokens a rank feeds one MoE layer in a decode step (the captured ones:
    ``max_num_seqs`` sequences with their speculative tokens, or ``cuda_graph_max_bs``); a step with more
    goes through its exact ``all_to_all`` fallback."""
    pc = config.parallel
    fp8 = use_fp8_payload(pc.dispatch_dtype, fp8_weights)
    if ctx.ep_size == 1:
        return LocalDispatcher(num_local_slots, fp8)
    if pc.dispatch == "padded":
        return PaddedDispatcher(num_local_slots, ctx.ep_group, fp8)
    if pc.dispatch == "symm_mem":  # buffers for a decode step's tokens; larger (prefill) steps run all_to_all
        sched = config.scheduler
        rows = max(sched.max_num_seqs * (1 + config.num_spec_tokens), config.cuda_graph_max_bs or 0)
        return SymmMemDispatcher(num_local_slots, ctx.ep_group, config.model.num_experts_per_tok,
                                 -(-rows // ctx.tp), config.model.hidden_size, dtype, ctx.device, fp8)
    return AllToAllDispatcher(num_local_slots, ctx.ep_group, fp8)
