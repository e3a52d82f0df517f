"""Continuous-batching scheduler: chunked prefill under a token budget, decode first, preemption by
recompute when KV blocks run out. Speculative decoding's drafts are ``SpecManager``'s (how many slots a
chunk needs, which drafts a decode verifies, the rollback after it); the requests whose KV crosses
instances (prefill/decode disaggregation) are ``KVHandoff``'s until they run or once they finished.

One engine step is ``output = scheduler.schedule()``, the runner's forward over ``output.chunks`` and
the sampling pipeline's tokens (one for each chunk with ``needs_sample``, or its accepted drafts and
the token after them), then exactly one ``scheduler.update(output, sampled)``.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epserve.config import CacheConfig, SchedulerConfig
from epserve.engine.kv_handoff import KVHandoff
from epserve.engine.kv_manager import KVCacheManager
from epserve.engine.request import (
    Request,
    RequestStatus,
    RequestUpdate,
    ScheduledChunk,
    append_tokens,
    check_stop,
    decodes_at,
)
from epserve.engine.spec_manager import SpecManager, step_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]  # decodes first, then prefills
    num_batched_tokens: int
    preempted_ids: tuple[str, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
    ) -> None:
        """``num_speculative_tokens``: draft tokens verified per decode (0: no speculative decoding)."""
        if scheduler_config.max_num_seqs < 1 or scheduler_config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching, int(num_speculative_tokens > 0)
        )
        self.spec = SpecManager(self.kv_manager, num_speculative_tokens, max_model_len,
                                scheduler_config.max_num_batched_tokens)  # speculative decoding's drafts
        self.waiting: deque[Request] = deque()  # in arrival order; preempted ones go back in front
        self.running: list[Request] = []  # in arrival order; the last one is preempted first
        self._requests: dict[str, Request] = {}
        self._arrival_index: dict[str, int] = {}
        self._num_arrivals = 0
        self.num_preemptions_total = 0
        self._unreported: list[Request] = []  # aborted since the last update
        self._in_flight: set[str] = set()  # scheduled by the last schedule(), not yet updated
        self.handoff = KVHandoff(self.kv_manager, self._release)  # disaggregation's requests in transit

    # ---- requests --------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """True while a step can advance a request: one is waiting or running, an abort is yet to be
        reported, or requests wait for KV blocks that only a step can free. Requests whose KV is on its
        way are not counted: their arrival, not a step, moves them."""
        return bool(self.waiting or self.running or self._unreported or self.handoff.blocked)

    def add_request(self, request: Request) -> None:
        """Queue a checked request (``check_prompt``: the engine's one check, where it enters)."""
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if request.status is not RequestStatus.WAITING or request.num_computed_tokens or request.block_ids:
            raise ValueError(f"request {rid!r} is not a new request ({request.status.name})")
        self._requests[rid] = request
        self._arrival_index[rid] = self._num_arrivals
        self._num_arrivals += 1
        if not self.handoff.add(request):  # (its prompt KV comes from a prefill instance)
            self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks. Returns False if it is unknown or already finished;
        the abort is reported (finish_reason "abort") by the next ``update``. A request in the batch
        of the last ``schedule()`` keeps its blocks (the forward may be using them) until that
        ``update``. Not thread-safe: call it from the thread that steps the engine."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if not self.handoff.remove(request):
            (self.waiting if request.status is RequestStatus.WAITING else self.running).remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._unreported.append(request)
        if request_id not in self._in_flight:
            self._release(request)
        return True

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        # 1. Decodes, one token each (plus its drafts), oldest first; out of blocks -> preempt the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not decodes_at(request, request.num_computed_tokens):
                i += 1
                continue
            drafts = self.spec.drafts(request)
            if 1 + len(drafts) > budget:  # all or nothing: its drafts wait for a step with room
                i += 1
                continue
            while not self.kv_manager.allocate_slots(request, self.spec.num_slots(request, 1 + len(drafts))):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                chunks.append(ScheduledChunk(request, request.num_computed_tokens, 1 + len(drafts), drafts))
                budget -= 1 + len(drafts)
                i += 1

        # 2. Running requests with an unfinished (chunked) prefill. A prefill stops short only when
        # the budget runs out, and nothing is admitted after it, so there is at most one. If its
        # blocks run out it waits, keeping them, until the decodes free some or preempt it.
        for request in self.running:
            if budget == 0:
                break
            if decodes_at(request, request.num_computed_tokens):
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if self.kv_manager.allocate_slots(request, self.spec.num_slots(request, num_new)):
                chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
                budget -= num_new

        # 3. Requests whose prompt KV comes from a prefill instance: their blocks, so the transfer can
        # start (the KV arrives between steps). None after a preemption.
        if not preempted:
            self.handoff.allocate(self.config.max_num_seqs - len(self.running))

        # 4. Waiting requests, FIFO: the head blocks those behind it. None after a preemption.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv_manager.get_computed_blocks(request)
            num_new = min(request.num_tokens - hit.num_tokens, budget)
            if not self.kv_manager.allocate_slots(request, self.spec.num_slots(request, num_new, hit.num_tokens),
                                                  hit.block_ids):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0:
                request.num_cached_tokens = hit.num_tokens
            request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, request, key=self._arrival_of)
            chunks.append(ScheduledChunk(request, request.num_computed_tokens, num_new))
            budget -= num_new

        ordered = [c for c in chunks if c.is_decode] + [c for c in chunks if not c.is_decode]
        self._in_flight = {c.request.request_id for c in ordered}
        return SchedulerOutput(
            chunks=tuple(ordered),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_ids=tuple(r.request_id for r in preempted),
        )

    def start_decoding(self, request: Request) -> RequestUpdate:
        """A request whose prompt was computed elsewhere, its first token appended
        (``KVHandoff.take_arrivals``; call before ``schedule()``): it runs like any decode from now on.
        The update reports the token (and the end, if that token stops it)."""
        token = request.output_token_ids[-1]
        status = check_stop(request, token, self.max_model_len)
        if status is not None:
            request.status = status
            self._release(request)
        else:
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._arrival_of)
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        # (its only output token so far: output_logprobs holds that token's logprobs, if it asked for any)
        return RequestUpdate(request.request_id, (token,), status is not None, request.finish_reason,
                             tuple(request.output_logprobs[-1:]), 1)

    def update(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int | Sequence[int]],
        logprobs: dict[str, object] | None = None,
        drafts: Mapping[str, Sequence[int]] | None = None,
        prompt_logprobs: Mapping[str, Sequence[object]] | None = None,
    ) -> list[RequestUpdate]:
        """Apply a finished step: advance computed tokens, append sampled tokens (and
        ``logprobs[request_id]`` to ``request.output_logprobs`` when given), cache full blocks,
        stop and free finished requests. Returns an update for every request that got a token or
        finished, aborted ones included.

        With speculative decoding a request's ``sampled`` entry is a sequence (``step_tokens``), appended
        one by one: a stop condition cuts the rest, exactly where plain decoding would stop, and only
        the appended tokens' KV counts as computed (``SpecManager.verified`` rolls the rest back).
        ``drafts[request_id]``: the draft tokens to verify in the request's next decode;
        ``prompt_logprobs[request_id]``: the logprobs of the prompt positions the step computed, appended
        to ``request.prompt_logprobs``. A request with ``max_tokens`` 0 finishes ("length") when its
        prompt is computed, with no token."""
        updates = [RequestUpdate(r.request_id, (), True, r.finish_reason, (), r.num_output_tokens)
                   for r in self._unreported]
        for request in self._unreported:
            if self._requests.get(request.request_id) is request:  # aborted while in flight
                self._release(request)
        self._unreported.clear()
        self._in_flight = set()
        finished: list[Request] = []
        for chunk in output.chunks:
            request = chunk.request
            rid = request.request_id
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted after it was scheduled
            if request.num_computed_tokens != chunk.start:
                raise RuntimeError(f"request {rid!r}: update() must follow each schedule() exactly once")
            request.num_computed_tokens = chunk.end
            if prompt_logprobs and rid in prompt_logprobs:
                request.prompt_logprobs.extend(prompt_logprobs[rid])
            if not chunk.needs_sample:
                self.kv_manager.cache_full_blocks(request)
                continue
            if request.sampling_params.max_tokens == 0:  # the prompt alone (for its logprobs)
                self.kv_manager.cache_full_blocks(request)
                request.status = RequestStatus.FINISHED_LENGTH
                finished.append(request)
                updates.append(RequestUpdate(rid, (), True, request.finish_reason, (), 0))
                continue
            if rid not in sampled:
                raise KeyError(f"no sampled token for request {rid!r}")
            tokens, lps = step_tokens(sampled[rid], None if logprobs is None else logprobs.get(rid))
            status, n = append_tokens(request, tokens, lps, self.max_model_len)
            request.num_computed_tokens = chunk.start + chunk.num_known - 1 + n
            self.kv_manager.cache_full_blocks(request)
            if status is not None:
                request.status = status
                finished.append(request)
            else:
                self.spec.verified(request, drafts)
            updates.append(RequestUpdate(rid, tokens[:n], status is not None, request.finish_reason,
                                         lps[:n] if lps[0] is not None else (), request.num_output_tokens))
        if finished:
            done = {r.request_id for r in finished}
            self.running = [r for r in self.running if r.request_id not in done]
            for request in finished:
                if not self.handoff.hold(request):  # (a prefill for a decode instance: held until copied)
                    self._release(request)
        return updates

    # ---- helpers ---------------------------------------------------------------------------
    def _arrival_of(self, request: Request) -> int:
        return self._arrival_index[request.request_id]

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the outputs, wait at the front of the queue."""
        self.kv_manager.free(request)
        request.num_computed_tokens = 0
        self.spec.forget(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv_manager.free(request)
        self.spec.forget(request)
        del self._requests[request.request_id]
        del self._arrival_index[request.request_id]
