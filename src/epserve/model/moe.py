"""DeepSeek MoE layer parts: router -> dispatcher -> grouped experts -> combine, plus the shared expert.

The layer calls them op by op (``parallel/stages.py``) so that the shared expert, or the other
micro-batch, runs while a dispatch or combine is in flight.
"""

from __future__ import annotations

import torch
from torch import nn

from epserve.config import ModelConfig
from epserve.model.layers import GatedMLP
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.experts import GroupedExperts
from epserve.moe.placement import ExpertPlacement
from epserve.moe.router import Router


class MoE(nn.Module):
    def __init__(
        self, config: ModelConfig, dispatcher: Dispatcher, placement: ExpertPlacement, ep_rank: int = 0
    ) -> None:
        super().__init__()
        self.router = Router(config)
        self.dispatcher = dispatcher
        self.local_logical_experts = placement.local_logical_experts(ep_rank)
        self.experts = GroupedExperts(placement.num_local_slots, config.hidden_size, config.moe_intermediate_size)
        self.register_buffer("logical_to_physical", placement.logical_to_physical_table(), persistent=False)
        # Tokens received by each local slot since start-up (CPU, cheap to read for statistics).
        self.expert_load = torch.zeros(placement.num_local_slots, dtype=torch.long, device="cpu")
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
            if config.n_shared_experts
            else None
        )

    def gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (physical expert slots [T, K], routing weights [T, K])."""
        routing = self.router(x)
        return self.logical_to_physical[routing.topk_ids], routing.topk_weights

    def shared_expert(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(x) if self.shared_experts is not None else None
