"""A generation request: its sampling parameters, token history and scheduling state; the part of it one
step runs (``ScheduledChunk``), what the step did to it (``RequestUpdate``) and when a token ends it
(``check_stop``).

Plain Python, no tensors. The scheduler owns ``status`` and ``num_computed_tokens``; the KV cache
manager owns ``block_ids`` and ``block_hashes``; the runner and the sampling pipeline only read.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass

from epserve.messages.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()  # blocks allocated; the prompt's KV is on its way from a prefill instance
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """``"stop"``, ``"length"`` or ``"abort"`` for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence. Token positions ``[0, num_computed_tokens)`` have their KV in the cache; block
    ``i`` of ``block_ids`` holds positions ``[i * block_size, (i + 1) * block_size)``."""

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_ids",
        "arrival_time",
        "output_token_ids",
        "output_logprobs",
        "status",
        "num_computed_tokens",
        "block_ids",
        "block_hashes",
        "num_cached_tokens",
        "num_preemptions",
        "kv_transfer",
        "kv_first_block",
        "prompt_logprobs",
        "first_scheduled_time",
        "first_token_time",
        "_all_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: SamplingParams | None = None,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        kv_transfer: str | None = None,
        kv_first_block: int = 0,
    ) -> None:
        """``kv_transfer``: ``"send"`` for a prompt prefilled for a decode instance (its blocks from
        ``kv_first_block`` on are copied out when it finishes), ``"receive"`` for a request whose
        prompt KV comes from a prefill instance (``engine/kv_handoff.py``); None otherwise."""
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[object] = []
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # Chained hashes of the full blocks of all_token_ids; filled by the KV cache manager.
        self.block_hashes: list[int] = []
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.kv_transfer = kv_transfer
        self.kv_first_block = kv_first_block
        # Asked-for prompt logprobs so far: entry p is the prompt token at p + 1's (the scheduler appends).
        self.prompt_logprobs: list[object] = []
        self.first_scheduled_time: float | None = None  # the engine's clock (time.monotonic)
        self.first_token_time: float | None = None
        # prompt + outputs in one list, appended to, so reading it costs no copy.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int, logprobs: object | None = None) -> None:
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. The live list, not a copy: read it, never mutate it."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt positions still lack theirs."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, num_prompt_tokens={self.num_prompt_tokens}, "
            f"num_output_tokens={self.num_output_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


def check_stop(request: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """The finished status ``token``, just appended, gives the request (EOS or a stop token; ``max_tokens``
    or the context reached), or None while it goes on."""
    params = request.sampling_params
    if (not params.ignore_eos and token in request.eos_token_ids) or token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def append_tokens(request: Request, tokens: tuple[int, ...], logprobs: tuple[object, ...],
                  max_model_len: int) -> tuple[RequestStatus | None, int]:
    """Append a step's tokens one by one (each with its logprobs entry or None) until one stops the request
    (the rest cut, exactly where plain decoding would stop): the finished status or None, and how many
    were appended."""
    status, n = None, 0
    for token, lp in zip(tokens, logprobs):
        n += 1
        request.append_output_token(token, lp)
        status = check_stop(request, token, max_model_len)
        if status is not None:
            break
    return status, n


def decodes_at(request: Request, start: int) -> bool:
    """Whether running ``request`` from token ``start`` is a decode: only the last known token lacks
    KV, and it is an output token (so a recompute's prompt part never counts)."""
    return start == request.num_tokens - 1 and start >= request.num_prompt_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of ``request.all_token_ids`` to run this step; with
    speculative decoding, a decode's last ``len(drafts)`` tokens are draft tokens after the last known
    one (positions past ``request.num_tokens``), verified by this step's forward.

    ``start`` is the request's ``num_computed_tokens`` before the step (KV for ``[0, start)`` is in
    the cache, in ``request.block_ids``). ``needs_sample`` and ``is_decode`` read the request's
    current length, so they hold between ``schedule()`` and ``update()`` (which appends a token).
    ``is_decode`` is the engine's one definition of a decode: the scheduler orders by it, the batch
    plan counts it, and the model runs those rows in absorbed MLA form.
    """

    request: Request
    start: int
    num_tokens: int
    drafts: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def num_known(self) -> int:
        """Tokens of the chunk that are the request's own (the drafts excluded)."""
        return self.num_tokens - len(self.drafts)

    @property
    def needs_sample(self) -> bool:
        """The chunk reaches the last known token, so the sampling pipeline draws the next one (and verifies
        the drafts)."""
        return self.start + self.num_known == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """Exactly one known token, the last one, an output token (:func:`decodes_at`), plus any drafts.
        Every other chunk (prompt chunks, a recompute after preemption) is a prefill; a prefill chunk
        may also be a single token (the last prompt token alone)."""
        return self.num_known == 1 and decodes_at(self.request, self.start)

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_known] + list(self.drafts)

    def slot_ids(self, block_size: int) -> list[int]:
        """KV cache slot of each position of the chunk (``block * block_size + offset``)."""
        block_ids = self.request.block_ids
        return [block_ids[p // block_size] * block_size + p % block_size for p in range(self.start, self.end)]


@dataclass(frozen=True)
class RequestUpdate:
    """What one ``update`` did to one request: the tokens it got (if any), their logprobs, and whether
    it ended. A request may have two updates in one step (a decode side's arrival: the prefill's first
    token, then the token the step sampled), so the logprobs travel with their tokens, never read back
    from the request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" when finished
    new_logprobs: tuple[object, ...] = ()  # one per new token when the request asks for logprobs, else ()
    num_output_tokens: int = 0  # the request's output tokens as of this update


def check_prompt(
    request_id: str, num_prompt: int, max_tokens: int, max_model_len: int, block_size: int, num_blocks: int,
    num_speculative_tokens: int = 0,
) -> None:
    """Raise ValueError for a prompt that can never run: empty, beyond the context, or needing more
    KV blocks than the whole cache (with speculative decoding, its draft positions included)."""
    rid = request_id
    if num_prompt == 0:
        raise ValueError(f"request {rid!r}: the prompt is empty")
    if num_prompt >= max_model_len:
        raise ValueError(
            f"request {rid!r}: prompt has {num_prompt} tokens; the context is {max_model_len}, "
            "which must leave room for at least one generated token"
        )
    # The last token of a finished request is never fed back, so it needs no KV slot.
    num_kv_tokens = min(num_prompt + max_tokens, max_model_len) - 1
    if num_speculative_tokens:  # drafts verified and chained past the last token (SpecManager.num_slots)
        num_kv_tokens = min(num_prompt + max_tokens - 2 + 2 * num_speculative_tokens, max_model_len)
    num_blocks_needed = -(-num_kv_tokens // block_size)
    if num_blocks_needed > num_blocks:
        raise ValueError(
            f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs "
            f"{num_blocks_needed} KV blocks of {block_size} tokens; the whole cache has {num_blocks}"
        )
