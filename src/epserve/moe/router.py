"""Expert selection: gate logits -> scores -> (grouped) top-k -> routing weights.

Pipeline of one MoE layer: router -> dispatcher.dispatch -> experts -> dispatcher.combine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig


@dataclass(frozen=True)
class RoutingResult:
    topk_ids: torch.Tensor  # [T, K] logical expert ids
    topk_weights: torch.Tensor  # [T, K] fp32


class ExpertRouter(nn.Module):
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

    def forward(self, x: torch.Tensor) -> RoutingResult:
        """x: [T, H] -> RoutingResult with [T, K] ids and weights."""
        logits = F.linear(x.float(), self.weight)  # [T, E]
        scores = logits.sigmoid() if self.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.topk_method != "greedy" and self.n_group > 1:
            grouped = choice.view(x.shape[0], self.n_group, choice.shape[1] // self.n_group)  # [T, G, E/G]
            if self.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(choice.shape)
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return RoutingResult(topk_ids=topk_ids, topk_weights=weights * self.routed_scaling_factor)
