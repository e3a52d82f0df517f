"""``local`` dispatcher (EP = 1): every expert is on this rank, so dispatch is a permutation that
groups token copies by expert, and combine is the weighted scatter-add back. The reference the
multi-rank backends are tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput, weighted_combine


@dataclass(frozen=True)
class LocalRoute(DispatchHandle):
    """Where each grouped row came from: the handle combine needs."""

    num_tokens: int
    token_idx: torch.Tensor  # [N] source token of each grouped row
    weights: torch.Tensor  # [N] routing weight of each grouped row (fp32)


@dataclass(frozen=True)
class LocalInFlight(DispatchHandle):
    """Dispatch 'in flight' (already complete locally)."""

    expert_input: ExpertInput
    route: LocalRoute


@dataclass(frozen=True)
class LocalCombined(DispatchHandle):
    output: torch.Tensor  # [T, H]


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (order [T*K]: flat (token, k) indices sorted by expert, counts [num_experts])."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, counts


class LocalDispatcher(Dispatcher):
    name = "local"

    def __init__(self, num_local_experts: int) -> None:
        self.num_local_experts = num_local_experts
        self.reset_stats()  # stays zero: nothing leaves this rank

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> LocalInFlight:
        order, counts = group_by_expert(topk_ids, self.num_local_experts)
        token_idx = order // topk_ids.shape[1]
        counts_cpu = counts.cpu()
        expert_input = ExpertInput(
            hidden_states=x.index_select(0, token_idx),
            num_tokens_per_expert=counts_cpu,
            num_tokens_per_expert_list=tuple(counts_cpu.tolist()),
        )
        route = LocalRoute(x.shape[0], token_idx, topk_weights.reshape(-1).index_select(0, order))
        return LocalInFlight(expert_input, route)

    def dispatch_recv(self, handle: LocalInFlight) -> tuple[ExpertInput, LocalRoute]:
        return handle.expert_input, handle.route

    def combine_send(self, y: torch.Tensor, handle: LocalRoute) -> LocalCombined:
        return LocalCombined(weighted_combine(y, handle.token_idx, handle.weights, handle.num_tokens))

    def combine_recv(self, handle: LocalCombined) -> torch.Tensor:
        return handle.output
