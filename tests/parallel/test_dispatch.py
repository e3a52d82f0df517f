"""Multi-rank dispatchers (``all_to_all``, ``padded``) on spawned gloo ranks against the ``local``
reference: rows reach the right rank and slot in the documented order, combine returns the weighted
sum in token order, and ``comm_bytes`` counts what leaves the rank. Every rank rebuilds the global
routing from a shared seed, so each can compute what it should receive."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher

BACKENDS = {"all_to_all": AllToAllDispatcher, "padded": PaddedDispatcher}


@dataclass(frozen=True)
class Scenario:
    """One MoE layer's routing on every rank."""

    seed: int
    num_local_slots: int
    top_k: int
    tokens: tuple[int, ...]  # tokens on each rank
    hidden: int = 8
    dtype: torch.dtype = torch.float32
    only_to: tuple[tuple[int, int], ...] = ()  # (source rank, destination rank): all its tokens go there

    def inputs(self, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(x [T, H], topk_ids [T, K] distinct physical slots, topk_weights [T, K] fp32) of every rank."""
        g = torch.Generator().manual_seed(self.seed)
        slots, only_to = self.num_local_slots, dict(self.only_to)
        per_rank = []
        for rank in range(world_size):
            t = self.tokens[rank]
            x = torch.randn(t, self.hidden, generator=g).to(self.dtype)
            if rank in only_to:
                ids = torch.rand(t, slots, generator=g).topk(self.top_k, dim=1).indices + only_to[rank] * slots
            else:
                ids = torch.rand(t, world_size * slots, generator=g).topk(self.top_k, dim=1).indices
            per_rank.append((x, ids, torch.rand(t, self.top_k, generator=g)))
        return per_rank


def scenarios(world_size: int) -> dict[str, Scenario]:
    w = world_size
    return {
        "uneven_k1": Scenario(1, num_local_slots=3, top_k=1, tokens=(5, 0, 9, 3)[:w]),
        "topk_gt_slots": Scenario(2, num_local_slots=2, top_k=3, tokens=(7, 3, 0, 11)[:w]),
        "one_target": Scenario(3, num_local_slots=4, top_k=2, tokens=(6, 2, 4, 1)[:w], only_to=((0, w - 1),)),
        "bf16": Scenario(4, num_local_slots=2, top_k=2, tokens=(4, 6, 0, 2)[:w], hidden=16, dtype=torch.bfloat16),
        "all_empty": Scenario(5, num_local_slots=2, top_k=2, tokens=(0,) * w),
    }


def expected_rows(sc: Scenario, inputs: list, rank: int) -> tuple[torch.Tensor, list[int]]:
    """Rows ``rank`` should receive: slot-major, then source rank, then the source's (token, k) order."""
    rows, counts = [], []
    for local in range(sc.num_local_slots):
        slot = rank * sc.num_local_slots + local
        picked = [x[(ids == slot).nonzero()[:, 0]] for x, ids, _ in inputs]
        counts.append(sum(len(p) for p in picked))
        rows.extend(picked)
    return torch.cat(rows), counts


def expert_fn(expert_input: ExpertInput, first_slot: int) -> torch.Tensor:
    """The 'experts': row * (1 + global slot id)."""
    counts = expert_input.num_tokens_per_expert
    scale = torch.arange(len(counts), dtype=torch.float32) + 1 + first_slot
    scale = scale.repeat_interleave(counts)  # padding rows past the real ones (fixed-shape backends) get 0
    scale = torch.cat([scale, scale.new_zeros(expert_input.hidden_states.shape[0] - scale.shape[0])])
    return expert_input.hidden_states * scale[:, None].to(expert_input.hidden_states.dtype)


def reference_output(sc: Scenario, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, world: int) -> torch.Tensor:
    local = LocalDispatcher(world * sc.num_local_slots)
    expert_input, route = local.dispatch(x, ids, w)
    return local.combine(expert_fn(expert_input, 0), route)


def expected_bytes(sc: Scenario, inputs: list, rank: int, backend: str) -> dict[str, int]:
    row_bytes = sc.hidden * torch.empty((), dtype=sc.dtype).element_size()
    world = len(inputs)
    if backend == "padded":  # every row of the other ranks' blocks, padding too; the dispatch's int64 slot ids
        capacity = max(sc.tokens) * min(sc.top_k, sc.num_local_slots)
        padded = (world - 1) * capacity * row_bytes
        return {"dispatch": padded + (world - 1) * capacity * 8, "combine": padded}
    dest = [ids // sc.num_local_slots for _, ids, _ in inputs]
    sent = int((dest[rank] != rank).sum())
    received = sum(int((d == rank).sum()) for src, d in enumerate(dest) if src != rank)
    return {"dispatch": sent * row_bytes, "combine": received * row_bytes}


def check_expert_input(sc: Scenario, expert_input: ExpertInput, inputs: list, rank: int) -> None:
    rows, counts = expected_rows(sc, inputs, rank)
    assert expert_input.num_tokens_per_expert.device.type == "cpu"
    assert expert_input.num_tokens_per_expert.dtype == torch.int64
    assert expert_input.num_tokens_per_expert.tolist() == counts
    assert expert_input.counts_list() == tuple(counts)
    total = sum(counts)
    assert torch.equal(expert_input.hidden_states[:total], rows)
    assert not expert_input.hidden_states[total:].any()  # a fixed-shape backend's padding rows: zeros


def run_layer(disp: Dispatcher, sc: Scenario, world: int, rank: int) -> None:
    """One dispatch + experts + combine, checked on the way."""
    inputs = sc.inputs(world)
    x, ids, w = inputs[rank]
    disp.begin_step(max(sc.tokens))
    disp.reset_stats()
    expert_input, route = disp.dispatch(x, ids, w)
    check_expert_input(sc, expert_input, inputs, rank)
    out = disp.combine(expert_fn(expert_input, rank * sc.num_local_slots), route)
    torch.testing.assert_close(out, reference_output(sc, x, ids, w, world))
    assert disp.comm_bytes == expected_bytes(sc, inputs, rank, disp.name)


def run_two_in_flight(disp: Dispatcher, a: Scenario, b: Scenario, world: int, rank: int) -> None:
    """Two micro-batches: both sends before either receive; combines received in reverse order."""
    assert a.num_local_slots == b.num_local_slots
    ins = {"a": a.inputs(world), "b": b.inputs(world)}
    scs = {"a": a, "b": b}
    disp.begin_step(max(a.tokens + b.tokens))
    sent = {k: disp.dispatch_send(*ins[k][rank]) for k in ("a", "b")}
    received: dict[str, tuple[ExpertInput, DispatchHandle]] = {k: disp.dispatch_recv(sent[k]) for k in ("a", "b")}
    combining = {}
    for k, (expert_input, route) in received.items():
        check_expert_input(scs[k], expert_input, ins[k], rank)
        combining[k] = disp.combine_send(expert_fn(expert_input, rank * a.num_local_slots), route)
    for k in ("b", "a"):
        out = disp.combine_recv(combining[k])
        torch.testing.assert_close(out, reference_output(scs[k], *ins[k][rank], world))


def check_backend(rank: int, world: int, backend: str) -> int:
    """Every scenario, then two in flight, on one backend; returns how many layers ran."""
    group = dist.group.WORLD
    cases = scenarios(world)
    dispatchers = {slots: BACKENDS[backend](slots, group) for slots in {sc.num_local_slots for sc in cases.values()}}
    if backend == "padded":
        x, ids, w = cases["uneven_k1"].inputs(world)[0]
        with pytest.raises(RuntimeError, match="begin_step"):
            dispatchers[3].dispatch_send(x, ids, w)
        dispatchers[3].begin_step(len(x) - 1)
        with pytest.raises(RuntimeError, match="exceed"):
            dispatchers[3].dispatch_send(x, ids, w)
    for sc in cases.values():
        run_layer(dispatchers[sc.num_local_slots], sc, world, rank)
    run_two_in_flight(dispatchers[2], cases["topk_gt_slots"], cases["bf16"], world, rank)
    run_two_in_flight(dispatchers[2], cases["all_empty"], cases["topk_gt_slots"], world, rank)
    return len(cases) + 4


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_dispatcher_matches_local_reference(backend: str, world_size: int) -> None:
    assert run_ranks(check_backend, world_size, backend) == [len(scenarios(world_size)) + 4] * world_size


def _fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom")
    return rank


def _hang_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def test_run_ranks_reports_the_failing_rank() -> None:
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 failed.*ValueError: boom"):
        run_ranks(_fail_on_rank_1, 2)
    assert not multiprocessing.active_children()


def test_run_ranks_times_out_and_kills_children() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\]|ranks \[0, 1\]"):
        run_ranks(_hang_on_rank_1, 2, timeout=3)
    assert time.monotonic() - start < 30
    assert not multiprocessing.active_children()
