"""``padded`` dispatcher: fixed-shape equal-split ``all_to_all_single`` exchanges (CUDA-graph friendly).

Every (source, destination) pair gets ``capacity = max_tokens_per_rank * min(K, num_local_slots)`` rows,
so no counts are exchanged: each rank sends a zero-padded ``[ep_size, capacity, H]`` buffer plus an
int64 ``[ep_size, capacity]`` buffer holding each row's local slot at the destination (-1 = padding).
Precondition: a token's top-k slots are distinct (the gate guarantees it), so no token sends more than
``min(K, num_local_slots)`` rows to one rank. Combine sends the same fixed shape back; each sender picks
its rows at the positions it used. ``comm_bytes`` counts every row of both buffers sent to other ranks,
padding included. With ``fp8`` or ``nvfp4`` (``--dispatch-dtype``) the real rows are quantized before they
are placed (the ``T`` tokens once, ``payload.py``) and travel as packed bytes; padding rows are zero bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from epserve.kernels.moe_ops import count_per_expert
from epserve.kernels.ops import group_by_expert, weighted_combine
from epserve.moe.dispatch.base import DispatchHandle, ExpertInput, GroupDispatcher


@dataclass(frozen=True)
class PaddedSenderRoute:
    """The sending side's record of where its token copies went."""

    num_tokens: int
    token_idx: torch.Tensor  # [T*K] source token of each sent row
    weights: torch.Tensor  # [T*K] routing weight of each sent row (fp32)
    send_pos: torch.Tensor  # [T*K] row of each sent copy in the flat [ep_size*capacity] buffer


@dataclass(frozen=True)
class PaddedInFlight(DispatchHandle):
    recv: torch.Tensor  # [ep_size*capacity, W] rows (W: H or the packed width), block s from rank s (in flight)
    recv_slots: torch.Tensor  # [ep_size*capacity] int64 local slot of each received row, -1 = padding
    hidden: int  # H
    capacity: int
    sender: PaddedSenderRoute


@dataclass(frozen=True)
class PaddedRoute(DispatchHandle):
    perm: torch.Tensor  # [ep_size*capacity] row of the received buffer for each ExpertInput row
    capacity: int
    sender: PaddedSenderRoute


@dataclass(frozen=True)
class PaddedCombineInFlight(DispatchHandle):
    recv: torch.Tensor  # [ep_size*capacity, H] expert outputs at the positions this rank sent from (in flight)
    sender: PaddedSenderRoute


class PaddedDispatcher(GroupDispatcher):
    name = "padded"

    def __init__(self, num_local_slots: int, group: dist.ProcessGroup, fp8: bool = False, *,
                 nvfp4: bool = False) -> None:
        super().__init__(num_local_slots, group, fp8, nvfp4=nvfp4)
        self.max_tokens_per_rank: int | None = None

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

    def _count_bytes(self, phase: str, *buffers: torch.Tensor) -> None:
        """Every block of ``buffers`` ([ep_size*capacity, ...]) but this rank's own goes to another rank."""
        sent = sum(b.numel() * b.element_size() for b in buffers)
        self.comm_bytes[phase] += sent // self.ep_size * (self.ep_size - 1)

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      real_rows: torch.Tensor | None = None) -> PaddedInFlight:
        """x [T, H], topk_ids [T, K] physical slots, topk_weights [T, K]; the copies of rows ``real_rows`` marks
        False (a captured bucket's padding) go as padding: zero rows at slot -1, neither computed nor counted."""
        ep, slots = self.ep_size, self.num_local_slots
        capacity = self._capacity(x.shape[0], topk_ids.shape[1])
        order, slot_counts = group_by_expert(topk_ids, ep * slots)
        sorted_slots = topk_ids.reshape(-1).index_select(0, order)
        dest = sorted_slots // slots
        rank_counts = slot_counts.view(ep, slots).sum(1)
        rank_starts = torch.cumsum(rank_counts, 0) - rank_counts
        send_pos = dest * capacity + torch.arange(order.shape[0], device=order.device) - rank_starts[dest]

        token_idx = order // topk_ids.shape[1]
        rows = self.payload.rows(x).index_select(0, token_idx)
        local = sorted_slots % slots
        if real_rows is not None:
            real = real_rows.index_select(0, token_idx)
            rows, local = rows.masked_fill(~real[:, None], 0), torch.where(real, local, -1)  # (uint8 payloads too)
        send = rows.new_zeros(ep * capacity, rows.shape[1]).index_copy_(0, send_pos, rows)
        send_slots = torch.full((ep * capacity,), -1, dtype=torch.long, device=x.device)
        send_slots.index_copy_(0, send_pos, local)
        # Functional collectives: asynchronous until waited on, and traceable by torch.compile.
        recv_slots = funcol.all_to_all_single(send_slots, None, None, self.group)
        recv = funcol.all_to_all_single(send, None, None, self.group)
        self._count_bytes("dispatch", send, send_slots)
        sender = PaddedSenderRoute(x.shape[0], token_idx, topk_weights.reshape(-1).index_select(0, order), send_pos)
        return PaddedInFlight(recv, funcol.wait_tensor(recv_slots), x.shape[1], capacity, sender)

    def dispatch_recv(self, handle: PaddedInFlight) -> tuple[ExpertInput, PaddedRoute]:
        slots, recv_slots = self.num_local_slots, handle.recv_slots
        # The buffer is source-major; a stable sort by local slot (padding last) makes it slot-major. Every
        # row stays (fixed shape, no host sync): the padding rows trail the real ones.
        keys = torch.where(recv_slots >= 0, recv_slots, slots)
        counts = count_per_expert(keys, slots + 1)[:slots]
        perm = torch.argsort(keys, stable=True)
        recv = funcol.wait_tensor(handle.recv)
        rows = self.payload.expert_rows(recv.index_select(0, perm), handle.hidden)
        expert_input = ExpertInput(rows.hidden_states, counts, scales=rows.scales, global_scale=rows.global_scale)
        return expert_input, PaddedRoute(perm, handle.capacity, handle.sender)

    def combine_send(self, y: torch.Tensor, handle: PaddedRoute) -> PaddedCombineInFlight:
        """y [N, H] in ExpertInput order."""
        send = y.new_zeros(self.ep_size * handle.capacity, y.shape[1]).index_copy_(0, handle.perm, y)
        recv = funcol.all_to_all_single(send, None, None, self.group)
        self._count_bytes("combine", send)
        return PaddedCombineInFlight(recv, handle.sender)

    def combine_recv(self, handle: PaddedCombineInFlight) -> torch.Tensor:
        """-> [T, H] in the original token order."""
        sender = handle.sender
        y = funcol.wait_tensor(handle.recv).index_select(0, sender.send_pos)
        return weighted_combine(y, sender.token_idx, sender.weights, sender.num_tokens)
