"""Reference-counted pool of KV cache blocks.

A block is *in use* while its reference count is positive. A free block is either *uncached*
(its content is worthless) or *cached* (the prefix cache still maps a hash to it, so a later
request may reuse it). Allocation takes uncached blocks first, then evicts cached ones in LRU
order (least recently freed first), removing their hashes from the prefix cache. Every operation
is O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from epserve.engine.prefix_cache import PrefixCache


class NoFreeBlocks(RuntimeError):
    """Raised by ``BlockPool.allocate`` when fewer blocks are free than asked for."""


class BlockPool:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.prefix_cache = prefix_cache
        self._ref_counts = [0] * num_blocks
        # Ordered sets (values unused): allocation pops from the front, free appends at the back.
        self._free_uncached: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (referenced by at least one request)."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 0

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each); cached ones lose their hash."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocks(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block_id, _ = self._free_uncached.popitem(last=False)
            else:
                block_id, _ = self._free_cached.popitem(last=False)
                if self.prefix_cache is not None:
                    self.prefix_cache.evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a reference to each block (a prefix-cache hit); free ones leave the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if block_id in self._free_cached:
                    del self._free_cached[block_id]
                else:
                    del self._free_uncached[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block, given in a request's order. Blocks that reach zero
        are released last-first, so the tail of a request (least likely to be shared) is evicted
        before its head."""
        for block_id in reversed(block_ids):
            ref = self._ref_counts[block_id]
            if ref <= 0:
                raise ValueError(f"block {block_id} freed more often than it was allocated")
            self._ref_counts[block_id] = ref - 1
            if ref == 1:
                if self.prefix_cache is not None and block_id in self.prefix_cache:
                    self._free_cached[block_id] = None
                else:
                    self._free_uncached[block_id] = None
