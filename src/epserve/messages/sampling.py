"""How a request samples and what it gets back per token: :class:`SamplingParams` (checked where
it is made) and :class:`TokenLogprobs`."""

from __future__ import annotations

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


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token under the model's (unmodified) distribution, and the top ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
