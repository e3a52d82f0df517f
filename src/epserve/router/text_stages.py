"""A choice's output on its way to the client: each engine message's tokens pass through a chain of
stages, each taking a :class:`TextPiece` and returning one:

1. :class:`Detokenize`: the tokens become text, cut at the first stop string (``detokenize.OutputText``);
   the piece then holds only the tokens the text used, and finishes with ``stop`` when a stop string matched;
2. :class:`SplitReasoning` (chat, with ``--reasoning-parser``): the text split into reasoning and the answer;
3. :class:`ExtractToolCalls` (chat, with tools): the answer split into text and the calls it makes.

A stage keeps its own stream's state (held-back text); on a piece with a finish reason it lets go of
what it held. :func:`text_stages` builds a choice's chain."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from epserve.router.detokenize import OutputText
from epserve.router.reasoning import REASONING_PARSERS, DeepSeekR1ReasoningParser
from epserve.router.tool_call_events import ToolCall, openai_delta
from epserve.router.tool_calls import TOOL_CALL_PARSERS, DeepSeekToolParser


@dataclass(frozen=True)
class TextPiece:
    """What one engine message adds to a choice, as far as the stages have taken it."""

    token_ids: tuple[int, ...]  # the message's tokens (after detokenization: those its text used)
    finish_reason: str | None  # the engine's, or ``stop`` once a stop string matched
    text: str = ""  # the text (after the reasoning and tool-call stages: the answer's text)
    reasoning: str = ""  # with a reasoning parser: the part of the text that is reasoning
    tool_calls: tuple[dict[str, Any], ...] = ()  # with tools: OpenAI's ``delta.tool_calls`` entries


class TextStage(Protocol):
    def __call__(self, piece: TextPiece) -> TextPiece: ...


class Detokenize:
    """Tokens to text, cut at stop strings (and a stop token's text left out: ``OutputText``)."""

    def __init__(self, output: OutputText) -> None:
        self.output = output

    def __call__(self, piece: TextPiece) -> TextPiece:
        # (a message may carry several tokens: accepted speculative drafts)
        text, used, stopped = self.output.feed(piece.token_ids, piece.finish_reason)
        return dataclasses.replace(piece, token_ids=piece.token_ids[:used], text=text,
                                   finish_reason="stop" if stopped else piece.finish_reason)


class SplitReasoning:
    """The text split: reasoning, then the answer. ``include``: whether the reasoning is sent at all
    (it is left out of the answer either way)."""

    def __init__(self, parser: DeepSeekR1ReasoningParser, include: bool = True) -> None:
        self.parser = parser
        self.include = include

    def __call__(self, piece: TextPiece) -> TextPiece:
        part = self.parser.feed(piece.text)
        if piece.finish_reason:
            rest = self.parser.flush()
            part = type(part)(part.reasoning + rest.reasoning, part.content + rest.content)
        return dataclasses.replace(piece, text=part.content, reasoning=part.reasoning if self.include else "")


class ExtractToolCalls:
    """The answer split: its text, and the calls it makes (``single``: the first call only, for a request
    with ``parallel_tool_calls`` false)."""

    def __init__(self, parser: DeepSeekToolParser, single: bool = False) -> None:
        self.parser = parser
        self.single = single

    def __call__(self, piece: TextPiece) -> TextPiece:
        events = self.parser.feed(piece.text)
        if piece.finish_reason:  # cut by max_tokens: a marker's unfinished start is dropped, not shown
            events += self.parser.flush(cut=piece.finish_reason == "length")
        out = openai_delta(events) or {}
        calls = out.get("tool_calls", [])
        if self.single:
            calls = [c for c in calls if c["index"] == 0]
        return dataclasses.replace(piece, text=out.get("content", ""), tool_calls=tuple(calls))

    @property
    def calls(self) -> list[ToolCall]:
        """The calls made so far (whole, once the output finished)."""
        calls = self.parser.streamed_calls
        return calls[:1] if self.single else calls


def text_stages(output: OutputText, reasoning_parser: str | None = None, thinking: bool = False,
                include_reasoning: bool = True, tool_parser: str | None = None,
                single_tool_call: bool = False) -> list[TextStage]:
    """A choice's chain: ``reasoning_parser`` (a ``--reasoning-parser`` name) starting inside the reasoning
    with ``thinking`` (the rendered prompt left a ``<think>`` open); ``tool_parser`` (a
    ``--tool-call-parser`` name) for a request with tools."""
    stages: list[TextStage] = [Detokenize(output)]
    if reasoning_parser is not None:
        stages.append(SplitReasoning(REASONING_PARSERS[reasoning_parser](thinking), include_reasoning))
    if tool_parser is not None:
        stages.append(ExtractToolCalls(TOOL_CALL_PARSERS[tool_parser](), single_tool_call))
    return stages


def run_stages(stages: Sequence[TextStage], piece: TextPiece) -> TextPiece:
    for stage in stages:
        piece = stage(piece)
    return piece
