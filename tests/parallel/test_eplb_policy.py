"""EPLB placement (epserve.eplb): the maps are consistent, hierarchical placements keep groups on one
node, the refined policy is never worse than the published greedy one (and better on skewed loads),
and bad arguments raise ValueError."""

from __future__ import annotations

import pytest
import torch

from epserve.eplb import gpu_loads, greedy_rebalance_experts, imbalance, rebalance_experts

# (num_logical, num_replicas, num_groups, num_nodes, num_gpus)
SHAPES = [
    pytest.param(256, 288, 8, 4, 32, id="v3-256e-32gpu-4node"),
    pytest.param(160, 176, 8, 2, 16, id="uneven-160e-16gpu-2node"),
    pytest.param(64, 72, 8, 1, 8, id="64e-8gpu-1node"),
    pytest.param(96, 120, 3, 2, 6, id="global-3groups-2nodes"),
    pytest.param(256, 288, 1, 4, 32, id="global-1group-4nodes"),
    pytest.param(64, 64, 8, 2, 8, id="no-redundancy"),
]
LAYERS = 4


def _zipf(layers: int, experts: int, exponent: float, seed: int) -> torch.Tensor:
    """Load ``(rank + 1) ** -exponent`` (scaled to 10^4 tokens at rank 0), experts shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(layers)])
    return 1e4 * (ranks + 1.0) ** -exponent


def _loads(kind: str, layers: int, experts: int) -> torch.Tensor:
    if kind == "random":
        return torch.rand(layers, experts, generator=torch.Generator().manual_seed(1)) * 1000
    if kind == "zipf":
        return _zipf(layers, experts, 1.0, seed=2)
    return _zipf(layers, experts, 0.6, seed=3).round().long()  # integer token counts


def _busiest(weight: torch.Tensor, maps: tuple[torch.Tensor, ...], num_gpus: int) -> torch.Tensor:
    return gpu_loads(weight, maps[0], maps[2], num_gpus).amax(dim=1)


def _check_maps(maps: tuple[torch.Tensor, ...], layers: int, num_logical: int, num_replicas: int) -> None:
    phy2log, log2phy, logcnt = maps
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert phy2log.shape == (layers, num_replicas) and logcnt.shape == (layers, num_logical)
    assert log2phy.shape == (layers, num_logical, int(logcnt.max()))
    assert (logcnt >= 1).all() and (logcnt.sum(dim=1) == num_replicas).all()
    for layer in range(layers):
        assert torch.equal(torch.bincount(phy2log[layer], minlength=num_logical), logcnt[layer])
    valid = torch.arange(log2phy.shape[2]) < logcnt[..., None]
    assert (log2phy[~valid] == -1).all()
    for layer in range(layers):  # every physical slot listed exactly once
        assert torch.equal(log2phy[layer][valid[layer]].sort().values, torch.arange(num_replicas))
    owner = phy2log.gather(1, log2phy.clamp_min(0).view(layers, -1)).view_as(log2phy)
    assert torch.equal(owner[valid], torch.arange(num_logical)[:, None].expand_as(log2phy)[valid])


@pytest.mark.parametrize("kind", ["random", "zipf", "counts"])
@pytest.mark.parametrize(("num_logical", "num_replicas", "num_groups", "num_nodes", "num_gpus"), SHAPES)
def test_maps_valid_and_refined_never_worse(kind, num_logical, num_replicas, num_groups, num_nodes, num_gpus):
    weight = _loads(kind, LAYERS, num_logical)
    greedy = greedy_rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    refined = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    for maps in (greedy, refined):
        _check_maps(maps, LAYERS, num_logical, num_replicas)
        loads = gpu_loads(weight, maps[0], maps[2], num_gpus)
        assert loads.shape == (LAYERS, num_gpus)
        assert torch.allclose(loads.sum(dim=1), weight.double().sum(dim=1))
    assert (_busiest(weight, refined, num_gpus) <= _busiest(weight, greedy, num_gpus)).all()


@pytest.mark.parametrize(("num_logical", "num_replicas", "num_groups", "num_nodes", "num_gpus"),
                         [s for s in SHAPES if s.values[2] % s.values[3] == 0])
@pytest.mark.parametrize("policy", [greedy_rebalance_experts, rebalance_experts])
def test_hierarchical_keeps_groups_on_one_node(policy, num_logical, num_replicas, num_groups, num_nodes, num_gpus):
    weight = _zipf(LAYERS, num_logical, 1.0, seed=4)
    phy2log, _, _ = policy(weight, num_replicas, num_groups, num_nodes, num_gpus)
    slot_node = torch.arange(num_replicas) // (num_replicas // num_nodes)
    for layer in range(LAYERS):
        expert_node = torch.full((num_logical,), -1)
        expert_node[phy2log[layer]] = slot_node
        # Every replica of an expert is on one node, and every expert of a group on the same node.
        assert torch.equal(expert_node[phy2log[layer]], slot_node)
        by_group = expert_node.view(num_groups, -1)
        assert (by_group == by_group[:, :1]).all()
        assert (torch.bincount(by_group[:, 0], minlength=num_nodes) == num_groups // num_nodes).all()


def test_refinement_gains_on_skewed_hierarchical_loads():
    weight = _zipf(8, 256, 1.0, seed=5)
    greedy = _busiest(weight, greedy_rebalance_experts(weight, 288, 8, 4, 32), 32)
    refined = _busiest(weight, rebalance_experts(weight, 288, 8, 4, 32), 32)
    assert (refined / greedy).mean() < 0.98


def test_greedy_matches_published_example():
    """DeepSeek EPLB's README example: 12 experts in 4 groups, 16 replicas, 2 nodes, 8 GPUs."""
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, logcnt = greedy_rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    assert log2phy[0, 1].tolist() == [13, 15] and log2phy[0, 0].tolist() == [12, -1]


@pytest.mark.parametrize(("num_logical", "num_replicas", "num_groups", "num_nodes", "num_gpus"), SHAPES)
def test_uniform_loads_balance_perfectly(num_logical, num_replicas, num_groups, num_nodes, num_gpus):
    weight = torch.full((2, num_logical), 7.0)
    maps = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    assert torch.allclose(imbalance(gpu_loads(weight, maps[0], maps[2], num_gpus)), torch.ones(2, dtype=torch.float64))


def test_no_redundancy_is_a_permutation():
    weight = _zipf(LAYERS, 64, 1.0, seed=6)
    for policy in (greedy_rebalance_experts, rebalance_experts):
        phy2log, log2phy, logcnt = policy(weight, 64, 8, 2, 8)
        assert (logcnt == 1).all() and log2phy.shape == (LAYERS, 64, 1)
        assert (phy2log.sort(dim=1).values == torch.arange(64)).all()
        assert torch.equal(phy2log.gather(1, log2phy[..., 0]), torch.arange(64).expand(LAYERS, 64))


def test_global_fallback_is_one_node_one_group():
    """Groups that do not divide over the nodes: the same placement as one node holding one group."""
    weight = _zipf(LAYERS, 96, 1.0, seed=7)
    for policy in (greedy_rebalance_experts, rebalance_experts):
        fallback, single = policy(weight, 120, 3, 2, 6), policy(weight, 120, 1, 1, 6)
        assert all(torch.equal(a, b) for a, b in zip(fallback, single))


def test_deterministic_and_dtype_independent():
    weight = _zipf(LAYERS, 160, 0.8, seed=8).round()
    first = rebalance_experts(weight, 176, 8, 2, 16)
    for again in (weight.clone(), weight.long(), weight.float()):
        assert all(torch.equal(a, b) for a, b in zip(first, rebalance_experts(again, 176, 8, 2, 16)))


def test_zero_load_layer():
    weight = torch.zeros(2, 32)
    weight[1] = torch.arange(32.0)
    maps = rebalance_experts(weight, 40, 4, 2, 4)
    _check_maps(maps, 2, 32, 40)
    assert imbalance(gpu_loads(weight, maps[0], maps[2], 4))[0] == 1.0


def test_imbalance():
    loads = torch.tensor([[1.0, 1.0, 4.0, 2.0], [0.0, 0.0, 0.0, 0.0]])
    assert imbalance(loads).tolist() == [2.0, 1.0]


@pytest.mark.parametrize(("weight", "args", "message"), [
    (torch.ones(16), (16, 1, 1, 4), "2-D"),
    (torch.ones(2, 4, 16), (16, 1, 1, 4), "2-D"),
    (torch.ones(2, 0), (16, 1, 1, 4), "no layers or no experts"),
    (torch.ones(2, 16), (8, 1, 1, 4), "less than the number of logical experts"),
    (torch.ones(2, 16), (18, 1, 1, 4), "not divisible by num_gpus"),
    (torch.ones(2, 16), (18, 1, 4, 6), "num_gpus \\(6\\) is not divisible by num_nodes"),
    (torch.ones(2, 16), (16, 6, 2, 4), "num_groups \\(6\\) does not divide"),
    (torch.ones(2, 16), (16, 1, 1, 0), "num_gpus must be a positive int"),
    (-torch.ones(2, 16), (16, 1, 1, 4), "negative"),
    (torch.full((2, 16), float("nan")), (16, 1, 1, 4), "NaN"),
])
def test_bad_arguments_raise(weight, args, message):
    for policy in (greedy_rebalance_experts, rebalance_experts):
        with pytest.raises(ValueError, match=message):
            policy(weight, *args)
