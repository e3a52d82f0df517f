"""The commands the offline ``LLM`` sends every rank (the same in every process layout: handled in
this process, or sent to spawned ranks), and what ``Generate`` returns per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from epserve.config import OverlapSetting
from epserve.messages.engine import AddRequest
from epserve.messages.sampling import TokenLogprobs


# ---- the offline commands -------------------------------------------------------------------------
@dataclass(frozen=True)
class Generate:
    requests: tuple[AddRequest, ...]
    use_tqdm: bool = False


@dataclass(frozen=True)
class GetExpertLoad:
    pass


@dataclass(frozen=True)
class SetOverlap:
    mode: OverlapSetting  # as validated by the front end (ParallelConfig)
    threshold: int | None = None  # None: keep the current one


@dataclass(frozen=True)
class ResetCommStats:
    pass


@dataclass(frozen=True)
class GetCommBytes:
    pass


@dataclass(frozen=True)
class RebalanceExperts:
    pass


@dataclass(frozen=True)
class ResetExpertLoad:
    pass


@dataclass(frozen=True)
class SetProfiling:
    enabled: bool


@dataclass(frozen=True)
class GetProfile:
    pass


@dataclass(frozen=True)
class GetCacheInfo:
    pass


@dataclass(frozen=True)
class GetSpeculativeStats:
    pass


WorkerCommand = (
    Generate | GetExpertLoad | RebalanceExperts | ResetExpertLoad | SetOverlap | ResetCommStats | GetCommBytes
    | SetProfiling | GetProfile | GetCacheInfo | GetSpeculativeStats
)


@dataclass(frozen=True)
class OfflineResult:
    """One request's result of ``Generate``, built once the step loop has run it."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # None first (the first prompt token has none)
