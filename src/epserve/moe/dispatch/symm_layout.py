"""The ``symm_mem`` dispatcher's device-side layouts: its buffers, and the regroup between the exchange's
rank-major rows and the experts' slot-major rows, computed on the device from the exchanged counts (fixed
shapes, no host read).

Layouts: the exchange delivers rows source-major (source ``s``'s rows back to back, sorted by local slot
within: the order ``s`` sent them); the experts take them slot-major (slot 0's rows from source 0, source 1,
…, then slot 1's, …: the ``local`` and ``all_to_all`` order). Both are the same blocks ``(s, e)`` of
``c[s, e]`` rows in two orders; :func:`block_rows` finds each row's block and its place in it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from epserve.moe.dispatch.exchange import Exchange

# torch's all_to_all_vdev launches min(round_up(ceil(bytes / 64 KiB), ep), 64 within a node, 16 across nodes)
# blocks (or $TORCH_SYMM_MEM_NBLOCKS) over the whole input buffer, max(blocks // ep, 1) of them per peer, and
# asserts that each peer's bytes split evenly over its blocks. Buffers of at least MIN_BUFFER_BYTES get the
# most blocks, and rows padded to ``row_align(ep)`` bytes split evenly, whatever their number.
ROW_ALIGN = 64
MIN_BUFFER_BYTES = 64 * 64 * 1024


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def row_align(ep: int) -> int:
    """Bytes a buffer row's size is a multiple of, so that torch's ``all_to_all_vdev`` splits any number of
    rows evenly over the blocks it gives each of ``ep`` peers (see ``MIN_BUFFER_BYTES``)."""
    blocks = [64, 16] + [int(n) for n in [os.environ.get("TORCH_SYMM_MEM_NBLOCKS", "")] if n.isdigit() and int(n)]
    return math.lcm(ROW_ALIGN, *(max(b // ep, 1) for b in blocks))


def block_rows(sizes: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``j < num_rows`` of blocks of ``sizes`` [B] rows laid back to back -> (the block of each row
    [num_rows], the row's place in its block [num_rows], the rows in all [1]). Rows past the total fall in
    the last block, past its end."""
    ends = sizes.cumsum(0)
    j = torch.arange(num_rows, device=sizes.device)
    block = torch.searchsorted(ends, j, right=True).clamp_(max=sizes.shape[0] - 1)
    return block, j - (ends - sizes)[block], ends[-1:]


def compact_index(splits_offsets: torch.Tensor, slots: int, ep: int, num_rows: int, zero_row: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Received blocks described expert-major (``splits_offsets`` [2, slots*ep]: rows of block
    ``e*ep + s`` of slot ``e`` from source ``s``, and the received row where it starts) -> (index
    [num_rows] of the received row for each slot-major row, ``zero_row`` past the real ones; counts [slots]
    per slot). The blocks may lie anywhere in the received buffer, with gaps or in another order."""
    splits, offsets = splits_offsets[0], splits_offsets[1]
    block, within, total = block_rows(splits, num_rows)
    j = torch.arange(num_rows, device=splits.device)
    return torch.where(j < total, offsets[block] + within, zero_row), splits.view(slots, ep).sum(1)


def regroup_indices(counts: torch.Tensor, num_rows: int, recv_rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the received counts ``counts`` [ep, slots] (``c[s, e]``: rows of local slot ``e`` from source
    ``s``), for the source-major received rows -> (index [num_rows]: the received row of each slot-major
    row; position [recv_rows]: the slot-major row of each received row; counts per slot [slots]; the real
    rows [1]). Entries past the real rows are 0: they are never used."""
    ep, slots = counts.shape
    flat = counts.reshape(-1)  # blocks s*slots + e, as received
    recv_start = (flat.cumsum(0) - flat).view(ep, slots)
    splits_offsets = torch.stack([counts.t().reshape(-1), recv_start.t().reshape(-1)])
    index, per_slot = compact_index(splits_offsets, slots, ep, num_rows, 0)
    by_slot = counts.t().reshape(-1)  # blocks e*ep + s, slot-major
    slot_start = (by_slot.cumsum(0) - by_slot).view(slots, ep)
    block, within, total = block_rows(flat, recv_rows)
    position = slot_start[block % slots, block // slots] + within
    position = torch.where(torch.arange(recv_rows, device=counts.device) < total, position, 0)
    return index, position, per_slot, total


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

    def strides(self) -> tuple[int, int]:
        """Elements per buffer row of the payload and of the expert outputs: their widths rounded up to
        ``row_align(ep)`` bytes."""
        align = row_align(self.ep)
        return tuple(-(-width * item // align) * align // item for width, item in (  # type: ignore[return-value]
            (self.width, _item(self.payload_dtype)), (self.hidden, _item(self.dtype))))

    def allocated(self, rows: int) -> int:
        """Rows allocated for ``rows``: at least ``MIN_BUFFER_BYTES`` in either use of the buffer."""
        payload, out = self.strides()
        return max(rows, -(-MIN_BUFFER_BYTES // min(payload * _item(self.payload_dtype), out * _item(self.dtype))))

    def row_bytes(self) -> int:
        """Bytes of a row slot shared by a payload row and an expert-output row (one buffer serves both)."""
        payload, out = self.strides()
        return max(payload * _item(self.payload_dtype), out * _item(self.dtype))

    def bytes(self) -> int:
        counters = 9 * self.ep + 2 * self.ep * self.slots  # the int64 splits, offsets and counts
        rows = self.allocated(self.send_rows) + self.allocated(self.recv_rows)
        return rows * self.row_bytes() + 8 * counters


class BufferSet:
    """One in-flight exchange's buffers, allocated (and, on NVSHMEM, rendezvoused) once. The dispatch's
    sent rows and the combine's received rows share one buffer, the dispatch's received rows and the
    combine's sent rows another: each exchange starts with a barrier of every peer, after which nobody reads
    the other use any more."""

    def __init__(self, shape: BufferShape, exchange: Exchange, device: torch.device) -> None:
        def alloc(*size: int) -> torch.Tensor:
            return exchange.alloc(*size, dtype=torch.int64, device=device)

        def rows(n: int, stride: int, dtype: torch.dtype, flat: torch.Tensor) -> torch.Tensor:
            return flat[: n * stride * _item(dtype)].view(dtype).view(n, stride)  # from the start: one allocation

        ep, slots, row = shape.ep, shape.slots, shape.row_bytes()
        payload, out = shape.strides()
        send_rows, recv_rows = shape.allocated(shape.send_rows), shape.allocated(shape.recv_rows)
        sent = exchange.alloc(send_rows * row, dtype=torch.uint8, device=device)
        received = exchange.alloc(recv_rows * row, dtype=torch.uint8, device=device)
        # whole rows travel, the real columns first
        self.send = rows(send_rows, payload, shape.payload_dtype, sent)  # rank-major, then slot
        self.recv = rows(recv_rows, payload, shape.payload_dtype, received)  # source-major
        self.combine_in = rows(recv_rows, out, shape.dtype, received)  # as received
        self.combine_out = rows(send_rows, out, shape.dtype, sent)  # as sent
        self.in_splits, self.recv_splits_offsets = alloc(ep), alloc(2, ep)
        self.counts_send, self.counts_recv = alloc(ep * slots), alloc(ep * slots)
        self.counts_splits, self.counts_splits_offsets = alloc(ep).fill_(slots), alloc(2, ep)
        self.combine_splits, self.combine_splits_offsets = alloc(ep), alloc(2, ep)
        self.busy = False
