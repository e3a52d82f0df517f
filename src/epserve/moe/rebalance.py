"""Moving routed experts between ranks when their placement changes (EPLB's second half).

A new placement (from ``epserve.eplb.rebalance_experts``) says which logical expert each physical slot
holds. :func:`align_placement` first relabels it to keep as much as possible where it is: the new
per-rank sets are matched to the ranks that already hold most of them (within a node, so the policy's
node packing stays), and inside a rank an expert that stays keeps its slot. Then only the slots whose
expert is not on their rank yet are filled over the network (:func:`plan_moves`): one point-to-point
transfer per slot, all of a layer's transfers in one batch (:func:`move_expert_weights`). Experts that
only change slot inside a rank are copied locally. The stacked weight tensors are overwritten in place,
so a captured graph keeps reading the same storage.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.moe.placement import ExpertPlacement


@dataclass(frozen=True)
class ExpertMove:
    """Expert ``logical``'s weights from physical slot ``src`` (old placement) to slot ``dst`` (new)."""

    logical: int
    src: int
    dst: int


def _rank_sets(p: ExpertPlacement) -> list[list[int]]:
    return [list(p.local_logical_experts(r)) for r in range(p.ep_size)]


def align_placement(old: ExpertPlacement, new_slots: tuple[int, ...]) -> ExpertPlacement:
    """``new_slots`` (a physical -> logical map with the same balance) relabelled to move the fewest
    experts from ``old``: whole per-rank sets permuted among the ranks of each node, then each rank's
    slots ordered so that an expert already in a slot stays there."""
    new = old.with_slots(new_slots)
    old_sets, new_sets = _rank_sets(old), _rank_sets(new)
    assignment: dict[int, int] = {}  # new set -> rank
    nodes: dict[int, list[int]] = {}
    for r in range(old.ep_size):
        nodes.setdefault(old.node_of(r), []).append(r)
    for ranks in nodes.values():
        overlap = {(g, r): sum((Counter(new_sets[g]) & Counter(old_sets[r])).values()) for g in ranks for r in ranks}
        free_sets, free_ranks = set(ranks), set(ranks)
        for (g, r), _ in sorted(overlap.items(), key=lambda kv: (-kv[1], kv[0])):
            if g in free_sets and r in free_ranks:
                assignment[g] = r
                free_sets.discard(g)
                free_ranks.discard(r)
    slots: list[int] = [0] * old.num_physical_experts
    width = old.num_local_slots
    for g, r in assignment.items():
        want = Counter(new_sets[g])
        row: list[int | None] = [None] * width
        for i, e in enumerate(old_sets[r]):  # experts that stay keep their slot
            if want[e]:
                row[i] = e
                want[e] -= 1
        rest = iter(sorted(want.elements()))
        slots[r * width : (r + 1) * width] = [e if e is not None else next(rest) for e in row]
    return old.with_slots(tuple(slots))


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[ExpertMove]:
    """The transfers that fill every slot of ``new`` whose expert its rank does not hold in ``old``, in
    slot order. Sources: the old replicas on the destination's node first, then the sources used least
    so far (so a hot expert's copies are read from several ranks)."""
    old_replicas = old.replicas()
    uses: Counter[int] = Counter()
    moves = []
    for dst, logical in enumerate(new.physical_to_logical):
        rank = new.rank_of(dst)
        if logical in old.local_logical_experts(rank):
            continue
        node = new.node_of(rank)
        src = min(old_replicas[logical], key=lambda s: (old.node_of(old.rank_of(s)) != node, uses[s], s))
        uses[src] += 1
        moves.append(ExpertMove(logical, src, dst))
    return moves


def move_expert_weights(
    tensors: list[torch.Tensor], old: ExpertPlacement, new: ExpertPlacement, moves: list[ExpertMove], rank: int,
    group: dist.ProcessGroup | None,
) -> int:
    """Rewrite this rank's stacked expert tensors (each ``[num_local_slots, ...]``) from ``old``'s slot
    contents to ``new``'s, exchanging the experts that change rank with the other ranks by ``moves``
    (:func:`plan_moves`; every rank calls it with the same placements). Returns the bytes this rank
    received."""
    tensors = [t.view(torch.uint8) for t in tensors]  # bytes on the wire: FP8 weights too, on any backend
    width = old.num_local_slots
    lo = rank * width
    old_local = old.local_logical_experts(rank)
    incoming = {m.dst - lo for m in moves if new.rank_of(m.dst) == rank}
    # Slots filled from this rank's own old slots (0 for the incoming ones: overwritten by the receive).
    gather = torch.tensor([0 if s in incoming else old_local.index(new.physical_to_logical[lo + s])
                           for s in range(width)], dtype=torch.long)
    staged = [t.index_select(0, gather.to(t.device)) for t in tensors]
    ops = []
    for i, move in enumerate(moves):
        src_rank, dst_rank = old.rank_of(move.src), new.rank_of(move.dst)
        for j, t in enumerate(tensors):
            tag = i * len(tensors) + j
            if src_rank == rank and dst_rank != rank:
                ops.append(dist.P2POp(dist.isend, t[move.src - lo].contiguous(), dst_rank, group, tag))
            elif dst_rank == rank and src_rank != rank:
                ops.append(dist.P2POp(dist.irecv, staged[j][move.dst - lo], src_rank, group, tag))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for t, s in zip(tensors, staged):
        t.copy_(s)
    return sum(t[0].numel() for t in tensors) * len(incoming)
