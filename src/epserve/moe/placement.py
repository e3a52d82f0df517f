"""Expert placement: logical experts -> physical slots (with optional redundant replicas) -> ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """``physical_to_logical[p]`` is the logical expert held by physical slot ``p``; slots are laid out
    contiguously per rank (``num_local_slots`` each). A logical expert with several replicas is sent
    to its first replica (the router emits logical ids; placement turns them into physical ones)."""

    num_logical_experts: int
    ep_size: int
    physical_to_logical: tuple[int, ...]

    @classmethod
    def build(cls, num_logical_experts: int, ep_size: int = 1, num_redundant: int = 0) -> ExpertPlacement:
        num_physical = num_logical_experts + num_redundant
        if num_physical % ep_size:
            raise ValueError(
                f"{num_logical_experts} experts + {num_redundant} redundant do not divide over EP={ep_size}"
            )
        extra = tuple(i % num_logical_experts for i in range(num_redundant))
        return cls(num_logical_experts, ep_size, tuple(range(num_logical_experts)) + extra)

    @property
    def num_physical_experts(self) -> int:
        return len(self.physical_to_logical)

    @property
    def num_local_slots(self) -> int:
        return self.num_physical_experts // self.ep_size

    def local_logical_experts(self, rank: int) -> tuple[int, ...]:
        """Logical expert held by each local slot of ``rank``, in slot order."""
        lo = rank * self.num_local_slots
        return self.physical_to_logical[lo : lo + self.num_local_slots]

    def logical_to_physical_table(self) -> torch.Tensor:
        """[num_logical] -> first physical slot of each logical expert."""
        table = [-1] * self.num_logical_experts
        for slot, logical in enumerate(self.physical_to_logical):
            if table[logical] < 0:
                table[logical] = slot
        return torch.tensor(table, dtype=torch.long)
