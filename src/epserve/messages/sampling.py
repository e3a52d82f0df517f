"""How a request samples and what it gets back per token: :class:`SamplingParams` (checked where
it is made) and :class:`TokenLogprobs`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_REPETITION_PENALTY = 2.0**16
MAX_BIAS = 100.0  # logit_bias values, as OpenAI bounds them


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: a JSON schema (its JSON text), any JSON object (``spec`` empty), a
    regular expression, one of several strings (``spec``: their JSON list), an EBNF grammar (xgrammar's
    dialect), or an xgrammar structural tag (its JSON: fixed text around JSON-schema parts, as a forced
    tool call is). The engine compiles it (``engine/structured.py``)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise ValueError(f"a {self.kind} structured output needs its specification")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``top_k`` of 0 or -1 disables top-k; ``logprobs=None`` returns none, ``k >= 0`` returns the
    sampled token's logprob plus the ``k`` most likely tokens. ``max_tokens=0`` runs the prompt only
    (for its ``prompt_logprobs``).

    Logits processing, as vLLM defines it, before temperature and the filters (greedy requests too):
    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every token in
    the prompt or the output so far; ``frequency_penalty`` subtracts itself times the token's count in
    the output, ``presence_penalty`` itself once for a token the output holds; ``logit_bias`` adds to
    the given tokens' logits; until ``min_tokens`` tokens were generated, the stop tokens and EOS cannot
    be drawn; ``bad_words`` (token id sequences) are never completed: a word's last token cannot be drawn
    where the output ends with the rest of it (a one-token word: never). ``prompt_logprobs=k`` returns each
    prompt token's logprob (from the second on) and the
    ``k`` most likely tokens at its position. ``structured``: the output follows that constraint (a
    JSON schema, regex, choice or grammar; EOS only where it can end).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    bad_words: tuple[tuple[int, ...], ...] = ()
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
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
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                             f"got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:  # also rejects NaN
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)!r}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        bias = tuple(self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias)
        bad_bias = [(t, b) for t, b in bias if not _is_int(t) or t < 0 or not isinstance(b, (int, float))
                    or isinstance(b, bool) or not -MAX_BIAS <= b <= MAX_BIAS]
        if bad_bias:
            raise ValueError(f"logit_bias must map token ids to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                             f"got {bad_bias[:3]!r}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted((t, float(b)) for t, b in bias)))
        words = self.bad_words
        if isinstance(words, (str, bytes)) or not isinstance(words, Iterable):
            raise ValueError(f"bad_words must be a sequence of token id sequences, got {words!r}")
        words = tuple(tuple(w) if isinstance(w, Iterable) and not isinstance(w, (str, bytes)) else w for w in words)
        if any(not isinstance(w, tuple) or not w or any(not _is_int(t) or t < 0 for t in w) for w in words):
            raise ValueError(f"bad_words must be non-empty sequences of token ids, got {words[:3]!r}")
        object.__setattr__(self, "bad_words", words)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r}")
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

    @property
    def has_penalties(self) -> bool:
        """Whether the token counts of the prompt and output change this request's logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling (``engine/logits_processor``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token under the model's (unmodified) distribution, and the top ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
