"""Speculative decoding's scheduling side: the drafts each running request has pending, which of them a
decode verifies, the KV slots a chunk needs, and after a verified step the rollback of the rejected
drafts' KV. Plain Python, called by the scheduler; drafting and verification are ``spec_decode.py``,
the draft passes ``proposer.py``.

A decode that verifies ``d`` drafts is one chunk of ``1 + d`` tokens in the step's budget. A chunk that
samples also writes the draft layer's KV of the next ``k - 1`` positions (the chained drafts), so it
allocates that many more slots (within the context); after the step only the KV of the tokens the
request kept counts as computed, and blocks past it are freed (``KVCacheManager.trim``).

Drafting is switched off for a step where it would not pay (:class:`DraftRule`): a decode step costs
about its weight reads while its rows are few, then grows with its rows, so ``1 + k`` rows per request
pay only while the step's requests are few and the drafts are accepted often enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from epserve.engine.kv_manager import KVCacheManager
from epserve.engine.request import Request

# When drafting pays, per device type. A step that verifies ``k`` drafts a request costs about
# ``1 + DRAFT_COST * k`` plain steps and yields ``1 + accepted`` tokens a request: it pays while the accepted
# drafts a verification average at least ``DRAFT_COST * k``. On the CPU (benchmarks/mtp_decode.py
# --breakdown, the trained tiny checkpoint, fp32, 2 cores) a k = 1 step cost 1.72-1.9 plain ones at batch 1
# to 8 and 2.1 at batch 16, where even every draft accepted does not pay: at most 8 requests draft. A GPU's
# step stays weight-bound longer; its cost is not measured here, so only its batch cap applies. These are
# ``--speculative mtp``'s; where the start-up probe switched MTP on (the default, ``engine/spec_probe.py``)
# the rule is its measurement's: the largest batch timed to pay, and that batch's break-even.
DRAFT_COST = {"cpu": 0.75, "cuda": 0.0}
DRAFT_REQUESTS = {"cpu": 8, "cuda": 256}
ACCEPTANCE_SAMPLE = 64  # verifications (decodes verifying drafts) before the measured acceptance decides


@dataclass(frozen=True)
class DraftRule:
    """When a step drafts: for at most ``max_requests`` sampling requests, and, once ``sample`` verifications
    were counted, while they accepted on average at least ``cost * k`` drafts (``k`` drafted each)."""

    max_requests: int
    cost: float = 0.0
    sample: int = ACCEPTANCE_SAMPLE

    @classmethod
    def for_device(cls, device_type: str) -> DraftRule:
        key = device_type if device_type in DRAFT_REQUESTS else "cuda"
        return cls(DRAFT_REQUESTS[key], DRAFT_COST[key])

    def pays(self, num_requests: int, num_spec: int, verified: int, accepted: int) -> bool:
        """Whether a step that samples ``num_requests`` requests drafts ``num_spec`` tokens each, after
        ``verified`` verifications accepted ``accepted`` drafts in all (the leader's counters: it decides, its
        TP peers follow its pass). Decided by the counters alone, so the same on every run of a workload."""
        if num_requests > self.max_requests:
            return False
        return verified < self.sample or accepted >= self.cost * num_spec * verified


def draft_room(request: Request, max_model_len: int, num_new: int = 0) -> int:
    """How many drafts the request could still use once ``num_new`` more tokens are appended: neither
    past ``max_tokens`` nor the context, the token sampled after them included."""
    return min(request.sampling_params.max_tokens - request.num_output_tokens,
               max_model_len - request.num_tokens) - num_new - 1


def step_tokens(sampled: int | Sequence[int], logprobs: object | None) -> tuple[tuple[int, ...], tuple[object, ...]]:
    """A request's entry of a step's ``sampled`` (and ``logprobs``) as its tokens and one logprobs entry
    (or None) each: one token, or with speculative decoding the accepted drafts then the token sampled
    after them (``logprobs`` then one entry per token)."""
    if isinstance(sampled, int):
        return (sampled,), (logprobs,)
    tokens = tuple(sampled)
    return tokens, (None,) * len(tokens) if logprobs is None else tuple(logprobs)  # type: ignore[arg-type]


class SpecManager:
    """Pending drafts per request and the KV they need. With ``num_spec == 0`` (no speculative decoding)
    a decode verifies nothing and a chunk needs exactly its own slots."""

    def __init__(self, kv_manager: KVCacheManager, num_spec: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.kv_manager = kv_manager
        self.num_spec = num_spec
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self._pending: dict[str, list[int]] = {}  # the draft model's tokens after the last known one

    def pending(self, request: Request) -> list[int]:
        """The request's drafts not verified yet (all of them, whatever the next decode takes)."""
        return self._pending.get(request.request_id, [])

    def drafts(self, request: Request) -> tuple[int, ...]:
        """The drafts a decode verifies: all it has, within a step's token budget and neither past
        ``max_tokens`` nor the context (the token sampled after them counts too). Only the request's own
        state decides, never what else runs (a decode waits rather than verify fewer), so how a seeded
        request's positions group into steps, and so what it draws, is its own."""
        pending = self._pending.get(request.request_id)
        if not pending:
            return ()
        room = min(self.max_num_batched_tokens - 1, draft_room(request, self.max_model_len))
        return tuple(pending[: max(room, 0)])

    def num_slots(self, request: Request, num_new: int, start: int | None = None) -> int:
        """KV slots to allocate for ``num_new`` tokens from ``start`` (default: the computed ones): a chunk
        that samples also writes the draft layer's KV of the next ``num_spec - 1`` positions (the chained
        drafts), within the context."""
        start = request.num_computed_tokens if start is None else start
        if not self.num_spec or start + num_new < request.num_tokens:  # a prompt chunk that does not sample
            return num_new
        return max(num_new, min(num_new + self.num_spec - 1, self.max_model_len - start))

    def verified(self, request: Request, drafts: Mapping[str, Sequence[int]] | None) -> None:
        """After a step that sampled for ``request`` and did not finish it (its computed tokens already
        cut to the ones it kept): free the blocks past them (the rejected drafts' KV rolls back) and keep
        ``drafts[request_id]``, the drafts its next decode verifies."""
        if not self.num_spec:
            return
        self.kv_manager.trim(request)
        new = drafts.get(request.request_id) if drafts else None
        if new:
            self._pending[request.request_id] = list(new)
        else:
            self._pending.pop(request.request_id, None)

    def forget(self, request: Request) -> None:
        """Drop the request's drafts (preempted: its KV is gone; or released)."""
        self._pending.pop(request.request_id, None)
