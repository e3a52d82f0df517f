from __future__ import annotations

import os
import subprocess
import sys

import pytest

from epserve.engine.kv_manager import KVCacheManager
from epserve.engine.prefix_cache import PrefixCache, hash_block, hash_blocks
from epserve.engine.request import Request

# Pinned so that a change of the hash scheme (which routers in other processes rely on) is noticed.
GOLDEN_FIRST_BLOCK_HASH = 271677808810002820983984690818173812495


def test_hash_is_pinned_and_chained() -> None:
    assert hash_block(None, (1, 2, 3, 4)) == GOLDEN_FIRST_BLOCK_HASH
    h0 = hash_block(None, (1, 2, 3, 4))
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, hash_block(h0, (5, 6, 7, 8))]
    # the same tokens under another parent are another block
    assert hash_block(h0, (1, 2, 3, 4)) != h0
    assert hash_block(0, (1, 2, 3, 4)) != h0


def test_same_prefix_same_hashes_and_earlier_change_changes_all_later() -> None:
    a = list(range(100, 140))
    b = a[:32] + [7] * 8
    ha, hb = hash_blocks(a, 8), hash_blocks(b, 8)
    assert len(ha) == 5
    assert ha[:4] == hb[:4] and ha[4] != hb[4]
    c = a.copy()
    c[3] += 1  # a change in block 0 ...
    hc = hash_blocks(c, 8)
    assert all(x != y for x, y in zip(ha, hc))  # ... changes every later hash


def test_hashes_stable_across_processes() -> None:
    tokens = list(range(1000, 1064))
    code = f"from epserve.engine.prefix_cache import hash_blocks;print(hash_blocks({tokens!r}, 16))"
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outs.append(res.stdout.strip())
    assert outs[0] == outs[1] == str(hash_blocks(tokens, 16))


def test_match_stops_at_first_miss_and_ignores_partial_blocks() -> None:
    cache = PrefixCache()
    tokens = list(range(20))
    h = hash_blocks(tokens, 4)  # 5 full blocks
    cache.insert(h[0], 10)
    cache.insert(h[1], 11)
    cache.insert(h[3], 13)  # not reachable: block 2 is missing
    assert cache.match(tokens, 4) == [10, 11]
    assert cache.match(tokens[:7], 4) == [10]  # the partial second block never matches
    assert cache.match([99] + tokens[1:], 4) == []


def test_insert_evict() -> None:
    cache = PrefixCache()
    assert cache.insert(5, 1)
    assert not cache.insert(5, 2)  # content already held by block 1
    assert not cache.insert(6, 1)  # block 1 already holds other content
    assert cache.block_hash(1) == 5 and 2 not in cache
    assert cache.evict(1)
    assert not cache.evict(1)
    assert cache.match_hashes([5]) == []
    assert cache.insert(5, 2)


def _computed(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """Pretend the runner computed the next ``num_tokens`` tokens of the request."""
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request)


def test_kv_manager_never_matches_the_last_token() -> None:
    m = KVCacheManager(num_blocks=16, block_size=16)
    first = Request("a", range(40))
    _computed(m, first, 40)
    assert len(m.prefix_cache) == 2  # only the two full blocks
    exact = Request("b", range(32))  # all 32 tokens cached, but the last must be computed
    assert m.get_computed_blocks(exact) == (first.block_ids[:1], 16)
    longer = Request("c", range(33))
    block_ids, num_tokens = m.get_computed_blocks(longer)
    assert block_ids == first.block_ids[:2] and num_tokens == 32
    other = Request("d", [1000] + list(range(1, 40)))
    assert m.get_computed_blocks(other) == ([], 0)


def test_kv_manager_shares_hit_blocks_and_frees_everything() -> None:
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = Request("a", range(10))
    _computed(m, a, 10)
    b = Request("b", list(range(8)) + [50, 51, 52])
    hit = m.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert m.allocate_slots(b, b.num_tokens - hit.num_tokens, hit.block_ids)
    b.num_computed_tokens = b.num_tokens
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert m.block_pool.ref_count(a.block_ids[0]) == 2
    assert m.num_prefix_hit_tokens == 8 and m.num_prefix_query_tokens == 10 + 11
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 8 and a.block_ids == [] and b.block_ids == []


def test_allocate_slots_failure_changes_nothing_and_hits_are_not_self_evicted() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = Request("a", range(9))
    _computed(m, a, 9)  # 3 blocks, 2 of them cached
    m.free(a)  # all free; the 2 cached ones are evictable
    b = Request("b", list(range(8)) + list(range(100, 110)))  # 18 tokens: 5 blocks > 4
    hit = m.get_computed_blocks(b)
    assert hit.num_tokens == 8
    assert not m.allocate_slots(b, 10, hit.block_ids)
    assert b.block_ids == [] and m.num_free_blocks == 4 and len(m.prefix_cache) == 2
    c = Request("c", list(range(8)) + list(range(100, 106)))  # 14 tokens: 4 blocks, 2 of them hits
    hit = m.get_computed_blocks(c)
    assert m.allocate_slots(c, 6, hit.block_ids)
    assert c.block_ids[:2] == hit.block_ids  # allocating the other two did not evict the hits
    assert len(set(c.block_ids)) == 4 and m.num_free_blocks == 0
    assert len(m.prefix_cache) == 2


def test_prefix_caching_disabled() -> None:
    m = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = Request("a", range(9))
    _computed(m, a, 9)
    assert m.get_computed_blocks(Request("b", range(9))) == ([], 0)
    assert m.prefix_hit_rate == 0.0


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_slot_layout(block_size: int) -> None:
    m = KVCacheManager(num_blocks=64, block_size=block_size)
    r = Request("r", range(37))
    assert m.allocate_slots(r, 37)
    assert len(r.block_ids) == -(-37 // block_size)
    slots = {r.block_ids[p // block_size] * block_size + p % block_size for p in range(37)}
    assert len(slots) == 37  # distinct slot per position


def test_incremental_request_hashes_equal_hashes_from_scratch() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4)
    r = Request("r", range(100, 106))
    _computed(m, r, 6)
    for t in range(20, 31):  # decode: one output token at a time
        r.append_output_token(t)
        _computed(m, r, 1)
    assert r.block_hashes == hash_blocks(r.all_token_ids, 4)  # what a router would compute
    assert len(m.prefix_cache) == r.num_computed_tokens // 4
    assert m.prefix_cache.match(r.all_token_ids, 4) == r.block_ids[: r.num_computed_tokens // 4]
