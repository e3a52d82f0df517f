"""Expert load balancing in the engine: replicas take tokens, placements are relabelled to move the
fewest experts, weights move between ranks by point-to-point transfers, and a rebalance (manual or
every few steps while generating) never changes a token."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from dist_harness import run_ranks

from epserve import LLM, SamplingParams
from epserve.config import ConfigError, EplbConfig
from epserve.moe.placement import ExpertPlacement, select_replicas
from epserve.moe.rebalance import align_placement, move_expert_weights, plan_moves

PROMPTS = [[i + 1, i * 3 % 50 + 2, 7, 9, 11 + i] for i in range(6)]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=1)
ENGINE = {"dtype": "float32", "num_blocks": 64}


def outputs(llm: LLM, prompts: list[list[int]] = PROMPTS, max_tokens: int = 10) -> list[list[tuple[int, float]]]:
    """Each request's greedy (token, logprob) pairs: the skewed model's logit margins keep greedy tokens
    even through a wrong expert, so the logprobs are what would show one."""
    params = replace(GREEDY, max_tokens=max_tokens)
    return [[(t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs)] for o in llm.generate(prompts, params)]


def assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert max(abs(a - b) for (_, a), (_, b) in zip(g, w)) < 1e-4


@pytest.fixture(scope="module")
def reference(skewed_ckpt):
    return outputs(LLM(skewed_ckpt, **ENGINE))


def test_replica_tables_position_and_local():
    p = ExpertPlacement.build(4, ep_size=2, num_redundant=2, ranks_per_node=1)  # slots 0 1 2 | 3 0 1
    table, count = p.replica_table(0)
    assert count.tolist() == [2, 2, 1, 1] and table[0].tolist() == [0, 4, 0] and table[3].tolist() == [3, 3, 3]
    local = replace(p, selection="local")
    table, count = local.replica_table(0)
    assert count.tolist() == [1, 1, 1, 1] and table[:, 0].tolist() == [0, 1, 2, 3]  # 3 lives on rank 1 only
    table, count = local.replica_table(1)
    assert table[:, 0].tolist() == [4, 5, 2, 3]
    # two ranks per node: expert 2 sits on rank 1 (node 0) and rank 3 (node 1)
    nodes = ExpertPlacement(4, 4, (0, 1, 2, 3, 0, 1, 2, 3), "local", ranks_per_node=2)
    table, count = nodes.replica_table(0)
    assert table[2, 0].item() == 2 and count[2].item() == 1 and count[0].item() == 1
    with pytest.raises(ValueError, match="at least once"):
        ExpertPlacement(4, 2, (0, 1, 1, 2))


def test_select_replicas_spreads_tokens_evenly():
    p = ExpertPlacement(2, 2, (0, 0, 0, 1))  # expert 0: three replicas
    table, count = p.replica_table(0)
    ids = torch.zeros(12, 1, dtype=torch.long)
    for offset in range(3):
        slots = select_replicas(ids, table, count, offset).flatten()
        assert torch.bincount(slots, minlength=4).tolist() == [4, 4, 4, 0]
        assert slots[0].item() == offset  # row t takes replica (t + offset) mod 3
    assert select_replicas(torch.ones(5, 1, dtype=torch.long), table, count, 1).flatten().tolist() == [3] * 5


def test_align_keeps_what_stays_and_moves_only_what_changes_rank():
    old = ExpertPlacement.build(4, 2, 2)  # 0 1 2 | 3 0 1
    assert align_placement(old, (3, 0, 1, 0, 1, 2)) == old  # the same rank sets, swapped: nothing moves
    new = align_placement(old, (0, 0, 1, 2, 3, 0))
    assert sorted(map(sorted, (new.physical_to_logical[:3], new.physical_to_logical[3:]))) == [[0, 0, 1], [0, 2, 3]]
    moves = plan_moves(old, new)
    assert len(moves) == 1  # a second copy of 0 is made from the copy its rank holds
    for m in moves:
        assert old.physical_to_logical[m.src] == m.logical == new.physical_to_logical[m.dst]
        assert m.logical not in old.local_logical_experts(new.rank_of(m.dst))
    for slot, (a, b) in enumerate(zip(old.physical_to_logical, new.physical_to_logical)):
        if a in new.local_logical_experts(new.rank_of(slot)):
            assert a == b or old.physical_to_logical.count(a) > 1  # an expert that stays keeps its slot


def _random_slots(rng: random.Random, experts: int, slots: int) -> tuple[int, ...]:
    extra = [rng.randrange(experts) for _ in range(slots - experts)]
    out = list(range(experts)) + extra
    rng.shuffle(out)
    return tuple(out)


def _move_on_ranks(rank: int, world: int, seed: int) -> list[bool]:
    rng = random.Random(seed)
    ok = []
    old = ExpertPlacement.build(6, world, 4 * world - 6)
    for _ in range(4):
        new = align_placement(old, _random_slots(rng, 6, 4 * world))
        # each slot's rows hold its logical expert id (a 3-D and a 2-D tensor, like w13 and a scale)
        w = torch.tensor(old.local_logical_experts(rank), dtype=torch.float32)
        tensors = [w[:, None, None].repeat(1, 2, 3).contiguous(), w[:, None].repeat(1, 5).contiguous()]
        moves = plan_moves(old, new)
        received = move_expert_weights(tensors, old, new, moves, rank, None)
        want = torch.tensor(new.local_logical_experts(rank), dtype=torch.float32)
        incoming = sum(new.rank_of(m.dst) == rank for m in moves)
        ok.append(bool(torch.equal(tensors[0][:, 0, 0], want) and torch.equal(tensors[1][:, 0], want)
                       and received == incoming * (6 + 5) * 4))
        old = new
    return ok


def test_weights_move_between_ranks():
    assert run_ranks(_move_on_ranks, 2, 7) == [[True] * 4] * 2


def test_eplb_config_is_checked(tiny_ckpt):
    with pytest.raises(ConfigError, match="window_size must be a positive integer"):
        EplbConfig(window_size=0)
    with pytest.raises(ConfigError, match="unknown replica selection"):
        EplbConfig(replica_selection="nearest")
    with pytest.raises(ConfigError, match="does not divide the 17 routed experts"):
        LLM(tiny_ckpt, dp=2, num_redundant_experts=1)


def test_rebalance_in_one_process_keeps_tokens(skewed_ckpt, reference):
    llm = LLM(skewed_ckpt, num_redundant_experts=4, **ENGINE)
    assert_same(outputs(llm), reference)
    per_expert = torch.tensor(llm.expert_load().per_expert)
    assert (per_expert[:, 4:6].min(dim=1).values > 3 * per_expert.float().mean(dim=1)).all()  # the skew is real
    report = llm.rebalance_experts()
    assert report.layers_changed == 2 and report.bytes_moved == 0  # one rank: slots copied locally
    moes = llm.engine.runner.model.moe_layers()
    for moe in moes.values():
        assert moe.replica_count[4:6].min() >= 2  # the hot experts got the redundant slots
    llm.reset_expert_load()
    assert sum(map(sum, llm.expert_load().per_expert)) == 0
    assert_same(outputs(llm), reference)
    assert torch.equal(torch.tensor(llm.expert_load().per_expert), per_expert)  # routing itself never changes


def test_online_rebalancing_while_generating(skewed_ckpt, reference):
    """Every 2 steps over a 3-step window: placements change between steps of running requests."""
    llm = LLM(skewed_ckpt, num_redundant_experts=4, enable_eplb=True, eplb_window_size=3, eplb_step_interval=2,
              **ENGINE)
    assert_same(outputs(llm), reference)
    balancer = llm.engine.runner.balancer
    assert balancer.num_rebalances >= 4
    for moe in balancer.moes.values():  # the window's hot experts hold the redundant slots now
        assert moe.placement.physical_to_logical != ExpertPlacement.build(16, 1, 4).physical_to_logical
        assert moe.replica_count[4:6].min() >= 2


def test_rebalancing_reaches_the_captured_decode(skewed_ckpt, reference, device, monkeypatch):
    """Captured decode steps (CUDA graphs on a GPU; on the CPU the same fullgraph trace, without inductor's
    code generation) read the routing tables and expert weights a rebalance rewrote in place: were either
    a stale copy, the weights moved between slots would meet the old routing and the tokens would change."""
    if device == "cpu":
        monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")
    capture = {"compile": True} if device == "cpu" else {}
    llm = LLM(skewed_ckpt, device=device, num_redundant_experts=4, enable_eplb=True, eplb_window_size=2,
              eplb_step_interval=3, max_num_seqs=2, **capture, **ENGINE)
    assert llm.engine.runner.decode_graphs is not None
    assert_same(outputs(llm), reference)
    assert llm.engine.runner.balancer.num_rebalances >= 3


def test_fp8_experts_move_with_their_scales(make_ckpt):
    """FP8 weights and their tile scales move together (as bytes): the same logprobs after a rebalance."""
    path = make_ckpt("tiny128", fp8=True, dtype="bfloat16", hot_experts={4: 1.0, 5: 1.0}, logit_margin=4.0)
    kw = {"quantization": "fp8", "num_blocks": 64}
    want = outputs(LLM(path, **kw), PROMPTS[:3], 6)
    llm = LLM(path, num_redundant_experts=4, **kw)
    outputs(llm, PROMPTS[:3], 6)
    assert llm.rebalance_experts().layers_changed > 0
    assert_same(outputs(llm, PROMPTS[:3], 6), want)
