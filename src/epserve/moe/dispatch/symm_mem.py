"""``symm_mem`` dispatcher (CUDA with NVSHMEM): exact, sync-free and capturable, on torch's symmetric memory.

The exchange is torch's NVSHMEM ``all_to_all_vdev_2d`` (dispatch) and ``all_to_all_vdev_2d_offset``
(combine), whose split sizes stay on the device: only real rows move, the host never waits, and the
whole layer can be captured in a CUDA graph.

Dispatch: the ``T*K`` token copies are sorted by physical slot (rank ``r`` owns slots
``[r*S, (r+1)*S)``), i.e. destination rank, then local slot; ``in_splits[r*S + e]`` holds the rows for
slot ``e`` of rank ``r``. The op transposes rank-major to expert-major: on the receiver, rows of local
slot ``e`` from source ``s`` land at ``out_offsets[e*ep + s]``, ``out_splits[e*ep + s]`` of them, the
sources of one slot back to back. Alignment: ``major_align`` is 1 here, but the op still gives a slot
that receives nothing one padding row (torch keeps empty groups non-empty for cutlass), so slot groups
can have gaps; ``dispatch_recv`` compacts them with one gather into the layout the expert GEMM takes
(rows of slot 0, slot 1, …, then zero padding rows up to a fixed ``N``).

Combine: the expert outputs (compact, ``N`` rows) go back through ``all_to_all_vdev_2d_offset`` with
the received splits and their compact offsets; it transposes expert-major to rank-major, so each sender
gets its rows back in exactly the order it sent them, and the weighted sum follows as in every backend.

Buffers: symmetric memory is allocated once at start-up for ``max_tokens_per_rank`` tokens (every rank
the same shapes, a collective rendezvous), in two sets so that two micro-batches can be in flight; a
dispatch takes the next free set and its combine frees it. ``begin_step`` fixes ``N = ep * tokens *
min(K, S)`` for the step (what the fixed-shape ``padded`` backend receives), so a captured bucket always
sees the same shapes. Every op is stream-ordered and starts with an NVSHMEM barrier, so a buffer set is
reused only after every peer has finished reading it. ``comm_bytes`` is accumulated on the device (no
sync) and read on the host when asked. With ``fp8`` the rows travel as packed FP8 bytes (``payload.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.config import ConfigError
from epserve.config.engine import SYMM_MEM_MAX_LOCAL_SLOTS, SYMM_MEM_MAX_RANKS
from epserve.kernels.ops import group_by_expert, weighted_combine
from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput
from epserve.moe.dispatch.payload import Payload

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
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev_2d_offset"):
        return "this torch build lacks torch.ops.symm_mem.all_to_all_vdev_2d_offset"
    return None


def check_symm_mem(device: torch.device, num_local_slots: int, ep_size: int) -> None:
    """ConfigError naming the option when ``--dispatch symm_mem`` cannot run here."""
    problem = symm_mem_problem(device)
    if problem is None and num_local_slots > SYMM_MEM_MAX_LOCAL_SLOTS:
        problem = (f"torch's all_to_all_vdev_2d takes at most {SYMM_MEM_MAX_LOCAL_SLOTS} experts per rank, "
                   f"not {num_local_slots}")
    if problem is None and ep_size > SYMM_MEM_MAX_RANKS:
        problem = f"torch's all_to_all_vdev_2d_offset takes at most {SYMM_MEM_MAX_RANKS} ranks, not {ep_size}"
    if problem is not None:
        raise ConfigError(f"dispatch 'symm_mem' (--dispatch symm_mem) cannot run: {problem}; "
                          "use --dispatch padded or all_to_all")


@dataclass(frozen=True)
class BufferShape:
    """Sizes of one buffer set: ``send_rows`` (a rank's ``max_tokens * K`` copies), ``recv_rows`` (the most
    real rows a rank can receive, ``ep * max_tokens * min(K, S)``), the payload row ``width`` and its dtype,
    the ``hidden`` size and activation ``dtype`` of the combine, ``slots`` per rank and ``ep`` ranks."""

    send_rows: int
    recv_rows: int
    width: int
    payload_dtype: torch.dtype
    hidden: int
    dtype: torch.dtype
    slots: int
    ep: int

    def bytes(self) -> int:
        item = torch.empty((), dtype=self.payload_dtype).element_size()
        act = torch.empty((), dtype=self.dtype).element_size()
        return ((self.send_rows + self.recv_rows + self.slots + 1) * self.width * item
                + (self.recv_rows + self.send_rows) * self.hidden * act + 7 * self.slots * self.ep * 8)


class BufferSet:
    """One in-flight exchange's symmetric buffers, allocated and rendezvoused once."""

    def __init__(self, shape: BufferShape, device: torch.device, group_name: str) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        def alloc(*size: int, dtype: torch.dtype) -> torch.Tensor:
            return symm_mem.empty(*size, dtype=dtype, device=device).zero_()

        nsplits = shape.slots * shape.ep
        self.send = alloc(shape.send_rows, shape.width, dtype=shape.payload_dtype)  # rank-major, then local slot
        self.in_splits = alloc(nsplits, dtype=torch.int64)
        # The real rows, + at most one padding row per slot (the op's, for an empty slot), + one row never
        # written: the zero row the compaction gathers for padding.
        self.recv = alloc(shape.recv_rows + shape.slots + 1, shape.width, dtype=shape.payload_dtype)
        self.recv_splits_offsets = alloc(2, nsplits, dtype=torch.int64)  # expert-major: [e*ep + src]
        self.combine_in = alloc(shape.recv_rows, shape.hidden, dtype=shape.dtype)
        self.combine_in_splits_offsets = alloc(2, nsplits, dtype=torch.int64)
        self.combine_out = alloc(shape.send_rows, shape.hidden, dtype=shape.dtype)  # rank-major, as sent
        self.combine_out_splits_offsets = alloc(2, nsplits, dtype=torch.int64)
        for t in (self.send, self.in_splits, self.recv, self.recv_splits_offsets, self.combine_in,
                  self.combine_in_splits_offsets, self.combine_out, self.combine_out_splits_offsets):
            symm_mem.rendezvous(t, group_name)
        self.zero_row = self.recv.shape[0] - 1
        self.busy = False


@dataclass(frozen=True)
class SymmMemSender:
    """The sending side's record of where its token copies went."""

    num_tokens: int
    token_idx: torch.Tensor  # [T*K] source token of each sent row, in send order
    weights: torch.Tensor  # [T*K] routing weight of each sent row (fp32)


@dataclass(frozen=True)
class SymmMemInFlight(DispatchHandle):
    buffers: BufferSet
    hidden: int
    num_rows: int  # N: the ExpertInput's fixed row count this step
    sender: SymmMemSender


@dataclass(frozen=True)
class SymmMemRoute(DispatchHandle):
    buffers: BufferSet
    sender: SymmMemSender


@dataclass(frozen=True)
class SymmMemCombineInFlight(DispatchHandle):
    buffers: BufferSet
    sender: SymmMemSender


def compact_index(splits_offsets: torch.Tensor, slots: int, ep: int, num_rows: int, zero_row: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """From the dispatch op's ``out_splits_offsets`` [2, slots*ep] (expert-major): (index [num_rows] of the
    received buffer's row for each compact row, ``zero_row`` past the real ones; counts [slots] per slot).
    The sources of one slot are contiguous from ``offsets[e*ep]``; gaps only lie between slots."""
    splits = splits_offsets[0].view(slots, ep)
    starts = splits_offsets[1].view(slots, ep)[:, 0]
    counts = splits.sum(1)
    ends = counts.cumsum(0)
    j = torch.arange(num_rows, device=splits.device)
    slot = torch.searchsorted(ends, j, right=True).clamp_(max=slots - 1)
    index = starts[slot] + j - (ends - counts)[slot]
    return torch.where(j < ends[-1], index, zero_row), counts


class SymmMemDispatcher(Dispatcher):
    name = "symm_mem"

    def __init__(self, num_local_slots: int, group: dist.ProcessGroup, top_k: int, max_tokens_per_rank: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, fp8: bool = False) -> None:
        """Allocates and rendezvouses the symmetric buffers: a collective, every EP rank at once."""
        device = torch.device(device)
        ep = dist.get_world_size(group) if group is not None else 1
        check_symm_mem(device, num_local_slots, ep)
        from torch.distributed import _symmetric_memory as symm_mem

        backend = symm_mem.get_backend(device)
        if backend is None:
            symm_mem.set_backend("NVSHMEM")
        elif backend != "NVSHMEM":
            raise ConfigError(f"dispatch 'symm_mem' needs the NVSHMEM symmetric-memory backend; this process already "
                              f"allocated symmetric memory with {backend}")
        self.num_local_slots = num_local_slots
        self.group = group
        self.group_name = group.group_name
        symm_mem.enable_symm_mem_for_group(self.group_name)
        self.ep_size = ep
        self.ep_rank = dist.get_rank(group)
        self.top_k = top_k
        self.max_tokens_per_rank = max_tokens_per_rank
        self.payload = Payload(fp8)
        self.shape = BufferShape(
            send_rows=max_tokens_per_rank * top_k, recv_rows=ep * max_tokens_per_rank * min(top_k, num_local_slots),
            width=self.payload.width(hidden_size), payload_dtype=self.payload.dtype(dtype), hidden=hidden_size,
            dtype=dtype, slots=num_local_slots, ep=ep)
        self.buffers = [BufferSet(self.shape, device, self.group_name) for _ in range(NUM_BUFFER_SETS)]
        self._next = 0
        self.step_tokens: int | None = None
        self._sent = torch.zeros(2, dtype=torch.int64, device=device)  # dispatch, combine bytes (on the device)
        logger.info("symm_mem dispatcher: %d buffer sets for %d tokens per rank, %.1f MiB of symmetric memory",
                    NUM_BUFFER_SETS, max_tokens_per_rank, NUM_BUFFER_SETS * self.shape.bytes() / 2**20)

    def workspace_bytes(self) -> int:
        """The symmetric buffers of every buffer set, allocated once at start-up."""
        return NUM_BUFFER_SETS * self.shape.bytes()

    # ---- statistics: accumulated on the device, read (a sync) only when asked ---------------------------------
    def reset_stats(self) -> None:
        self._sent.zero_()

    @property
    def comm_bytes(self) -> dict[str, int]:  # type: ignore[override]
        dispatch, combine = self._sent.tolist()
        return {"dispatch": dispatch, "combine": combine}

    # ---- the step ----------------------------------------------------------------------------------------------
    def begin_step(self, max_tokens_per_rank: int) -> None:
        if max_tokens_per_rank > self.max_tokens_per_rank:
            raise RuntimeError(f"SymmMemDispatcher: {max_tokens_per_rank} tokens per rank exceed the "
                               f"{self.max_tokens_per_rank} its buffers were allocated for at start-up")
        self.step_tokens = max_tokens_per_rank
        for b in self.buffers:  # a step starts with nothing in flight
            b.busy = False

    def _acquire(self, num_tokens: int) -> BufferSet:
        if self.step_tokens is None:
            raise RuntimeError("SymmMemDispatcher: begin_step(max_tokens_per_rank) was not called before dispatch")
        if num_tokens > self.step_tokens:
            raise RuntimeError(f"SymmMemDispatcher: {num_tokens} tokens exceed max_tokens_per_rank="
                               f"{self.step_tokens} given to begin_step")
        buffers = self.buffers[self._next]
        if buffers.busy:
            raise RuntimeError(f"SymmMemDispatcher: more than {NUM_BUFFER_SETS} dispatches in flight")
        self._next = (self._next + 1) % NUM_BUFFER_SETS
        buffers.busy = True
        return buffers

    def dispatch_send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> SymmMemInFlight:
        """x [T, H], topk_ids [T, K] physical slots, topk_weights [T, K]."""
        ep, slots = self.ep_size, self.num_local_slots
        num_tokens, top_k = topk_ids.shape
        if top_k != self.top_k or x.shape[1] != self.shape.hidden:
            raise ValueError(f"SymmMemDispatcher was built for top-k {self.top_k} and hidden size {self.shape.hidden}, "
                             f"got topk_ids {tuple(topk_ids.shape)} and x {tuple(x.shape)}")
        b = self._acquire(num_tokens)
        order, counts = group_by_expert(topk_ids, ep * slots)  # rank-major, then local slot: in_splits' order
        token_idx = order // top_k
        rows = self.payload.rows(x)
        n = num_tokens * top_k
        torch.index_select(rows, 0, token_idx, out=b.send[:n])
        b.in_splits.copy_(counts)
        torch.ops.symm_mem.all_to_all_vdev_2d(b.send, b.recv, b.in_splits, b.recv_splits_offsets, self.group_name,
                                              major_align=1)
        to_self = counts.view(ep, slots)[self.ep_rank].sum()
        self._sent[0] += (n - to_self) * rows.shape[1] * rows.element_size()
        num_rows = ep * self.step_tokens * min(top_k, slots)  # type: ignore[operator]
        sender = SymmMemSender(num_tokens, token_idx, topk_weights.reshape(-1).index_select(0, order))
        return SymmMemInFlight(b, x.shape[1], num_rows, sender)

    def dispatch_recv(self, handle: SymmMemInFlight) -> tuple[ExpertInput, SymmMemRoute]:
        b = handle.buffers
        index, counts = compact_index(b.recv_splits_offsets, self.num_local_slots, self.ep_size, handle.num_rows,
                                      b.zero_row)
        rows, scales = self.payload.expert_rows(b.recv.index_select(0, index), handle.hidden)
        return ExpertInput(rows, counts, scales=scales), SymmMemRoute(b, handle.sender)

    def combine_send(self, y: torch.Tensor, handle: SymmMemRoute) -> SymmMemCombineInFlight:
        """y [N, H] in ExpertInput order (compact; rows past the real ones are not sent)."""
        b = handle.buffers
        b.combine_in[: y.shape[0]].copy_(y)
        splits = b.recv_splits_offsets[0]
        b.combine_in_splits_offsets[0].copy_(splits)
        b.combine_in_splits_offsets[1].copy_(splits.cumsum(0) - splits)  # the compact rows' offsets
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(b.combine_in, b.combine_out, b.combine_in_splits_offsets,
                                                     b.combine_out_splits_offsets, self.group_name)
        from_self = splits.view(self.num_local_slots, self.ep_size)[:, self.ep_rank].sum()
        self._sent[1] += (splits.sum() - from_self) * b.combine_in.shape[1] * b.combine_in.element_size()
        return SymmMemCombineInFlight(b, handle.sender)

    def combine_recv(self, handle: SymmMemCombineInFlight) -> torch.Tensor:
        """-> [T, H] in the original token order."""
        sender, b = handle.sender, handle.buffers
        y = b.combine_out[: sender.token_idx.shape[0]]  # every copy comes back, in the order it was sent
        out = weighted_combine(y, sender.token_idx, sender.weights, sender.num_tokens)
        b.busy = False
        return out
