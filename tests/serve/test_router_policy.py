"""Router policies: round robin, least load, and ``cache_aware`` over the prefix radix tree."""

from __future__ import annotations

import random

import pytest
from router_toys import FakeClock, check_invariants, seq

from epserve.router.policy import (
    POLICIES,
    CacheAwarePolicy,
    LeastLoadPolicy,
    NoInstanceError,
    RoundRobinPolicy,
    make_policy,
)


def test_round_robin_cycles_and_skips_missing() -> None:
    rr = RoundRobinPolicy()
    all3 = {0: 0, 1: 0, 2: 0}
    assert [rr.choose([1], all3) for _ in range(4)] == [0, 1, 2, 0]
    assert rr.choose([1], {0: 0, 2: 0}) == 2  # 1 is down
    assert rr.choose([1], {0: 0, 2: 0}) == 0
    assert rr.choose([1], {1: 9}) == 1
    assert rr.choose([1], {0: 0, 1: 0, 2: 0, 3: 0}) == 2
    assert rr.choose([1], {0: 0, 1: 0, 2: 0, 3: 0}) == 3
    assert rr.choose([1], {0: 0, 1: 0, 2: 0, 3: 0}) == 0


def test_least_load() -> None:
    ll = LeastLoadPolicy()
    assert ll.choose([1, 2], {0: 3, 1: 1, 2: 1}) == 1
    assert ll.choose([1, 2], {5: 0, 2: 0}) == 2
    assert ll.choose([], {4: 7}) == 4


@pytest.mark.parametrize("name", POLICIES)
def test_no_instance_error(name: str) -> None:
    with pytest.raises(NoInstanceError):
        make_policy(name).choose([1, 2, 3], {})


def cached_on_zero(prompt: list[int], **kw: object) -> CacheAwarePolicy:
    """A cache_aware policy whose tree says instance 0 has ``prompt`` cached."""
    clock = FakeClock()
    pol = CacheAwarePolicy(clock=clock, **kw)  # type: ignore[arg-type]
    assert pol.choose(prompt, {0: 0, 1: 0, 2: 0}) == 0
    clock.tick()
    return pol


def test_cache_aware_routes_shared_prefix_to_same_instance() -> None:
    a = seq(0, 100)
    pol = cached_on_zero(a)
    assert pol.last_decision == "least_load"
    assert pol.choose(a + seq(7000, 20), {0: 5, 1: 0, 2: 0}) == 0  # match 100/120 beats load
    assert pol.last_decision == "cache_hit"
    assert pol.choose(seq(9000, 50), {0: 5, 1: 0, 2: 0}) == 1  # no match -> least loaded
    assert pol.last_decision == "least_load"
    assert pol.choose(seq(9000, 30) + [1], {0: 0, 1: 5, 2: 4}) == 1  # follows its own earlier routing
    assert pol.last_decision == "cache_hit"


def test_cache_aware_threshold_is_strict() -> None:
    a = seq(0, 100)
    pol = cached_on_zero(a, cache_threshold=0.3)
    loads = {0: 5, 1: 0, 2: 0}
    assert pol.choose(a[:30] + seq(5000, 70), loads) == 1  # 30/100 is not > 0.3
    assert pol.last_decision == "least_load"
    assert pol.choose(a[:31] + seq(6000, 69), loads) == 0  # 31/100 is
    assert pol.last_decision == "cache_hit"
    pol0 = cached_on_zero(a, cache_threshold=0.0)
    assert pol0.choose(a[:1] + seq(5000, 99), loads) == 0
    pol1 = cached_on_zero(a, cache_threshold=1.0)
    assert pol1.choose(a, loads) == 1  # a full match is not > 1.0: always least loaded
    assert pol1.choose([], loads) == 1


@pytest.mark.parametrize(
    ("loads", "expect", "decision"),
    [
        ({0: 40, 1: 5}, 1, "imbalanced"),  # 35 > 32 and 40 > 1.5 * 5
        ({0: 100, 1: 60}, 1, "imbalanced"),  # 40 > 32 and 100 > 90
        ({0: 100, 1: 67}, 0, "cache_hit"),  # 33 > 32 but 100 <= 100.5: abs alone does not trigger
        ({0: 10, 1: 1}, 0, "cache_hit"),  # 10 > 1.5 but 9 <= 32: rel alone does not trigger
        ({0: 33, 1: 1}, 0, "cache_hit"),  # 32 is not > 32
        ({0: 33, 1: 0}, 1, "imbalanced"),
    ],
)
def test_cache_aware_imbalance_needs_both_thresholds(
    loads: dict[int, int], expect: int, decision: str
) -> None:
    a = seq(0, 100)
    pol = cached_on_zero(a, balance_abs_threshold=32, balance_rel_threshold=1.5)
    assert pol.choose(a, loads) == expect
    assert pol.last_decision == decision


def test_cache_aware_ties_go_to_most_recent_healthy_instance() -> None:
    clock = FakeClock()
    pol = CacheAwarePolicy(clock=clock)
    a = seq(0, 100)
    pol.tree.insert(a, 0)
    clock.tick()
    pol.tree.insert(a, 2)
    clock.tick()
    assert pol.choose(a, {0: 3, 1: 0, 2: 3}) == 2
    assert pol.choose(a, {0: 3, 1: 0}) == 0  # 2 is down: the next best healthy holder
    assert pol.last_decision == "cache_hit"


def test_cache_aware_never_picks_unhealthy_instance() -> None:
    a = seq(0, 100)
    pol = cached_on_zero(a)
    assert pol.choose(a, {1: 3, 2: 0}) == 2  # 0 has the match but is down
    assert pol.last_decision == "least_load"
    pol.tree.insert(a[:50], 1)
    assert pol.choose(a, {1: 3, 2: 0, 3: 0}) == 2  # 2 now holds all of a (routed there above)
    assert pol.choose(a, {1: 3, 3: 0}) == 1  # 1's partial match (50%) is the best healthy one
    assert pol.last_decision == "cache_hit"


def test_cache_aware_forget_drops_prefixes() -> None:
    a = seq(0, 100)
    pol = cached_on_zero(a)
    pol.forget(0)
    assert pol.tree.size(0) == 0
    assert pol.choose(a, {0: 5, 1: 0}) == 1
    assert pol.last_decision == "least_load"
    LeastLoadPolicy().forget(0)  # the default is a no-op
    RoundRobinPolicy().forget(0)


def test_cache_aware_respects_tree_bound() -> None:
    clock = FakeClock()
    pol = CacheAwarePolicy(clock=clock, max_tree_tokens=1000)
    prompts = [seq(100_000 * k, 100) for k in range(30)]
    for p in prompts:
        clock.tick()
        assert pol.choose(p, {0: 0}) == 0
        assert pol.tree.size(0) <= 1000
    assert pol.tree.match(prompts[-1]) == (100, 0)
    assert pol.tree.match(prompts[0]) == (0, None)  # the oldest went first
    check_invariants(pol.tree)


def test_cache_aware_is_deterministic() -> None:
    rng = random.Random(1)
    requests = [
        ([rng.randrange(4) for _ in range(rng.randrange(1, 40))], {i: rng.randrange(50) for i in range(4)})
        for _ in range(200)
    ]

    def run() -> list[int]:
        clock = FakeClock()
        pol = CacheAwarePolicy(clock=clock, max_tree_tokens=200)
        out = []
        for toks, loads in requests:
            clock.tick()
            out.append(pol.choose(toks, loads))
            assert out[-1] in loads
        return out

    assert run() == run()


def test_make_policy() -> None:
    assert POLICIES == ("cache_aware", "round_robin", "least_load")
    for name in POLICIES:
        assert make_policy(name).name == name
    assert isinstance(make_policy("round_robin", cache_threshold=0.9), RoundRobinPolicy)  # kwargs ignored
    pol = make_policy("cache_aware", cache_threshold=0.5, max_tree_tokens=64)
    assert isinstance(pol, CacheAwarePolicy)
    assert pol.cache_threshold == 0.5 and pol.max_tree_tokens == 64
    with pytest.raises(ValueError, match="cache_aware.*round_robin.*least_load"):
        make_policy("random")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"cache_threshold": -0.1}, "cache_threshold"),
        ({"cache_threshold": 1.5}, "cache_threshold"),
        ({"cache_threshold": float("nan")}, "cache_threshold"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"balance_rel_threshold": 0.9}, "balance_rel_threshold"),
        ({"max_tree_tokens": 0}, "max_tree_tokens"),
    ],
)
def test_cache_aware_validates_arguments(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_policy("cache_aware", **kwargs)
