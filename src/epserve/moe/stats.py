"""Expert load statistics: tokens per (MoE layer, logical expert) and per rank, and the imbalance."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLoad:
    """Token copies each expert received since start-up (a token routed to k experts counts k times).

    - ``layers``: the MoE layer indices, one row each below;
    - ``per_expert``: ``[layers, n_logical]`` tokens per logical expert (replicas summed);
    - ``per_rank``: ``[layers, ep]`` tokens each rank's experts received.
    """

    layers: tuple[int, ...]
    per_expert: torch.Tensor
    per_rank: torch.Tensor

    @classmethod
    def from_ranks(cls, layers: tuple[int, ...], rank_loads: list[torch.Tensor]) -> ExpertLoad:
        """``rank_loads[r]``: ``[layers, n_logical]`` token copies rank r's slots received per logical
        expert (the experts' replicas on that rank summed)."""
        per_expert = torch.stack(rank_loads).sum(dim=0)
        per_rank = torch.stack([r.sum(dim=1) for r in rank_loads], dim=1)
        return cls(layers, per_expert, per_rank)

    @property
    def rank_totals(self) -> torch.Tensor:
        """[ep] tokens per rank over all layers."""
        return self.per_rank.sum(dim=0)

    @property
    def imbalance(self) -> float:
        """max / mean tokens per rank over all layers (1.0 = perfectly balanced; 1.0 when idle)."""
        return _max_over_mean(self.rank_totals.double())

    @property
    def layer_imbalance(self) -> list[float]:
        """The same per MoE layer: what a layer's slowest rank costs over a balanced one."""
        return [_max_over_mean(row.double()) for row in self.per_rank]

    def summary(self) -> dict[str, object]:
        return {
            "layers": list(self.layers),
            "tokens_per_rank": self.rank_totals.tolist(),
            "imbalance": round(self.imbalance, 4),
            "layer_imbalance": [round(v, 4) for v in self.layer_imbalance],
            "per_rank": self.per_rank.tolist(),
            "per_expert": self.per_expert.tolist(),
        }


def _max_over_mean(values: torch.Tensor) -> float:
    mean = float(values.mean()) if values.numel() else 0.0
    return float(values.max()) / mean if mean > 0 else 1.0
