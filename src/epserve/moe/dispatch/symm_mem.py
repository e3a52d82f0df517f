"""``symm_mem`` dispatcher (CUDA with NVSHMEM): exact, sync-free and capturable, for any number of experts
per rank (DeepSeek-V3's 256 experts at EP8, EP16 and EP32).

The exchange is a 1-D variable all-to-all by rank whose split sizes stay on the device (``exchange.py``:
torch's NVSHMEM ``all_to_all_vdev``): only real rows move, the host never waits, and the layer can be
captured in a CUDA graph. Its regroup by local slot is computed on the device (``symm_layout.py``).

Dispatch: the ``T*K`` token copies are sorted by physical slot (rank ``r`` owns slots ``[r*S, (r+1)*S)``),
i.e. destination rank, then local slot. Two exchanges: the counts per (destination, slot) (``S`` int64 to
each rank), then the rows, ``in_splits[r]`` of them to rank ``r``. The receiver gets each source's rows back
to back, sorted by slot; ``dispatch_recv`` gathers them slot-major into the experts' input (slot 0's rows
from source 0, source 1, …, as ``local`` and ``all_to_all`` order them). The input is **masked**: it has a
fixed ``N`` rows (``ep * tokens * min(K, S)``, the most a rank can receive this step), of which only the
real ones are written (``kernels.moe_ops.gather_real_rows`` reads their number on the device); the expert
GEMMs skip the rows past the counts' sum (``ExpertInput.masked``), and nothing reads them.

Combine: the expert outputs' real rows are gathered back into the received order and returned to their
senders by the same exchange with the received splits; each sender gets its rows in the order it sent them,
and the weighted sum follows as in every backend. Padding rows are never quantized (the ``T`` tokens are,
``payload.py``), written or sent.

Buffers: allocated once at start-up for ``max_tokens_per_rank`` tokens (the captured decode steps' most),
every rank the same shapes (a collective), in two sets so that two micro-batches can be in flight; a
dispatch takes the next free set and its combine frees it. Each set's payload and expert-output rows share
memory (``symm_layout.BufferSet``); ``workspace_bytes`` reports the total. A step with more tokens (a large
prefill, never captured) runs through the exact ``all_to_all`` backend instead, chosen in ``begin_step``
from the step's global token count, the same on every rank. ``comm_bytes`` counts the real rows that leave
the rank (not the count exchange), accumulated on the device and read on the host when asked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.config import ConfigError
from epserve.kernels.moe_ops import gather_real_rows, group_by_expert, weighted_combine
from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput
from epserve.moe.dispatch.exchange import Exchange, NvshmemExchange
from epserve.moe.dispatch.payload import Payload
from epserve.moe.dispatch.symm_layout import BufferSet, BufferShape, regroup_indices

logger = logging.getLogger(__name__)

NUM_BUFFER_SETS = 2  # micro-batches in flight at once (parallel/overlap.py runs at most two)


def symm_mem_problem(device: torch.device) -> str | None:
    """Why this process cannot run the ``symm_mem`` dispatcher on ``device``; None if it can."""
    if device.type != "cuda":
        return f"it runs on CUDA devices only, this rank's device is {device}"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    from torch.distributed import _symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        return "this torch build or machine has no NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available())"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return "this torch build lacks torch.ops.symm_mem.all_to_all_vdev"
    return None


def check_symm_mem(device: torch.device, num_local_slots: int, ep_size: int) -> None:
    """ConfigError naming the option when ``--dispatch symm_mem`` cannot run here. Any number of expert slots
    per rank and of ranks is served; ``num_local_slots`` and ``ep_size`` are kept for the message's sake."""
    problem = symm_mem_problem(device)
    if problem is not None:
        raise ConfigError(f"dispatch 'symm_mem' (--dispatch symm_mem) cannot run with {num_local_slots} expert "
                          f"slots per rank on {ep_size} ranks: {problem}; use --dispatch padded or all_to_all")


def nvshmem_exchange(group: dist.ProcessGroup) -> NvshmemExchange:
    """The NVSHMEM exchange over ``group``, selecting torch's NVSHMEM symmetric-memory backend."""
    from torch.distributed import _symmetric_memory as symm_mem

    backend = symm_mem.get_backend(torch.device("cuda"))
    if backend is None:
        symm_mem.set_backend("NVSHMEM")
    elif backend != "NVSHMEM":
        raise ConfigError(f"dispatch 'symm_mem' needs the NVSHMEM symmetric-memory backend; this process already "
                          f"allocated symmetric memory with {backend}")
    return NvshmemExchange(group)


@dataclass(frozen=True)
class SymmMemSender:
    """The sending side's record of where its token copies went."""

    num_tokens: int
    token_idx: torch.Tensor  # [T*K] source token of each sent row, in send order
    weights: torch.Tensor  # [T*K] routing weight of each sent row (fp32)
    real: torch.Tensor | None = None  # [T*K] bool, False: a padding row's copy, left unsent (None: all sent)


@dataclass(frozen=True)
class SymmMemInFlight(DispatchHandle):
    buffers: BufferSet
    hidden: int
    num_rows: int  # N: the ExpertInput's fixed row count this step
    rows_per_expert: float  # the expected real rows per local slot (host arithmetic, for the GEMM's tile)
    sender: SymmMemSender


@dataclass(frozen=True)
class SymmMemRoute(DispatchHandle):
    buffers: BufferSet
    position: torch.Tensor  # [recv_rows] slot-major row of each received row (0 past the real ones)
    total: torch.Tensor  # [1] real rows received
    sender: SymmMemSender


@dataclass(frozen=True)
class SymmMemCombineInFlight(DispatchHandle):
    buffers: BufferSet
    sender: SymmMemSender


class SymmMemDispatcher(Dispatcher):
    name = "symm_mem"

    def __init__(self, num_local_slots: int, group: dist.ProcessGroup, top_k: int, max_tokens_per_rank: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, fp8: bool = False,
                 exchange: Exchange | None = None, *, nvfp4: bool = False) -> None:
        """Allocates the buffers: a collective, every EP rank at once. ``exchange``: the NVSHMEM one unless
        given (the CPU tests give its gloo twin)."""
        device = torch.device(device)
        ep = dist.get_world_size(group)
        if exchange is None:
            check_symm_mem(device, num_local_slots, ep)
            exchange = nvshmem_exchange(group)
        self.exchange = exchange
        self.num_local_slots = num_local_slots
        self.group = group
        self.ep_size = ep
        self.ep_rank = dist.get_rank(group)
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.payload = Payload(fp8, nvfp4)
        self.shape = BufferShape(
            send_rows=max_tokens_per_rank * top_k, recv_rows=ep * max_tokens_per_rank * min(top_k, num_local_slots),
            width=self.payload.width(hidden_size), payload_dtype=self.payload.dtype(dtype), hidden=hidden_size,
            dtype=dtype, slots=num_local_slots, ep=ep)
        self.buffers = [BufferSet(self.shape, exchange, device) for _ in range(NUM_BUFFER_SETS)]
        self.larger_steps = AllToAllDispatcher(num_local_slots, group, fp8, nvfp4=nvfp4)  # steps past the buffers
        self._next = 0
        self.step_tokens: int | None = None
        self._sent = torch.zeros(2, dtype=torch.int64, device=device)  # dispatch, combine bytes (on the device)
        logger.info("symm_mem dispatcher (%s exchange): %d buffer sets for %d tokens per rank, %d slots per rank "
                    "on %d ranks: %d rows sent, %d received per set, %.1f MiB in all", exchange.name,
                    NUM_BUFFER_SETS, max_tokens_per_rank, num_local_slots, ep, self.shape.send_rows,
                    self.shape.recv_rows, self.workspace_bytes() / 2**20)

    def workspace_bytes(self) -> int:
        """The buffers of every buffer set, allocated once at start-up."""
        return NUM_BUFFER_SETS * self.shape.bytes()

    # ---- statistics: accumulated on the device, read (a sync) only when asked ---------------------------------
    def reset_stats(self) -> None:
        self._sent.zero_()
        self.larger_steps.reset_stats()

    @property
    def comm_bytes(self) -> dict[str, int]:  # type: ignore[override]
        dispatch, combine = self._sent.tolist()
        eager = self.larger_steps.comm_bytes
        return {"dispatch": dispatch + eager["dispatch"], "combine": combine + eager["combine"]}

    # ---- the step ----------------------------------------------------------------------------------------------
    def begin_step(self, max_tokens_per_rank: int) -> None:
        """Sizes the step (``N``); a step past the buffers' tokens goes through ``all_to_all`` on every rank."""
        self.step_tokens = max_tokens_per_rank
        for b in self.buffers:  # a step starts with nothing in flight
            b.busy = False

    def _larger(self) -> bool:
        if self.step_tokens is None:
            raise RuntimeError("SymmMemDispatcher: begin_step(max_tokens_per_rank) was not called before dispatch")
        return self.step_tokens > self.max_tokens_per_rank

    def _acquire(self, num_tokens: int) -> BufferSet:
        if num_tokens > self.step_tokens:  # type: ignore[operator]
            raise RuntimeError(f"SymmMemDispatcher: {num_tokens} tokens exceed max_tokens_per_rank="
                               f"{self.step_tokens} given to begin_step")
        buffers = self.buffers[self._next]
        if buffers.busy:
            raise RuntimeError(f"SymmMemDispatcher: more than {NUM_BUFFER_SETS} dispatches in flight")
        self._next = (self._next + 1) % NUM_BUFFER_SETS
        buffers.busy = True
        return buffers

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      real_rows: torch.Tensor | None = None) -> DispatchHandle:
        """x [T, H], topk_ids [T, K] physical slots, topk_weights [T, K]. The copies of rows ``real_rows`` marks
        False (a captured bucket's padding) sort past every slot and are not sent: no rank computes or counts
        them, and their outputs come back as zeros."""
        if self._larger():
            return self.larger_steps.dispatch_send(x, topk_ids, topk_weights)
        ep, slots = self.ep_size, self.num_local_slots
        num_tokens, top_k = topk_ids.shape
        if top_k != self.top_k or x.shape[1] != self.shape.hidden:
            raise ValueError(f"SymmMemDispatcher was built for top-k {self.top_k} and hidden size {self.shape.hidden}, "
                             f"got topk_ids {tuple(topk_ids.shape)} and x {tuple(x.shape)}")
        b = self._acquire(num_tokens)
        ids, real = topk_ids, None
        if real_rows is not None:  # padding rows' copies to a slot past the last: sorted last, never sent
            ids = torch.where(real_rows[:, None], topk_ids, ep * slots)
        order, counts = group_by_expert(ids, ep * slots + (real_rows is not None))  # rank-major, then local slot
        counts = counts[: ep * slots]
        token_idx = order // top_k
        if real_rows is not None:
            real = real_rows.index_select(0, token_idx)
        rows = self.payload.rows(x)  # the T tokens, quantized once with an FP8 or NVFP4 payload
        n = num_tokens * top_k
        b.send[:n, : rows.shape[1]] = rows.index_select(0, token_idx)
        b.counts_send.copy_(counts)
        b.in_splits.copy_(counts.view(ep, slots).sum(1))
        self.exchange.all_to_all(b.counts_send, b.counts_splits, b.counts_recv, b.counts_splits_offsets)
        self.exchange.all_to_all(b.send, b.in_splits, b.recv, b.recv_splits_offsets)
        to_self = b.in_splits[self.ep_rank]
        sent = n if real is None else b.in_splits.sum()
        self._sent[0] += (sent - to_self) * rows.shape[1] * rows.element_size()
        step = int(self.step_tokens)  # type: ignore[arg-type]
        sender = SymmMemSender(num_tokens, token_idx, topk_weights.reshape(-1).index_select(0, order), real)
        # N: the most rows this rank can receive this step; the expected real rows of a slot: tokens * K / experts
        return SymmMemInFlight(b, x.shape[1], ep * step * min(top_k, slots), step * top_k / slots, sender)

    def dispatch_recv(self, handle: DispatchHandle) -> tuple[ExpertInput, DispatchHandle]:
        if not isinstance(handle, SymmMemInFlight):
            return self.larger_steps.dispatch_recv(handle)
        b = handle.buffers
        counts = b.counts_recv.view(self.ep_size, self.num_local_slots)
        index, position, per_slot, total = regroup_indices(counts, handle.num_rows, self.shape.recv_rows)
        rows = self.payload.gather_expert_rows(b.recv, index, total, handle.hidden)
        expert_input = ExpertInput(rows.hidden_states, per_slot, scales=rows.scales, masked=True,
                                   rows_per_expert=handle.rows_per_expert, global_scale=rows.global_scale)
        return expert_input, SymmMemRoute(b, position, total, handle.sender)

    def combine_send(self, y: torch.Tensor, handle: DispatchHandle) -> DispatchHandle:
        """y [N, H] in ExpertInput order (masked: rows past the real ones are neither read nor sent)."""
        if not isinstance(handle, SymmMemRoute):
            return self.larger_steps.combine_send(y, handle)
        b = handle.buffers
        # the real rows back into the received order
        gather_real_rows(b.combine_in[:, : y.shape[1]], y, handle.position, handle.total, 0)
        splits = b.recv_splits_offsets[0]
        b.combine_splits.copy_(splits)
        self.exchange.all_to_all(b.combine_in, b.combine_splits, b.combine_out, b.combine_splits_offsets)
        self._sent[1] += (handle.total[0] - splits[self.ep_rank]) * y.shape[1] * y.element_size()
        return SymmMemCombineInFlight(b, handle.sender)

    def combine_recv(self, handle: DispatchHandle) -> torch.Tensor:
        """-> [T, H] in the original token order."""
        if not isinstance(handle, SymmMemCombineInFlight):
            return self.larger_steps.combine_recv(handle)
        sender, b = handle.sender, handle.buffers
        # every copy comes back, in the order it was sent
        y = b.combine_out[: sender.token_idx.shape[0], : self.shape.hidden]
        if sender.real is not None:  # (the unsent copies' rows hold an earlier step's)
            y = y.masked_fill(~sender.real[:, None], 0)
        out = weighted_combine(y, sender.token_idx, sender.weights, sender.num_tokens)
        b.busy = False
        return out
