"""``local`` dispatcher (EP = 1): every expert is on this rank, so dispatch is a permutation that
groups token copies by expert, and combine is the weighted scatter-add back. The reference the
multi-rank backends are tested against. With ``fp8`` (``--dispatch-dtype fp8``) the ``T`` tokens are
quantized once before the permutation (``payload.py``), not their ``T*K`` copies by the expert GEMM; with
``nvfp4`` (``--dispatch-dtype nvfp4``) likewise, so its experts see the values a multi-rank backend's do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.kernels.ops import group_by_expert, local_dispatch, weighted_combine
from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput
from epserve.moe.dispatch.payload import Payload


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


class LocalDispatcher(Dispatcher):
    name = "local"

    def __init__(self, num_local_experts: int, fp8: bool = False, *, nvfp4: bool = False) -> None:
        self.num_local_experts = num_local_experts
        self.payload = Payload(fp8, nvfp4)
        self.reset_stats()  # stays zero: nothing leaves this rank

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      real_rows: torch.Tensor | None = None) -> LocalInFlight:
        if not self.payload.quantized:  # one C call on the CPU: the grouping, the rows, their tokens and weights
            rows, counts, token_idx, weights = local_dispatch(x, topk_ids, topk_weights, self.num_local_experts)
            return LocalInFlight(ExpertInput(rows, counts), LocalRoute(x.shape[0], token_idx, weights))
        order, counts = group_by_expert(topk_ids, self.num_local_experts)
        token_idx = order // topk_ids.shape[1]
        rows = self.payload.expert_rows(self.payload.rows(x).index_select(0, token_idx), x.shape[1])
        expert_input = ExpertInput(rows.hidden_states, counts, scales=rows.scales,
                                   global_scale=rows.global_scale)  # no host sync
        route = LocalRoute(x.shape[0], token_idx, topk_weights.reshape(-1).index_select(0, order))
        return LocalInFlight(expert_input, route)

    def dispatch_recv(self, handle: LocalInFlight) -> tuple[ExpertInput, LocalRoute]:
        return handle.expert_input, handle.route

    def combine_send(self, y: torch.Tensor, handle: LocalRoute) -> LocalCombined:
        return LocalCombined(weighted_combine(y, handle.token_idx, handle.weights, handle.num_tokens))

    def combine_recv(self, handle: LocalCombined) -> torch.Tensor:
        return handle.output
