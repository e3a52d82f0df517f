"""One HTTP request's choices as the router tracks them (``Choice``: what a choice has produced so far),
what each engine message adds to one (``Delta``), and the events a choice's task sends to a streamed
response (``ChoiceEvent``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from epserve.messages.sampling import SamplingParams
from epserve.router.tool_call_events import ToolCall


@dataclass
class Delta:
    """What one engine message adds to a choice, after detokenization and stop strings."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    finish_reason: str | None
    reasoning: str = ""  # with a reasoning parser: the part of the text that is reasoning (``text``: the rest)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # with tools: OpenAI's delta entries
    num_output: int = 0  # the choice's output tokens once this delta is sent (the usage streamed so far)


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    first_of_prompt: bool  # the prompt's tokens count once in usage and metrics, with this choice
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)  # with a reasoning parser
    tool_calls: list[ToolCall] = field(default_factory=list)  # with tools: the calls it made, once finished
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached: int = 0
    num_output: int = 0
    prompt_text: str | None = None  # as the client sent it (echo repeats it), None for token ids
    engine_times: tuple[float, float] | None = None  # the engine's queue and prefill seconds, from its first token
    # asked-for prompt logprobs: None for the first prompt token, then per prompt token its (logprob, top) or
    # the engine's TokenLogprobs (``logprobs`` reads either)
    prompt_logprobs: list[Any] | None = None


# ---- what a choice's task sends to the response stream -------------------------------------------
@dataclass(frozen=True)
class ChoiceDelta:
    """The choice produced more output."""

    choice: Choice
    delta: Delta


@dataclass(frozen=True)
class ChoiceFailed:
    """The choice failed after its first message (an error before it fails the whole response)."""

    choice: Choice
    error: Exception


@dataclass(frozen=True)
class ChoiceDone:
    """The choice's task ended (after its last delta or its failure); it sends nothing more."""

    choice: Choice


ChoiceEvent = ChoiceDelta | ChoiceFailed | ChoiceDone
