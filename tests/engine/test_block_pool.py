from __future__ import annotations

import pytest

from epserve.engine.block_pool import BlockPool, NoFreeBlocks
from epserve.engine.prefix_cache import PrefixCache


def test_allocate_free_and_usage() -> None:
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(set(a + b)) == 5
    assert all(pool.ref_count(x) == 1 for x in a + b)
    assert pool.num_free_blocks == 3
    assert pool.usage == pytest.approx(5 / 8)
    pool.free(a)
    assert pool.num_free_blocks == 6
    pool.free(b)
    assert pool.num_free_blocks == 8 and pool.usage == 0.0


def test_no_free_blocks_leaves_pool_unchanged() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert len(pool.allocate(1)) == 1


def test_refcounts_block_free_only_at_zero() -> None:
    pool = BlockPool(4)
    [x] = pool.allocate(1)
    pool.touch([x])
    assert pool.ref_count(x) == 2
    pool.free([x])
    assert pool.ref_count(x) == 1 and not pool.is_free(x)
    assert pool.num_free_blocks == 3
    pool.free([x])
    assert pool.is_free(x) and pool.num_free_blocks == 4
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([x])


def _cached_pool(num_blocks: int) -> tuple[BlockPool, PrefixCache]:
    cache = PrefixCache()
    return BlockPool(num_blocks, cache), cache


def test_uncached_blocks_evicted_before_cached_and_eviction_drops_hash() -> None:
    pool, cache = _cached_pool(4)
    blocks = pool.allocate(4)
    cache.insert(1000, blocks[0])
    cache.insert(1001, blocks[1])
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    # the two uncached blocks come first, whatever the order
    assert set(pool.allocate(2)) == {blocks[2], blocks[3]}
    assert len(cache) == 2
    [evicted] = pool.allocate(1)
    assert evicted in (blocks[0], blocks[1])
    assert evicted not in cache
    assert len(cache) == 1


def test_cached_blocks_evicted_lru_and_request_tail_first() -> None:
    pool, cache = _cached_pool(6)
    req1 = pool.allocate(3)
    req2 = pool.allocate(3)
    for i, b in enumerate(req1 + req2):
        cache.insert(i, b)
    pool.free(req1)  # freed first: least recently used
    pool.free(req2)
    order = pool.allocate(6)
    # LRU across requests; within a request the tail goes first
    assert order == req1[::-1] + req2[::-1]
    assert len(cache) == 0


def test_touch_takes_cached_block_out_of_the_free_queue() -> None:
    pool, cache = _cached_pool(3)
    blocks = pool.allocate(3)
    cache.insert(7, blocks[0])
    pool.free(blocks)
    pool.touch([blocks[0]])  # a prefix-cache hit revives it
    assert pool.ref_count(blocks[0]) == 1
    assert pool.num_free_blocks == 2
    assert blocks[0] not in pool.allocate(2)
    assert blocks[0] in cache
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_refreed_cached_block_moves_to_lru_tail() -> None:
    pool, cache = _cached_pool(2)
    a, b = pool.allocate(2)
    cache.insert(1, a)
    cache.insert(2, b)
    pool.free([a])
    pool.free([b])
    pool.touch([a])  # a is used again ...
    pool.free([a])  # ... and freed after b, so b is now the least recently used
    assert pool.allocate(1) == [b]
