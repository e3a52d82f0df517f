"""KV cache bookkeeping for requests: block tables, prefix reuse and caching of full blocks, and the rows of
the device block tables the requests hold (``table_rows``, kept in step with every allocation, trim and free).

Block ``i`` of ``request.block_ids`` holds token positions ``[i * block_size, (i + 1) * block_size)``;
the slot of position ``pos`` is ``block_ids[pos // block_size] * block_size + pos % block_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from epserve.engine.block_pool import BlockPool
from epserve.engine.block_tables import TableRows
from epserve.engine.prefix_cache import PrefixCache, hash_blocks
from epserve.engine.request import Request


class ComputedBlocks(NamedTuple):
    """Prefix-cache hit for a request: cached blocks and the tokens they cover."""

    block_ids: list[int]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, hash_lookahead: int = 0
    ) -> None:
        """``hash_lookahead``: tokens after a block that its prefix-cache hash also covers (1 with an
        MTP draft layer, whose KV at a position depends on the token after it)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hash_lookahead = hash_lookahead
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.block_pool = BlockPool(num_blocks, self.prefix_cache)
        # request_id -> how many leading blocks of the request are already in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.table_rows = TableRows()  # the device tables' rows: what a plan appends, which rows are free

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def num_prefix_query_tokens(self) -> int:
        return self.prefix_cache.num_query_tokens if self.prefix_cache is not None else 0

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self.prefix_cache.num_hit_tokens if self.prefix_cache is not None else 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache.hit_rate if self.prefix_cache is not None else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of a request that has no KV yet, in full blocks and within its
        first ``num_tokens - 1`` tokens (the last token is always computed to produce logits).
        Changes no reference counts: pass the result to ``allocate_slots``."""
        if self.prefix_cache is None or request.num_computed_tokens > 0:
            return ComputedBlocks([], 0)
        self._update_block_hashes(request)
        if request.wants_prompt_logprobs:  # its prompt's logprobs come from computing it: no hit
            return ComputedBlocks([], 0)
        num_matchable = (request.num_tokens - 1) // self.block_size
        block_ids = self.prefix_cache.match_hashes(request.block_hashes[:num_matchable])
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones (and after
        ``new_computed_blocks``, a prefix-cache hit from ``get_computed_blocks``, which is then
        appended to ``request.block_ids``). Returns False and changes nothing if too few blocks
        are free. Does not touch ``request.num_computed_tokens``: the caller advances it."""
        if new_computed_blocks and request.block_ids:
            raise ValueError(f"{request.request_id}: prefix blocks only for a request without blocks")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(request.block_ids) - len(new_computed_blocks)
        # Hit blocks nobody references sit in the free queue; touching them takes them out of it.
        num_evictable_hits = sum(1 for b in new_computed_blocks if self.block_pool.is_free(b))
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return False
        if self.prefix_cache is not None and request.num_computed_tokens == 0 and not request.block_ids:
            # A request's first allocation (again after a preemption): count its prefix lookup once.
            self.prefix_cache.record(request.num_tokens, num_computed)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)  # before allocate, so they cannot be evicted
            request.block_ids.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(new_computed_blocks)
        if num_new_blocks > 0:
            request.block_ids.extend(self.block_pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Insert into the prefix cache every block of the request that is full of computed KV and
        not inserted yet (prompt and output tokens alike). Call after ``num_computed_tokens``
        advanced."""
        if self.prefix_cache is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            # False when another block already holds this content: ours then stays uncached.
            self.prefix_cache.insert(request.block_hashes[i], request.block_ids[i])
        self._num_cached_blocks[request.request_id] = num_full

    def trim(self, request: Request) -> None:
        """Free the request's blocks past those holding its computed tokens (the lookahead a speculative
        step allocated for drafts that were rejected): KV there is rolled back."""
        keep = self.num_blocks_for(request.num_computed_tokens)
        if len(request.block_ids) > keep:
            self.block_pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]
            self.table_rows.truncate(request.request_id, keep)

    def free(self, request: Request) -> None:
        """Release the request's blocks (cached ones stay reusable until evicted)."""
        self.block_pool.free(request.block_ids)
        request.block_ids.clear()
        self._num_cached_blocks.pop(request.request_id, None)
        self.table_rows.release(request.request_id)

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to cover every full block of its known tokens."""
        hashes = request.block_hashes
        num_hashed_tokens = len(hashes) * self.block_size
        if request.num_tokens - num_hashed_tokens >= self.block_size + self.hash_lookahead:
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_blocks(request.all_token_ids[num_hashed_tokens:], self.block_size, parent,
                                      self.hash_lookahead))
