"""``all_to_all`` dispatcher: exact-size ``all_to_all_single`` exchanges, no padding.

dispatch_send sorts the ``T*K`` token copies by physical slot (rank ``r`` owns slots
``[r*num_local_slots, (r+1)*num_local_slots)``), swaps the per-(rank, local slot) counts with a small
synchronous all-to-all, then starts the row exchange with exact split sizes. Rows arrive grouped by
source rank, then local slot; dispatch_recv regroups them slot-major (slot 0 from source 0, source 1, …).
combine reverses the regrouping and the exchange, then does the weighted scatter-add in token order.

The count exchange is this backend's one host sync per layer (the split sizes must be known on the host),
which is why a captured decode step (``engine/graphs.py``) wants the fixed-shape ``padded`` backend.
With ``fp8`` (``--dispatch-dtype fp8``) the rows travel as packed FP8 bytes with their scales
(``payload.py``) and reach the experts as ``ExpertInput.hidden_states`` fp8 plus ``scales``; with ``nvfp4``
as packed NVFP4 bytes, reaching them as e2m1 codes, block ``scales`` and ``global_scale``; the combine
returns expert outputs in their own dtype. ``comm_bytes`` counts the rows sent (not the small count
exchange).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.kernels.ops import group_by_expert, weighted_combine
from epserve.moe.dispatch.base import DispatchHandle, ExpertInput, GroupDispatcher


@dataclass(frozen=True)
class SenderRoute:
    """The sending side's record of where its token copies went."""

    num_tokens: int
    token_idx: torch.Tensor  # [T*K] source token of each sent row, in send order
    weights: torch.Tensor  # [T*K] routing weight of each sent row (fp32)
    send_splits: tuple[int, ...]  # rows sent to each rank
    recv_splits: tuple[int, ...]  # rows received from each rank


@dataclass(frozen=True)
class AllToAllInFlight(DispatchHandle):
    work: dist.Work
    send: torch.Tensor  # [T*K, W] sent rows (W: H, or the packed width), kept alive until the transfer completes
    recv: torch.Tensor  # [N, W], grouped by source rank, then local slot
    hidden: int  # H
    perm: torch.Tensor  # [N] row of ``recv`` for each ExpertInput row
    num_tokens_per_expert: torch.Tensor  # [num_local_slots] int64, CPU
    sender: SenderRoute


@dataclass(frozen=True)
class AllToAllRoute(DispatchHandle):
    perm: torch.Tensor  # [N] row of the received buffer for each ExpertInput row
    sender: SenderRoute


@dataclass(frozen=True)
class AllToAllCombineInFlight(DispatchHandle):
    work: dist.Work
    send: torch.Tensor  # [N, H] expert outputs in received order, kept alive until the transfer completes
    recv: torch.Tensor  # [T*K, H] expert outputs in send order
    sender: SenderRoute


class AllToAllDispatcher(GroupDispatcher):
    name = "all_to_all"

    def dispatch_send(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        real_rows: torch.Tensor | None = None,
    ) -> AllToAllInFlight:
        """x [T, H], topk_ids [T, K] physical slots, topk_weights [T, K]."""
        ep, slots = self.ep_size, self.num_local_slots
        order, send_counts = group_by_expert(topk_ids, ep * slots)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        counts = torch.stack([send_counts, recv_counts]).cpu().view(2, ep, slots)
        send_splits = tuple(counts[0].sum(1).tolist())
        recv_splits = tuple(counts[1].sum(1).tolist())

        token_idx = order // topk_ids.shape[1]
        send = self.payload.rows(x).index_select(0, token_idx)
        recv = send.new_empty(sum(recv_splits), send.shape[1])
        work = dist.all_to_all_single(
            recv, send, list(recv_splits), list(send_splits), group=self.group, async_op=True
        )
        row_bytes = send.shape[1] * send.element_size()
        self.comm_bytes["dispatch"] += (send.shape[0] - send_splits[self.ep_rank]) * row_bytes

        # Received rows are source-major; a stable sort by local slot makes them slot-major.
        recv_slots = torch.arange(slots, device=x.device).repeat(ep)
        recv_slots = torch.repeat_interleave(recv_slots, recv_counts, output_size=recv.shape[0])
        perm = torch.argsort(recv_slots, stable=True)
        sender = SenderRoute(x.shape[0], token_idx, topk_weights.reshape(-1).index_select(0, order),
                             send_splits, recv_splits)
        return AllToAllInFlight(work, send, recv, x.shape[1], perm, counts[1].sum(0), sender)

    def dispatch_recv(self, handle: AllToAllInFlight) -> tuple[ExpertInput, AllToAllRoute]:
        handle.work.wait()
        host = handle.num_tokens_per_expert  # from the count exchange: this backend's one host sync
        rows = self.payload.expert_rows(handle.recv.index_select(0, handle.perm), handle.hidden)
        x = rows.hidden_states
        expert_input = ExpertInput(x, host.to(x.device, non_blocking=True), tuple(host.tolist()), rows.scales,
                                   global_scale=rows.global_scale)
        return expert_input, AllToAllRoute(handle.perm, handle.sender)

    def combine_send(self, y: torch.Tensor, handle: AllToAllRoute) -> AllToAllCombineInFlight:
        """y [N, H] in ExpertInput order."""
        sender = handle.sender
        send = y.new_empty(y.shape).index_copy_(0, handle.perm, y)
        recv = y.new_empty(sum(sender.send_splits), y.shape[1])
        work = dist.all_to_all_single(
            recv, send, list(sender.send_splits), list(sender.recv_splits), group=self.group, async_op=True
        )
        self.comm_bytes["combine"] += (y.shape[0] - sender.recv_splits[self.ep_rank]) * y.shape[1] * y.element_size()
        return AllToAllCombineInFlight(work, send, recv, sender)

    def combine_recv(self, handle: AllToAllCombineInFlight) -> torch.Tensor:
        """-> [T, H] in the original token order."""
        handle.work.wait()
        sender = handle.sender
        return weighted_combine(handle.recv, sender.token_idx, sender.weights, sender.num_tokens)
