"""The prefix radix tree behind ``cache_aware``: matching, LRU, eviction, instance removal and scaling."""

from __future__ import annotations

import random
import time

import pytest
from router_toys import FakeClock, check_invariants, seq

from epserve.router.radix_tree import PrefixTree


def test_insert_and_exact_match() -> None:
    tree = PrefixTree(clock=FakeClock())
    assert tree.match([1, 2, 3]) == (0, None)
    tree.insert([1, 2, 3, 4, 5], 0)
    assert tree.match([1, 2, 3, 4, 5]) == (5, 0)
    assert tree.match([1, 2, 3, 4, 5, 6, 7]) == (5, 0)
    assert tree.match([9, 1, 2]) == (0, None)
    assert tree.match([]) == (0, None)
    assert tree.size(0) == 5 and tree.size(1) == 0
    assert tree.instances == {0}
    tree.insert([], 1)  # holds nothing
    assert tree.instances == {0}
    check_invariants(tree)


def test_partial_match_splits_edge_and_shared_prefix_diverges() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    tree.insert([1, 2, 3, 4, 5], 0)
    clock.tick()
    tree.insert([1, 2, 3, 7, 8], 1)  # diverges inside the first edge -> split after 3 tokens
    check_invariants(tree)
    assert tree.match([1, 2, 3, 4, 5]) == (5, 0)
    assert tree.match([1, 2, 3, 7, 8]) == (5, 1)
    assert tree.match([1, 2, 3, 4, 9]) == (4, 0)
    assert tree.match_lengths([1, 2, 3, 4, 5]) == {0: 5, 1: 3}
    assert tree.match_lengths([1, 2, 3, 7, 8, 9]) == {0: 3, 1: 5}
    assert tree.match_lengths([1, 2, 9]) == {0: 2, 1: 2}
    assert tree.match_lengths([5]) == {}
    assert tree.size(0) == 5 and tree.size(1) == 5


def test_longest_match_among_many() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    for inst, n in [(2, 6), (0, 2), (1, 4)]:  # the longest one is the least recently used
        clock.tick()
        tree.insert(seq(1, n), inst)
    check_invariants(tree)
    assert tree.match_lengths(seq(1, 10)) == {0: 2, 1: 4, 2: 6}
    assert tree.match(seq(1, 10)) == (6, 2)
    assert tree.match(seq(1, 3) + [99]) == (3, 1)  # 1 and 2 hold 3 tokens; 1 is more recent
    # restricting to some instances gives the longest among those
    assert tree.match(seq(1, 10), instances={0, 1}) == (4, 1)
    assert tree.match(seq(1, 10), instances={0}) == (2, 0)
    assert tree.match(seq(1, 10), instances={7}) == (0, None)


def test_match_on_prefix_shorter_than_edge() -> None:
    tree = PrefixTree(clock=FakeClock())
    tree.insert(seq(1, 10), 0)
    assert tree.match([1, 2, 3]) == (3, 0)
    assert tree.match([1, 2, 3, 99]) == (3, 0)
    assert tree.match_lengths([1, 2, 3, 99]) == {0: 3}
    assert tree.size(0) == 10  # matching does not change what is held
    tree.insert([1, 2, 3], 1)  # a prefix of an existing edge: split, 1 holds only the upper half
    check_invariants(tree)
    assert tree.size(0) == 10 and tree.size(1) == 3
    assert tree.match_lengths(seq(1, 10)) == {0: 10, 1: 3}


def test_lru_decides_among_equal_matches() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    p = seq(100, 50)
    clock.t = 1
    tree.insert(p, 0)
    clock.t = 2
    tree.insert(p, 1)
    assert tree.match(p) == (50, 1)
    clock.t = 3
    tree.insert(p, 0)
    assert tree.match(p + [7]) == (50, 0)
    clock.t = 10
    tree.insert(p, 1)
    clock.t = 10
    tree.insert(p, 0)  # same time -> smallest index
    assert tree.match(p) == (50, 0)
    tree2 = PrefixTree(clock=FakeClock())
    tree2.insert(p, 3)
    tree2.insert(p, 2)
    assert tree2.match(p) == (50, 2)


def test_match_refreshes_lru_but_match_lengths_does_not() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    a, b, c = seq(0, 10), seq(100, 10), seq(200, 10)
    for s in (a, b, c):
        clock.tick()
        tree.insert(s, 0)
    clock.tick()
    assert tree.match(a) == (10, 0)  # a is now the most recent
    assert tree.match_lengths(b) == {0: 10}  # no side effect: b stays the oldest
    assert tree.match(c, touch=False) == (10, 0)  # no side effect either
    assert tree.evict(0, 20) == 10
    assert tree.match(b) == (0, None)
    assert tree.evict(0, 10) == 10
    assert tree.match(c) == (0, None)
    assert tree.match(a) == (10, 0)


def test_eviction_drops_least_recently_used_first() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    a, b, c = seq(0, 100), seq(1000, 100), seq(2000, 100)
    for s in (a, b, c):
        clock.tick()
        tree.insert(s, 0)
    assert tree.size(0) == 300
    assert tree.evict(0, 300) == 0
    assert tree.evict(0, 250) == 100
    assert tree.size(0) == 200
    assert tree.match(a) == (0, None)
    assert tree.match(b) == (100, 0) and tree.match(c) == (100, 0)
    check_invariants(tree)
    with pytest.raises(ValueError, match="max_tokens"):
        tree.evict(0, -1)


def test_eviction_with_shared_prefix_keeps_recent_branch() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    p = seq(0, 50)
    x, y = p + seq(500, 50), p + seq(900, 50)
    clock.t = 1
    tree.insert(x, 0)
    clock.t = 2
    tree.insert(y, 0)
    assert tree.size(0) == 150
    assert tree.evict(0, 120) == 50  # the older branch goes; the shared prefix stays (not a leaf)
    assert tree.size(0) == 100 <= 120
    assert tree.match(y) == (100, 0)
    assert tree.match(x) == (50, 0)
    check_invariants(tree)
    assert tree.evict(0, 10) == 100  # leaf y, then the prefix once it became a leaf
    assert tree.size(0) == 0 and tree.instances == set()
    assert tree.match(y) == (0, None)
    assert tree._root.children == {}
    check_invariants(tree)


def test_eviction_of_one_instance_leaves_others_intact() -> None:
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    p = seq(0, 100)
    tree.insert(p, 0)
    tree.insert(p[:60] + seq(700, 40), 1)
    clock.tick()
    tree.insert(seq(5000, 30), 0)
    assert tree.evict(0, 30) == 100
    assert tree.size(0) == 30 and tree.size(1) == 100
    assert tree.match_lengths(p) == {1: 60}
    assert tree.match(seq(5000, 30)) == (30, 0)
    check_invariants(tree)


def test_remove_instance() -> None:
    tree = PrefixTree(clock=FakeClock())
    p = seq(0, 100)
    tree.insert(p, 0)
    tree.insert(p[:40] + [-1, -2], 1)
    tree.insert(seq(3000, 10), 0)
    tree.remove_instance(0)
    assert tree.size(0) == 0 and tree.instances == {1}
    assert tree.match_lengths(p) == {1: 40}
    assert tree.match(seq(3000, 10)) == (0, None)
    check_invariants(tree)
    tree.remove_instance(5)  # unknown: no-op
    tree.insert(p, 0)
    assert tree.match_lengths(p) == {0: 100, 1: 40}
    check_invariants(tree)


def test_random_against_brute_force() -> None:
    rng = random.Random(0)
    clock = FakeClock()
    tree = PrefixTree(clock=clock)
    held: dict[int, list[tuple[int, ...]]] = {0: [], 1: [], 2: []}

    def lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        for u, v in zip(a, b):
            if u != v:
                break
            n += 1
        return n

    def rand_seq() -> tuple[int, ...]:
        return tuple(rng.randrange(3) for _ in range(rng.randrange(0, 12)))

    for step in range(400):
        clock.tick()
        s, inst = rand_seq(), rng.randrange(3)
        tree.insert(s, inst)
        held[inst].append(s)
        q = rand_seq()
        expect = {i: max((lcp(q, h) for h in hs), default=0) for i, hs in held.items()}
        expect = {i: n for i, n in expect.items() if n}
        assert tree.match_lengths(q) == expect
        for i in range(3):
            assert tree.match(q, instances={i}, touch=False) == (expect.get(i, 0), i if i in expect else None)
            prefixes = {h[:k] for h in held[i] for k in range(1, len(h) + 1)}
            assert tree.size(i) == len(prefixes)
        if step % 50 == 49:
            check_invariants(tree)
    # random evictions keep the structure sound and respect the bound
    for inst in range(3):
        bound = tree.size(inst) // 2
        tree.evict(inst, bound)
        assert tree.size(inst) <= bound
        check_invariants(tree)


def test_long_prompts_are_linear() -> None:
    tree = PrefixTree()
    shared = seq(0, 2048)
    prompts = [shared + seq(10_000 + 2048 * k, 2048) for k in range(200)]
    start = time.perf_counter()
    for k, p in enumerate(prompts):
        tree.insert(p, k % 4)
        assert tree.match(p)[0] == 4096
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"200 inserts+matches of 4096 tokens took {elapsed:.2f}s"
    assert tree.match_lengths(prompts[0]) == {0: 4096, 1: 2048, 2: 2048, 3: 2048}
    # evicting and removing a big tree is fine too
    tree.evict(0, 3000)
    assert tree.size(0) <= 3000
    tree.remove_instance(1)
    check_invariants(tree)


def test_deep_tree_needs_no_recursion() -> None:
    tree = PrefixTree(clock=FakeClock())
    s = seq(0, 1500)
    tree.insert(s, 0)
    for k in range(1, 1500, 1):  # a branch after every token: a chain of ~1500 nodes
        tree.insert(s[:k] + [-1], 1)
    assert tree.match_lengths(s) == {0: 1500, 1: 1499}
    tree.evict(1, 100)
    assert tree.size(1) <= 100
    tree.remove_instance(0)
    check_invariants(tree)
