"""Collectives the model and the step loop use, so neither branches on the layout.

:class:`TensorParallel` is how a decoder layer moves between its two halves (``stages.py``): the
attention runs on every token of the DP group with this rank's heads, its ``o_proj`` partial sums
are reduce-scattered so each TP rank owns a contiguous ``1/TP`` of the tokens (whose residual it
keeps, and which it alone routes and dispatches, so no token is sent twice), and the FFN output is
all-gathered back. With TP = 1 every method is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from epserve.parallel.context import ParallelContext

# torch >= 2.10 names them *_single (the *_tensor names are deprecated there)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class TensorParallel:
    def __init__(self, ctx: ParallelContext) -> None:
        self.size = ctx.tp
        self.rank = ctx.tp_rank
        self.group = ctx.tp_group

    def chunk(self, num_tokens: int) -> int:
        return -(-num_tokens // self.size)

    def own_range(self, num_tokens: int) -> tuple[int, int]:
        """Tokens ``[lo, hi)`` of a ``num_tokens`` batch this rank owns in the FFN half."""
        chunk = self.chunk(num_tokens)
        lo = min(self.rank * chunk, num_tokens)
        return lo, min(lo + chunk, num_tokens)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.own_range(x.shape[0])
        return x[lo:hi]

    def reduce_scatter(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum ``partial`` [T, H] over the TP ranks and keep this rank's rows ``[own, H]``."""
        if self.size == 1 or partial.shape[0] == 0:  # a DP group's TP ranks all see the same batch
            return partial
        num_tokens = partial.shape[0]
        chunk = self.chunk(num_tokens)
        padded = F.pad(partial, (0, 0, 0, chunk * self.size - num_tokens))
        out = partial.new_empty(chunk, partial.shape[1])
        _reduce_scatter(out, padded.contiguous(), group=self.group)
        lo, hi = self.own_range(num_tokens)
        return out[: hi - lo]

    def all_gather(self, own: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Every rank's owned rows ``[own, H]`` -> the whole batch ``[T, H]``."""
        if self.size == 1 or num_tokens == 0:
            return own
        chunk = self.chunk(num_tokens)
        padded = F.pad(own, (0, 0, 0, chunk - own.shape[0]))
        out = own.new_empty(chunk * self.size, own.shape[1])
        _all_gather(out, padded.contiguous(), group=self.group)
        return out[:num_tokens]


def all_reduce_max(values: list[int], ctx: ParallelContext) -> list[int]:
    """Element-wise max of small integer vectors over every rank (the step's metadata all-reduce)."""
    if not ctx.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.meta_group)
    return t.tolist()


def broadcast_from_leader(obj: object, ctx: ParallelContext) -> object:
    """The leader's ``obj`` on every TP rank of its DP group (host-side, pickled over gloo)."""
    if ctx.tp == 1:
        return obj
    box = [obj if ctx.is_leader else None]
    dist.broadcast_object_list(box, src=ctx.leader_rank, group=ctx.tp_meta_group)
    return box[0]


def gather_objects(obj: object, ctx: ParallelContext) -> list[object]:
    """Every rank's ``obj``, on every rank, in rank order."""
    if not ctx.distributed:
        return [obj]
    out: list[object] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=ctx.meta_group)
    return out
