"""Prefill/decode disaggregation inside one engine: the requests whose prompt KV crosses instances.

- **Decode side** (``Request.kv_transfer == "receive"``): the prompt's latent KV comes from a prefill
  instance. The scheduler first allocates the request's blocks (reusing this instance's own
  prefix-cache hit, so only the missing blocks travel): a request that finds too few free blocks
  waits, first in first out, and is never dropped. Once allocated it waits for its KV
  (:class:`KVWanted` tells the transfer side which blocks to fetch); when the KV and the prefill's
  first token arrive, the engine writes the blocks (on every TP rank, inside a step) and the request
  decodes like any other.
- **Prefill side** (``Request.kv_transfer == "send"``): a prompt prefilled for a decode instance; it
  finishes after its first token, and its blocks are *held*, not freed, until the engine has copied
  them out (:class:`PrefilledKV`).

Blocks travel as the cache stores them (bytes of every cached layer, the MTP layer's included;
FP8 as stored), so a block is ``layers x block_size x token bytes`` whatever either side's layout.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from epserve.engine.kv_manager import KVCacheManager
from epserve.engine.request import Request, RequestStatus

KVTransferRole = Literal["send", "receive"]


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on for blocks to be copied as bytes."""

    num_layers: int  # cached layers (an MTP draft layer included)
    block_size: int  # tokens per block
    token_bytes: int  # bytes of one token in one layer
    dtype: str  # the cache's element type (``bfloat16``, ``float32``, ``fp8_e4m3``, ...)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.block_size * self.token_bytes

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks of ``other`` cannot be written into this layout (None: they can)."""
        if other == self:
            return None
        return (f"KV layouts differ: {other.num_layers} layers x {other.block_size}-token blocks of "
                f"{other.token_bytes} bytes ({other.dtype}) vs {self.num_layers} x {self.block_size} of "
                f"{self.token_bytes} ({self.dtype})")


@dataclass(frozen=True)
class KVWanted:
    """Decode side: blocks ``[first_block, first_block + num_blocks)`` of the request are allocated and
    wait for their KV (blocks before ``first_block`` are this instance's own prefix-cache hit)."""

    request_id: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class PrefilledKV:
    """A finished prefill's KV and the first token it sampled: copied out of the prefill instance's
    cache (``LLMEngine.export_kv``, its request id) and handed to the decode instance
    (``LLMEngine.receive_kv``, the decode side's id). ``data``: uint8 ``[layers, blocks, block_size,
    token_bytes]``, on the host, of the request's blocks from ``first_block`` on (those of its
    :class:`KVWanted`)."""

    request_id: str
    first_block: int
    data: torch.Tensor
    first_token: int
    logprobs: object | None  # TokenLogprobs when the request asked for logprobs
    num_cached_tokens: int  # the prefill instance's prefix-cache hit (what usage reports)


@dataclass(frozen=True)
class KVWrite:
    """Blocks a step writes into the cache before its forward (on every TP rank of the group)."""

    block_ids: tuple[int, ...]
    data: torch.Tensor  # uint8 [layers, len(block_ids), block_size, token_bytes]


class KVHandoff:
    """The scheduler's requests in transit (see the module's docstring); plain bookkeeping."""

    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.pending: deque[Request] = deque()  # "receive" requests without blocks, in arrival order
        self.receiving: dict[str, Request] = {}  # blocks allocated, KV on its way
        self.held: dict[str, Request] = {}  # "send" requests finished, blocks held until copied out

    @property
    def blocked(self) -> bool:
        """Requests wait for blocks and none is on its way that could be decoded and so free some:
        only a step (another request finishing) can help."""
        return bool(self.pending) and not self.receiving

    def allocate(self, room: int) -> list[KVWanted]:
        """Blocks for up to ``room`` pending requests, first in first out; the head waits when too few
        are free (backpressure: the ones behind it wait too)."""
        kv, wanted = self.kv_manager, []
        while self.pending and len(wanted) < room:
            request = self.pending[0]
            hit = kv.get_computed_blocks(request)
            if not kv.allocate_slots(request, request.num_prompt_tokens - hit.num_tokens, hit.block_ids):
                break
            self.pending.popleft()
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.WAITING_FOR_KV
            self.receiving[request.request_id] = request
            first = len(hit.block_ids)
            wanted.append(KVWanted(request.request_id, first, len(request.block_ids) - first))
        return wanted

    def arrived(self, request_id: str) -> Request | None:
        """The receiving request whose KV arrived (None: aborted meanwhile); its prompt is computed."""
        request = self.receiving.pop(request_id, None)
        if request is not None:
            request.num_computed_tokens = request.num_prompt_tokens
        return request

    def remove(self, request: Request) -> bool:
        """Take an aborted request out of transit; False if it was not in transit."""
        rid = request.request_id
        if self.receiving.get(rid) is request:
            del self.receiving[rid]
        elif self.held.get(rid) is request:
            del self.held[rid]
        elif request in self.pending:
            self.pending.remove(request)
        else:
            return False
        return True

    def export_blocks(self, request_id: str) -> tuple[Request, list[int]]:
        """A held request and the blocks to send: from its first wanted block through the last that
        holds a prompt token (the held request stays until :meth:`remove` releases it)."""
        request = self.held[request_id]
        last = self.kv_manager.num_blocks_for(request.num_prompt_tokens)
        return request, request.block_ids[request.kv_first_block : last]
