"""Expert placement: logical experts -> physical slots (with redundant replicas) -> ranks.

The gate emits logical expert ids; the placement turns each into one physical slot. A logical
expert with ``c`` replicas spreads its tokens over them (:func:`select_replicas`):

- ``position``: a token at row ``t`` of rank ``r``'s MoE input goes to replica ``(t + r) mod c``
  (every replica takes an equal share, whatever the senders);
- ``local``: the same rule over the replicas on the sender's own rank if it holds any, else over
  those on its node, else over all (fewer bytes cross ranks and nodes; the share of a replica then
  depends on where the tokens come from).

Every replica holds the same weights, so the choice never changes a token's result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.config import REPLICA_SELECTIONS, ReplicaSelection


@dataclass(frozen=True)
class ExpertPlacement:
    """``physical_to_logical[p]`` is the logical expert held by physical slot ``p``; slots are laid out
    contiguously per rank (``num_local_slots`` each). ``ranks_per_node``: ranks sharing a host (the
    ``local`` selection's second preference); ``selection``: how a token picks among replicas."""

    num_logical_experts: int
    ep_size: int
    physical_to_logical: tuple[int, ...]
    selection: ReplicaSelection = "position"
    ranks_per_node: int | None = None  # None: every rank on one node

    def __post_init__(self) -> None:
        n, p = self.num_logical_experts, len(self.physical_to_logical)
        if p % self.ep_size:
            raise ValueError(f"{n} experts + {p - n} redundant do not divide over EP={self.ep_size}")
        if sorted(set(self.physical_to_logical)) != list(range(n)):
            raise ValueError(f"a placement must hold each of the {n} logical experts at least once")
        if self.selection not in REPLICA_SELECTIONS:
            raise ValueError(f"unknown replica selection {self.selection!r}; choose from {REPLICA_SELECTIONS}")

    @classmethod
    def build(
        cls, num_logical_experts: int, ep_size: int = 1, num_redundant: int = 0,
        selection: ReplicaSelection = "position", ranks_per_node: int | None = None,
    ) -> ExpertPlacement:
        """The start-up placement: expert ``e`` in slot ``e``, the redundant slots holding copies of
        experts ``0..R-1`` (until a rebalance places them by load)."""
        extra = tuple(i % num_logical_experts for i in range(num_redundant))
        return cls(num_logical_experts, ep_size, tuple(range(num_logical_experts)) + extra, selection, ranks_per_node)

    def with_slots(self, physical_to_logical: tuple[int, ...]) -> ExpertPlacement:
        """The same layout and policy with other slot contents (a rebalance's result)."""
        return ExpertPlacement(self.num_logical_experts, self.ep_size, tuple(physical_to_logical), self.selection,
                               self.ranks_per_node)

    @property
    def num_physical_experts(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_local_slots(self) -> int:
        return self.num_physical_experts // self.ep_size

    @property
    def max_replicas(self) -> int:
        """The most replicas any placement of this size can give one expert (the table's width)."""
        return self.num_physical_experts - self.num_logical_experts + 1

    def rank_of(self, slot: int) -> int:
        return slot // self.num_local_slots

    def node_of(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def local_logical_experts(self, rank: int) -> tuple[int, ...]:
        """Logical expert held by each local slot of ``rank``, in slot order."""
        lo = rank * self.num_local_slots
        return self.physical_to_logical[lo : lo + self.num_local_slots]

    def replicas(self) -> list[list[int]]:
        """Physical slots of each logical expert, in slot order."""
        out: list[list[int]] = [[] for _ in range(self.num_logical_experts)]
        for slot, logical in enumerate(self.physical_to_logical):
            out[logical].append(slot)
        return out

    def replica_table(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What rank ``rank`` routes with: ``table [E, max_replicas]`` (each expert's candidate slots,
        padded by repeating the first) and ``count [E]`` (how many of them to spread over)."""
        table = torch.empty(self.num_logical_experts, self.max_replicas, dtype=torch.long)
        count = torch.empty(self.num_logical_experts, dtype=torch.long)
        for logical, slots in enumerate(self.replicas()):
            if self.selection == "local":
                same_rank = [s for s in slots if self.rank_of(s) == rank]
                same_node = [s for s in slots if self.node_of(self.rank_of(s)) == self.node_of(rank)]
                slots = same_rank or same_node or slots
            table[logical] = torch.tensor(slots + [slots[0]] * (self.max_replicas - len(slots)))
            count[logical] = len(slots)
        return table, count


def select_replicas(ids: torch.Tensor, table: torch.Tensor, count: torch.Tensor, offset: int) -> torch.Tensor:
    """Logical ids ``[T, K]`` -> physical slots: row ``t`` takes candidate ``(t + offset) mod count``.
    Shape-static device ops (no host sync; graph-capturable)."""
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + offset
    return table[ids, rows % count[ids]]
