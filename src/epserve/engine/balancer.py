"""Expert-parallel load balancing while serving: the load window and the rebalance between steps.

Every MoE layer counts, on the device, the token copies its slots receive per logical expert. With
EPLB enabled, :meth:`ExpertBalancer.record_step` keeps the last ``window_size`` steps' counts (a ring
on the device; no host sync) and says when ``step_interval`` steps have passed. :meth:`rebalance` is
a collective every rank runs between the same two steps: the ranks sum their loads, compute the
placement (``epserve.eplb.rebalance_experts``: replicas for the busiest experts, balanced packing),
move only the experts that change rank (``moe/rebalance.py``) and switch each layer's routing tables.
Requests in flight are untouched: their KV cache stays, and every replica holds the same weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.config import EplbConfig
from epserve.eplb import gpu_loads, imbalance, rebalance_experts
from epserve.model.moe import MoE
from epserve.moe.placement import ExpertPlacement
from epserve.moe.rebalance import align_placement, move_expert_weights, plan_moves
from epserve.parallel.context import ParallelContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceReport:
    """One rebalance: layers whose placement changed, expert transfers and bytes over every rank,
    wall time, and the mean per-layer imbalance (busiest rank / mean) of the load it balanced, under
    the old placement and under the new one (each replica taking an equal share)."""

    layers_changed: int
    experts_moved: int
    bytes_moved: int
    seconds: float
    imbalance_before: float
    imbalance_after: float


def _rank_imbalance(weight: torch.Tensor, placements: list[ExpertPlacement]) -> float:
    phy2log = torch.tensor([p.physical_to_logical for p in placements], dtype=torch.long)
    logcnt = torch.zeros_like(weight, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    return float(imbalance(gpu_loads(weight, phy2log, logcnt, placements[0].ep_size)).mean())


class ExpertBalancer:
    """This rank's side of EPLB for every MoE layer of ``moes`` (by layer index)."""

    def __init__(self, moes: dict[int, MoE], ctx: ParallelContext, config: EplbConfig, num_nodes: int,
                 num_groups: int) -> None:
        self.moes = moes
        self.ctx = ctx
        self.config = config
        self.num_nodes = num_nodes
        self.num_groups = num_groups
        self.num_rebalances = 0
        self.last_report: RebalanceReport | None = None
        self.num_steps = 0
        first = next(iter(moes.values()))
        shape = (len(moes), first.placement.num_logical_experts)
        device = first.expert_load.device
        # Every layer's counter is a row of one tensor: a step's counts are read without stacking them.
        self._counts = torch.zeros(shape, dtype=torch.long, device=device)
        for row, moe in zip(self._counts, moes.values()):
            moe.expert_load = row
        self.window = (torch.zeros(config.window_size, *shape, dtype=torch.int32, device=device) if config.enabled
                       else None)
        self._last = torch.zeros(shape, dtype=torch.long, device=device)
        self._at_rebalance = torch.zeros(shape, dtype=torch.long, device=device)  # the counters then

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.moes)

    def counters(self, since_rebalance: bool = False) -> torch.Tensor:
        """``[layers, n_logical]`` token copies this rank received per logical expert since start-up (or
        the last reset); ``since_rebalance``: since the last rebalance (what the placement in use saw)."""
        return self._counts - self._at_rebalance if since_rebalance else self._counts.clone()

    def record_step(self) -> bool:
        """After every forward step (every rank): keep its counts in the window; whether a rebalance is
        due now (EPLB enabled and ``step_interval`` steps since start-up or the last one)."""
        if self.window is None:
            return False
        self.window[self.num_steps % self.config.window_size] = self._counts - self._last
        self._last.copy_(self._counts)
        self.num_steps += 1
        return self.num_steps % self.config.step_interval == 0

    def reset(self) -> None:
        """Forget every count (the start-up counters and the window)."""
        self._counts.zero_()
        self._last.zero_()
        self._at_rebalance.zero_()
        if self.window is not None:
            self.window.zero_()

    def local_load(self) -> torch.Tensor:
        """What this rank balances by, on the host: the window's counts with EPLB enabled, else the
        counts since start-up (or the last reset)."""
        load = self.window.sum(dim=0, dtype=torch.long) if self.window is not None else self.counters()
        return load.cpu()

    @torch.no_grad()
    def rebalance(self) -> RebalanceReport:
        """Place every layer's experts by the summed load of all ranks and move the weights that change
        rank. A collective: every rank calls it between the same two steps."""
        start = time.perf_counter()
        ctx = self.ctx
        weight = self.local_load()
        if ctx.distributed:
            dist.all_reduce(weight, group=ctx.meta_group)
        moes = list(self.moes.values())
        old = [m.placement for m in moes]
        first = old[0]
        if not int(weight.sum()):
            if ctx.rank == 0:
                logger.info("EPLB: no expert load recorded yet; placement kept")
            return RebalanceReport(0, 0, 0, time.perf_counter() - start, 1.0, 1.0)
        phy2log, _, _ = rebalance_experts(weight.double(), first.num_physical_experts, self.num_groups,
                                          self.num_nodes, first.ep_size)
        new = [align_placement(p, tuple(row.tolist())) for p, row in zip(old, phy2log)]
        changed = moved = received = 0
        for moe, before, after in zip(moes, old, new):
            if after.physical_to_logical == before.physical_to_logical:
                continue
            moves = plan_moves(before, after)
            changed, moved = changed + 1, moved + len(moves)
            received += move_expert_weights(list(moe.experts.parameters()), before, after, moves, ctx.rank,
                                            ctx.ep_group if ctx.distributed else None)
            moe.set_placement(after)
        self._at_rebalance.copy_(self._counts)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        total = torch.tensor([received], dtype=torch.long)
        if ctx.distributed:
            dist.all_reduce(total, group=ctx.meta_group)
        report = RebalanceReport(changed, moved, int(total), time.perf_counter() - start,
                                 _rank_imbalance(weight.double(), old), _rank_imbalance(weight.double(), new))
        self.num_rebalances += 1
        self.last_report = report
        if self.ctx.rank == 0:
            logger.info("EPLB rebalance %d: %d layers changed, %d experts moved (%.2f MiB) in %.3f s; "
                        "imbalance %.3f -> %.3f", self.num_rebalances, report.layers_changed, report.experts_moved,
                        report.bytes_moved / 2**20, report.seconds, report.imbalance_before, report.imbalance_after)
        return report
