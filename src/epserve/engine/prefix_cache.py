"""Prefix cache keyed by chained hashes of full KV blocks.

Block ``i`` of a sequence is identified by ``hash_block(hash of block i - 1, its token ids)``, so a
hash names the whole prefix up to the end of that block. Hashes are blake2b digests of a packed,
little-endian representation: the same in every process and on every host, which lets a router
compute them without asking an engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# 128 bits: a collision would silently serve another prefix's KV, so leave no practical chance.
HASH_DIGEST_SIZE = 16
_ROOT = b"\x00"
_CHILD = b"\x01"


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash one block's tokens chained to the hash of the block before it (None for the first)."""
    h = hashlib.blake2b(digest_size=HASH_DIGEST_SIZE)
    if parent_hash is None:
        h.update(_ROOT)
    else:
        h.update(_CHILD)
        h.update(parent_hash.to_bytes(HASH_DIGEST_SIZE, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int | None = None, lookahead: int = 0
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``, the first chained to ``parent_hash``
    (None at the start of a sequence). A trailing partial block gets no hash. ``lookahead``: each
    block's hash also covers that many tokens after it, and a block gets a hash only once they are
    known (an MTP layer's KV at a block's last position depends on the next token)."""
    hashes: list[int] = []
    for i in range((len(token_ids) - lookahead) // block_size):
        parent_hash = hash_block(parent_hash, token_ids[i * block_size : (i + 1) * block_size + lookahead])
        hashes.append(parent_hash)
    return hashes


class PrefixCache:
    """Maps block hashes to the block ids that hold that content, one block per hash.

    ``num_query_tokens`` / ``num_hit_tokens`` count lookups that the owner chose to record (see
    ``record``), so that a lookup retried while a request waits for blocks is not counted twice.
    """

    def __init__(self) -> None:
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    def __len__(self) -> int:
        return len(self._hash_to_block)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._block_to_hash

    def block_hash(self, block_id: int) -> int | None:
        return self._block_to_hash.get(block_id)

    def match(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """Block ids of the longest chain of cached full blocks that prefixes ``token_ids``."""
        return self.match_hashes(hash_blocks(token_ids, block_size))

    def match_hashes(self, block_hashes: Sequence[int]) -> list[int]:
        """Like ``match`` for precomputed chained hashes; stops at the first miss."""
        block_ids: list[int] = []
        for h in block_hashes:
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def insert(self, block_hash: int, block_id: int) -> bool:
        """Record that ``block_id`` holds the block named ``block_hash``. Returns False (and changes
        nothing) if another block already holds that content or ``block_id`` is already cached."""
        if block_hash in self._hash_to_block or block_id in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def evict(self, block_id: int) -> bool:
        """Forget ``block_id``'s content (it is about to be overwritten). False if it was not cached."""
        block_hash = self._block_to_hash.pop(block_id, None)
        if block_hash is None:
            return False
        del self._hash_to_block[block_hash]
        return True

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def reset_stats(self) -> None:
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
