"""A generation request: its sampling parameters, token history and scheduling state.

Plain Python, no tensors. The scheduler owns ``status`` and ``num_computed_tokens``; the KV cache
manager owns ``block_ids`` and ``block_hashes``; the runner only reads.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``top_k`` of 0 or -1 disables top-k; ``logprobs=None`` returns none, ``k >= 0`` returns the
    sampled token's logprob plus the ``k`` most likely tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable):
            raise ValueError(f"stop_token_ids must be a sequence of token ids, got {stop!r}")
        stop = tuple(stop)
        bad = [t for t in stop if not _is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be non-negative integers, got {bad!r}")
        # The one sanctioned write to a frozen instance: normalise a list to a tuple.
        object.__setattr__(self, "stop_token_ids", stop)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
        "draft_token_ids",
        "kv_transfer",
        "kv_first_block",
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
        # Speculative decoding: tokens the draft model proposed after the last known one (not yet verified).
        self.draft_token_ids: list[int] = []
        self.kv_transfer = kv_transfer
        self.kv_first_block = kv_first_block
        # prompt + outputs in one list, appended to, so reading it costs no copy.
        self._all_token_ids: list[int] = list(self.prompt_token_ids)

    def append_output_token(self, token_id: int, logprobs: object | None = None) -> None:
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


def draft_room(request: Request, max_model_len: int, num_new: int = 0) -> int:
    """How many drafts the request could still use once ``num_new`` more tokens are appended: neither
    past ``max_tokens`` nor the context, the token sampled after them included."""
    return min(request.sampling_params.max_tokens - request.num_output_tokens,
               max_model_len - request.num_tokens) - num_new - 1


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
    if num_speculative_tokens:  # drafts verified and chained past the last token (Scheduler._allocation)
        num_kv_tokens = min(num_prompt + max_tokens - 2 + 2 * num_speculative_tokens, max_model_len)
    num_blocks_needed = -(-num_kv_tokens // block_size)
    if num_blocks_needed > num_blocks:
        raise ValueError(
            f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs "
            f"{num_blocks_needed} KV blocks of {block_size} tokens; the whole cache has {num_blocks}"
        )
