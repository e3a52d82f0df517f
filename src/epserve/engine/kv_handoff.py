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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epserve.engine.kv_manager import KVCacheManager
from epserve.engine.request import Request, RequestStatus
from epserve.messages.kv import KVWanted, PrefilledKV

if TYPE_CHECKING:  # (an annotation only: the handoff is plain bookkeeping)
    import torch


@dataclass(frozen=True)
class KVWrite:
    """Blocks a step writes into the cache before its forward (on every TP rank of the group)."""

    block_ids: tuple[int, ...]
    data: torch.Tensor  # uint8 [layers, len(block_ids), block_size, token_bytes]


class KVHandoff:
    """The scheduler's requests in transit (see the module's docstring), and every move between their
    states: plain bookkeeping over the scheduler's KV cache manager. ``release`` frees a request the
    scheduler holds (its blocks and its entry); a held prefill goes to it once its blocks are copied out.

    Decode side: ``add`` (pending) -> ``allocate`` (receiving; :meth:`take_wanted` tells the transfer
    side) -> ``receive`` then ``take_arrivals`` at the next step (the scheduler runs it from then on).
    Prefill side: ``hold`` (a finished prefill's blocks) -> ``export_blocks`` -> ``release``."""

    def __init__(self, kv_manager: KVCacheManager, release: Callable[[Request], None]) -> None:
        self.kv_manager = kv_manager
        self._release = release
        self.pending: deque[Request] = deque()  # "receive" requests without blocks, in arrival order
        self.receiving: dict[str, Request] = {}  # blocks allocated, KV on its way
        self.held: dict[str, Request] = {}  # "send" requests finished, blocks held until copied out
        self._wanted: list[KVWanted] = []  # allocated by the last steps, not taken yet
        self._arrivals: list[PrefilledKV] = []  # arrived since the last step; written by the next one

    @property
    def num_receiving(self) -> int:
        """Requests waiting for their prompt's KV from a prefill instance (blocks allocated or not)."""
        return len(self.pending) + len(self.receiving)

    @property
    def blocked(self) -> bool:
        """Requests wait for blocks and none is on its way that could be decoded and so free some:
        only a step (another request finishing) can help."""
        return bool(self.pending) and not self.receiving

    def add(self, request: Request) -> bool:
        """Take a new request whose prompt KV comes from a prefill instance (``kv_transfer ==
        "receive"``): it waits for blocks. False for any other request (the scheduler queues it)."""
        if request.kv_transfer != "receive":
            return False
        self.pending.append(request)
        return True

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

    # ---- decode side ---------------------------------------------------------------------------
    def allocate(self, num_seqs: int) -> None:
        """Blocks for pending requests, first in first out, while fewer than ``num_seqs`` requests (the
        scheduler's free seats) receive; the head waits when too few are free (backpressure: the ones
        behind it wait too). The allocated ones are wanted (:meth:`take_wanted`)."""
        kv, room, wanted = self.kv_manager, num_seqs - len(self.receiving), []
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
        self._wanted.extend(wanted)

    def take_wanted(self) -> list[KVWanted]:
        """The requests whose blocks were allocated since the last call: the transfers to start."""
        wanted, self._wanted = self._wanted, []
        return wanted

    def receive(self, arrival: PrefilledKV) -> None:
        """A receiving request's KV and first token (between steps); :meth:`take_arrivals` at the start
        of the next step makes it the step's block write."""
        self._arrivals.append(arrival)

    def take_arrivals(self) -> Iterator[tuple[KVWrite, Request]]:
        """Each arrival since the last call (those of requests aborted meanwhile dropped): the blocks the
        step writes before its forward, and the request with its prompt computed and the prefill's first
        token appended, out of transit (the scheduler checks that token and runs the request).
        ValueError if the blocks that arrived are not the ones allocated."""
        for arrival in self._arrivals:
            request = self.receiving.get(arrival.request_id)
            if request is None:  # aborted while its KV travelled
                continue
            block_ids = tuple(request.block_ids[request.num_computed_tokens // self.kv_manager.block_size :])
            if arrival.data.shape[1] != len(block_ids):
                raise ValueError(f"request {arrival.request_id!r}: {arrival.data.shape[1]} KV blocks arrived, "
                                 f"{len(block_ids)} were allocated")
            del self.receiving[arrival.request_id]
            request.num_computed_tokens = request.num_prompt_tokens
            request.num_cached_tokens = arrival.num_cached_tokens
            request.append_output_token(arrival.first_token, arrival.logprobs)
            self.kv_manager.cache_full_blocks(request)
            yield KVWrite(block_ids, arrival.data), request
        self._arrivals = []

    # ---- prefill side --------------------------------------------------------------------------
    def hold(self, request: Request) -> bool:
        """A request that just finished: a prefill for a decode instance (``kv_transfer == "send"``)
        keeps its blocks until they are copied out (True); False for any other (the scheduler frees it)."""
        if request.kv_transfer != "send":
            return False
        self.held[request.request_id] = request
        return True

    def export_blocks(self, request_id: str) -> tuple[Request, list[int]]:
        """A held request and the blocks to send: from its first wanted block through the last that
        holds a prompt token (the held request stays until :meth:`release`)."""
        request = self.held[request_id]
        last = self.kv_manager.num_blocks_for(request.num_prompt_tokens)
        return request, request.block_ids[request.kv_first_block : last]

    def release(self, request_id: str) -> None:
        """Free a held prefill's blocks (copied out, or its transfer given up)."""
        self._release(self.held.pop(request_id))
