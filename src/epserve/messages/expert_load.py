"""Expert load statistics as they cross processes: token copies per (MoE layer, logical expert) and
per rank, and the imbalance they imply. Plain Python (nested tuples of ints), no tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Rows = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ExpertLoad:
    """Token copies each expert received since start-up (a token routed to k experts counts k times).

    - ``layers``: the MoE layer indices, one row each below;
    - ``per_expert``: ``[layers][n_logical]`` tokens per logical expert (replicas summed);
    - ``per_rank``: ``[layers][ep]`` tokens each rank's experts received.
    """

    layers: tuple[int, ...]
    per_expert: Rows
    per_rank: Rows

    @classmethod
    def from_ranks(cls, layers: tuple[int, ...], rank_loads: Sequence[Sequence[Sequence[int]]]) -> ExpertLoad:
        """``rank_loads[r]``: ``[layers][n_logical]`` token copies rank r's slots received per logical
        expert (the experts' replicas on that rank summed)."""
        per_expert = tuple(tuple(sum(col) for col in zip(*(rank[i] for rank in rank_loads)))
                           for i in range(len(layers)))
        per_rank = tuple(tuple(sum(rank[i]) for rank in rank_loads) for i in range(len(layers)))
        return cls(tuple(layers), per_expert, per_rank)

    @property
    def rank_totals(self) -> tuple[int, ...]:
        """[ep] tokens per rank over all layers."""
        return tuple(sum(col) for col in zip(*self.per_rank))

    @property
    def imbalance(self) -> float:
        """max / mean tokens per rank over all layers (1.0 = perfectly balanced; 1.0 when idle)."""
        return _max_over_mean(self.rank_totals)

    @property
    def layer_imbalance(self) -> list[float]:
        """The same per MoE layer: what a layer's slowest rank costs over a balanced one."""
        return [_max_over_mean(row) for row in self.per_rank]

    def summary(self) -> dict[str, object]:
        return {
            "layers": list(self.layers),
            "tokens_per_rank": list(self.rank_totals),
            "imbalance": round(self.imbalance, 4),
            "layer_imbalance": [round(v, 4) for v in self.layer_imbalance],
            "per_rank": [list(row) for row in self.per_rank],
            "per_expert": [list(row) for row in self.per_expert],
        }


def _max_over_mean(values: Sequence[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0
