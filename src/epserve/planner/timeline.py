"""Run a stage list on a model GPU: one compute stream, one link, two micro-batches at most.

Compute ops run back to back on the stream. A ``send`` op holds the stream for its own kernel,
then its transfer occupies the link for its wire time (transfers queue behind each other; their
fixed latencies overlap) and lands no earlier than latency + wire time after the send; the
matching ``recv`` stalls the stream until it has landed. Micro-batches interleave stage by stage as
``Schedule`` describes. Each op's stream time, and each stall, is charged to the op's kind (its host
overhead to ``overhead``), so the breakdown sums to the elapsed time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from epserve.parallel.stages import OP_KINDS, Schedule, Stage
from epserve.planner.ops import PricedOp

BUCKETS: tuple[str, ...] = (*OP_KINDS, "overhead")  # op kinds, plus the host time spent issuing ops
LayerCosts = dict[str, PricedOp] | Sequence[dict[str, PricedOp]]  # one layer's priced ops, or each layer's


@dataclass(frozen=True)
class Timeline:
    time_us: float
    by_kind_us: dict[str, float]  # stream time plus exposed communication, per op kind (BUCKETS)
    exposed_comm_us: float  # part of by_kind spent waiting for transfers
    transfer_us: float  # link time, hidden or not

    def __add__(self, other: Timeline) -> Timeline:
        kinds = {k: self.by_kind_us.get(k, 0.0) + other.by_kind_us.get(k, 0.0) for k in BUCKETS}
        return Timeline(
            self.time_us + other.time_us,
            kinds,
            self.exposed_comm_us + other.exposed_comm_us,
            self.transfer_us + other.transfer_us,
        )

    def scaled(self, factor: float) -> Timeline:
        return Timeline(
            self.time_us * factor,
            {k: v * factor for k, v in self.by_kind_us.items()},
            self.exposed_comm_us * factor,
            self.transfer_us * factor,
        )


EMPTY = Timeline(0.0, dict.fromkeys(BUCKETS, 0.0), 0.0, 0.0)


def stage_order(schedule: Schedule, num_layers: int) -> list[tuple[int, Stage]]:
    """(micro-batch, stage) in execution order: B lags A by ``micro_batch_offset`` stages, then
    they alternate one stage each."""
    per_mb = [stage for _ in range(num_layers) for stage in schedule.stages]
    if schedule.num_micro_batches == 1:
        return [(0, s) for s in per_mb]
    lead = schedule.micro_batch_offset
    order = [(0, s) for s in per_mb[:lead]]
    for i in range(max(len(per_mb) - lead, 0) + lead):
        if lead + i < len(per_mb):
            order.append((0, per_mb[lead + i]))
        if i < len(per_mb):
            order.append((1, per_mb[i]))
    return order


def run_schedule(schedule: Schedule, costs: Sequence[LayerCosts], num_layers: int) -> Timeline:
    """Elapsed time of ``num_layers`` layers under ``schedule``; ``costs[i]`` prices micro-batch i,
    the same for every layer or, as a sequence, layer by layer (layer ``l`` priced by ``costs[i][l]``)."""
    if len(costs) != schedule.num_micro_batches:
        raise ValueError(f"schedule {schedule.name!r} runs {schedule.num_micro_batches} micro-batches, "
                         f"got {len(costs)}")
    per_layer = [[c] * num_layers if isinstance(c, dict) else list(c) for c in costs]
    if any(len(c) != num_layers for c in per_layer):
        raise ValueError(f"{num_layers} layers, but per-layer costs for {[len(c) for c in per_layer]}")
    stages_run = [0] * len(costs)  # stages each micro-batch has run: its layer is this // stages per layer
    now = 0.0
    link_free = 0.0
    transfer_total = 0.0
    exposed = 0.0
    landed: dict[tuple[int, str], float] = {}
    by_kind: dict[str, float] = defaultdict(float)
    for mb, stage in stage_order(schedule, num_layers):
        layer_costs = per_layer[mb][stages_run[mb] // len(schedule.stages)]
        stages_run[mb] += 1
        for op in stage.ops:
            cost = layer_costs[op.name]
            if op.comm == "recv":
                wait = max(0.0, landed.pop((mb, op.kind), now) - now)
                now += wait
                exposed += wait
                by_kind[op.kind] += wait
            now += cost.compute_us
            by_kind[op.kind] += cost.compute_us - cost.overhead_us
            by_kind["overhead"] += cost.overhead_us
            if op.comm == "send":
                xfer = cost.transfer
                link_free = max(now, link_free) + xfer.wire_us
                landed[(mb, op.kind)] = max(link_free, now + xfer.time_us)
                transfer_total += xfer.time_us
    return Timeline(now, {k: by_kind.get(k, 0.0) for k in BUCKETS}, exposed, transfer_total)
