"""The exchange primitive the ``symm_mem`` dispatcher is built on: a 1-D variable all-to-all by rank whose
split sizes stay on the device.

``all_to_all(send, in_splits, recv, out_splits_offsets)``: this rank sends rows ``[o_r, o_r + in_splits[r])``
of ``send`` (``o`` the exclusive prefix sum of ``in_splits`` [ep]) to rank ``r``; rank ``s``'s rows land in
``recv`` back to back in source order, and ``out_splits_offsets`` [2, ep] receives their counts (row 0) and
offsets (row 1, the exclusive prefix sum of row 0). Buffers come from ``alloc``: every rank allocates the
same shapes in the same order (a collective).

- :class:`NvshmemExchange`: torch's NVSHMEM ``all_to_all_vdev`` on symmetric memory. The splits never leave
  the device, so the host never waits and the exchange can be captured in a CUDA graph. The op pulls each
  peer's rows after a team barrier, so a buffer a peer may still read is reused only after that barrier.
- :class:`GlooExchange`: its twin over any process group (gloo on the CPU), the splits read on the host and
  the rows moved by ``all_to_all_single``. It runs the dispatcher's bookkeeping and payload in the CPU tests;
  ``build_dispatcher`` never chooses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist


class Exchange(ABC):
    """A 1-D variable all-to-all over the ranks of ``group`` (see the module docstring)."""

    name: str

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)

    @abstractmethod
    def alloc(self, *size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed buffer the exchange can send from and receive into."""

    @abstractmethod
    def all_to_all(self, send: torch.Tensor, in_splits: torch.Tensor, recv: torch.Tensor,
                   out_splits_offsets: torch.Tensor) -> None:
        """Send ``in_splits[r]`` rows to each rank ``r``; receive into ``recv`` (see the module docstring)."""


class NvshmemExchange(Exchange):
    """``torch.ops.symm_mem.all_to_all_vdev`` on NVSHMEM symmetric buffers (CUDA)."""

    name = "nvshmem"

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__(group)
        from torch.distributed import _symmetric_memory as symm_mem

        self.group_name = group.group_name
        symm_mem.enable_symm_mem_for_group(self.group_name)

    def alloc(self, *size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        from torch.distributed import _symmetric_memory as symm_mem

        t = symm_mem.empty(*size, dtype=dtype, device=device).zero_()
        symm_mem.rendezvous(t, self.group_name)
        return t

    def all_to_all(self, send: torch.Tensor, in_splits: torch.Tensor, recv: torch.Tensor,
                   out_splits_offsets: torch.Tensor) -> None:
        torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits_offsets, self.group_name)


class GlooExchange(Exchange):
    """The CPU twin: the same contract through ``all_to_all_single``, its splits read on the host."""

    name = "gloo"

    def alloc(self, *size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(*size, dtype=dtype, device=device)

    def all_to_all(self, send: torch.Tensor, in_splits: torch.Tensor, recv: torch.Tensor,
                   out_splits_offsets: torch.Tensor) -> None:
        out_splits = torch.empty_like(in_splits)
        dist.all_to_all_single(out_splits, in_splits.contiguous(), group=self.group)
        sent, got = in_splits.tolist(), out_splits.tolist()
        if sum(got) > recv.shape[0] or sum(sent) > send.shape[0]:
            raise RuntimeError(f"GlooExchange: {sum(sent)} rows sent from a buffer of {send.shape[0]}, {sum(got)} "
                               f"received into one of {recv.shape[0]}")
        dist.all_to_all_single(recv[: sum(got)], send[: sum(sent)].contiguous(), got, sent, group=self.group)
        out_splits_offsets[0].copy_(out_splits)
        out_splits_offsets[1].copy_(out_splits.cumsum(0) - out_splits)
