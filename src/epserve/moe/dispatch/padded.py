"""``padded`` dispatcher: fixed-shape equal-split ``all_to_all_single`` exchanges (CUDA-graph friendly).

Every (source, destination) pair gets ``capacity = max_tokens_per_rank * min(K, num_local_slots)`` rows,
so no counts are exchanged: each rank sends a zero-padded ``[ep_size, capacity, H]`` buffer plus an
int64 ``[ep_size, capacity]`` buffer holding each row's local slot at the destination (-1 = padding).
Precondition: a token's top-k slots are distinct (the router guarantees it), so no token sends more than
``min(K, num_local_slots)`` rows to one rank. Combine sends the same fixed shape back; each sender picks
its rows at the positions it used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput, weighted_combine
from epserve.moe.dispatch.local import group_by_expert


@dataclass(frozen=True)
class PaddedSenderRoute:
    """The sending side's record of where its token copies went."""

    num_tokens: int
    token_idx: torch.Tensor  # [T*K] source token of each sent row
    weights: torch.Tensor  # [T*K] routing weight of each sent row (fp32)
    send_pos: torch.Tensor  # [T*K] row of each sent copy in the flat [ep_size*capacity] buffer


@dataclass(frozen=True)
class PaddedInFlight(DispatchHandle):
    work: dist.Work
    send: torch.Tensor  # [ep_size*capacity, H], kept alive until the transfer completes
    recv: torch.Tensor  # [ep_size*capacity, H], block s from source rank s
    recv_slots: torch.Tensor  # [ep_size*capacity] int64 local slot of each received row, -1 = padding
    capacity: int
    sender: PaddedSenderRoute


@dataclass(frozen=True)
class PaddedRoute(DispatchHandle):
    perm: torch.Tensor  # [N] row of the received buffer for each ExpertInput row
    capacity: int
    sender: PaddedSenderRoute


@dataclass(frozen=True)
class PaddedCombineInFlight(DispatchHandle):
    work: dist.Work
    send: torch.Tensor  # [ep_size*capacity, H], kept alive until the transfer completes
    recv: torch.Tensor  # [ep_size*capacity, H] expert outputs at the positions this rank sent from
    sender: PaddedSenderRoute


class PaddedDispatcher(Dispatcher):
    name = "padded"

    def __init__(self, num_local_slots: int, group: dist.ProcessGroup) -> None:
        self.num_local_slots = num_local_slots
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.max_tokens_per_rank: int | None = None
        self.reset_stats()

    def begin_step(self, max_tokens_per_rank: int) -> None:
        self.max_tokens_per_rank = max_tokens_per_rank

    def _capacity(self, num_tokens: int, top_k: int) -> int:
        if self.max_tokens_per_rank is None:
            raise RuntimeError("PaddedDispatcher: begin_step(max_tokens_per_rank) was not called before dispatch")
        if num_tokens > self.max_tokens_per_rank:
            raise RuntimeError(
                f"PaddedDispatcher: {num_tokens} tokens exceed max_tokens_per_rank={self.max_tokens_per_rank} "
                "given to begin_step"
            )
        return self.max_tokens_per_rank * min(top_k, self.num_local_slots)

    def _count_bytes(self, phase: str, capacity: int, rows: torch.Tensor) -> None:
        self.comm_bytes[phase] += (self.ep_size - 1) * capacity * rows.shape[1] * rows.element_size()

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> PaddedInFlight:
        """x [T, H], topk_ids [T, K] physical slots, topk_weights [T, K]."""
        ep, slots = self.ep_size, self.num_local_slots
        capacity = self._capacity(x.shape[0], topk_ids.shape[1])
        order, slot_counts = group_by_expert(topk_ids, ep * slots)
        sorted_slots = topk_ids.reshape(-1).index_select(0, order)
        dest = sorted_slots // slots
        rank_counts = slot_counts.view(ep, slots).sum(1)
        rank_starts = torch.cumsum(rank_counts, 0) - rank_counts
        send_pos = dest * capacity + torch.arange(order.shape[0], device=order.device) - rank_starts[dest]

        token_idx = order // topk_ids.shape[1]
        send = x.new_zeros(ep * capacity, x.shape[1]).index_copy_(0, send_pos, x.index_select(0, token_idx))
        send_slots = torch.full((ep * capacity,), -1, dtype=torch.long, device=x.device)
        send_slots.index_copy_(0, send_pos, sorted_slots % slots)
        recv_slots = torch.empty_like(send_slots)
        dist.all_to_all_single(recv_slots, send_slots, group=self.group)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self._count_bytes("dispatch", capacity, send)
        sender = PaddedSenderRoute(x.shape[0], token_idx, topk_weights.reshape(-1).index_select(0, order), send_pos)
        return PaddedInFlight(work, send, recv, recv_slots, capacity, sender)

    def dispatch_recv(self, handle: PaddedInFlight) -> tuple[ExpertInput, PaddedRoute]:
        slots, recv_slots = self.num_local_slots, handle.recv_slots
        # The buffer is source-major; a stable sort by local slot (padding last) makes it slot-major.
        keys = torch.where(recv_slots >= 0, recv_slots, slots)
        counts = torch.bincount(recv_slots + 1, minlength=slots + 1)[1:].cpu()
        perm = torch.argsort(keys, stable=True)[: int(counts.sum())]
        handle.work.wait()
        expert_input = ExpertInput(
            hidden_states=handle.recv.index_select(0, perm),
            num_tokens_per_expert=counts,
            num_tokens_per_expert_list=tuple(counts.tolist()),
        )
        return expert_input, PaddedRoute(perm, handle.capacity, handle.sender)

    def combine_send(self, y: torch.Tensor, handle: PaddedRoute) -> PaddedCombineInFlight:
        """y [N, H] in ExpertInput order."""
        send = y.new_zeros(self.ep_size * handle.capacity, y.shape[1]).index_copy_(0, handle.perm, y)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self._count_bytes("combine", handle.capacity, send)
        return PaddedCombineInFlight(work, send, recv, handle.sender)

    def combine_recv(self, handle: PaddedCombineInFlight) -> torch.Tensor:
        """-> [T, H] in the original token order."""
        handle.work.wait()
        sender = handle.sender
        y = handle.recv.index_select(0, sender.send_pos)
        return weighted_combine(y, sender.token_idx, sender.weights, sender.num_tokens)
