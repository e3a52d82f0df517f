"""Expert selection: gate logits -> scores -> (grouped) top-k -> routing weights.

Pipeline of one MoE layer: gate -> dispatcher.dispatch -> experts -> dispatcher.combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from epserve.config import ModelConfig
from epserve.kernels import cast, linear
from epserve.kernels.ops import grouped_topk


@dataclass(frozen=True)
class RoutingResult:
    topk_ids: torch.Tensor  # [T, K] logical expert ids
    topk_weights: torch.Tensor  # [T, K] fp32


class ExpertGate(nn.Module):
    """DeepSeek gate. ``noaux_tc`` (V3): sigmoid scores, the correction bias added for selection only,
    best ``topk_group`` of ``n_group`` groups by the sum of each group's top-2 biased scores, top-k
    inside them; weights are the unbiased scores. ``group_limited_greedy`` (V2): groups ranked by
    their best score. ``greedy``: plain top-k (Mixtral-style when scores are softmax)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.topk_method = config.topk_method
        self.scoring_func = config.scoring_func
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        n = config.n_routed_experts
        # The gate stays fp32 whatever the model dtype (as the release keeps it).
        self.weight = nn.Parameter(torch.empty(n, config.hidden_size, dtype=torch.float32))
        if config.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(n, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor, logical_to_physical: torch.Tensor | None = None) -> RoutingResult:
        """x: [T, H] -> RoutingResult with [T, K] ids (physical slots through ``logical_to_physical`` if
        given) and weights. The selection runs as one fused kernel on CUDA (``kernels/gate.py``)."""
        ids, weights = grouped_topk(
            linear(cast(x, torch.float32), self.weight), top_k=self.top_k, n_group=self.n_group,
            topk_group=self.topk_group, method=self.topk_method, scoring=self.scoring_func,
            norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
            bias=self.e_score_correction_bias,
            logical_to_physical=logical_to_physical,
        )
        return RoutingResult(topk_ids=ids, topk_weights=weights)
