"""Reasoning parsers: generated text split into ``reasoning_content`` and ``content``.

DeepSeek-R1 (and DeepSeek-V3.1 in thinking mode) thinks between ``<think>`` and ``</think>``, then
answers. The chat template's generation prompt already opens the block (R1: ``<｜Assistant｜><think>\\n``,
V3.1 with ``thinking``: ``<｜Assistant｜><think>``; V3.1 without it closes one instead,
``<｜Assistant｜></think>``), so the output is usually only ``reasoning</think>answer``; older R1
templates left the ``<think>`` to the model, which then writes it first. Both markers are ordinary
(non-special) tokens in DeepSeek's tokenizers: they survive ``skip_special_tokens`` and the parser
sees them in the detokenized text.

:class:`DeepSeekR1ReasoningParser` (``--reasoning-parser deepseek_r1``, as vLLM and SGLang call it):

- a ``<think>`` at the very start of the output is dropped and opens the reasoning;
- reasoning otherwise starts open when ``start_in_reasoning`` (the default; ``starts_in_reasoning``
  decides it from the rendered prompt), else the output is content;
- the first ``</think>`` ends the reasoning; everything after it is content, ``<think>`` or
  ``</think>`` text included (reasoning that quotes ``<think>`` stays reasoning up to that first end);
- no ``</think>`` at all: the whole output is reasoning and the content is ``None``. This is what
  vLLM's R1 parser does (``extract_reasoning`` returns ``(output, None)``), and SGLang's with forced
  reasoning: a response cut off by ``max_tokens`` while thinking has no answer yet;
- ``enabled=False`` (thinking off, V3.1 rendered without ``thinking``): no reasoning at all, the
  whole output is content, as vLLM's identity parser does.

Whole responses go through :meth:`DeepSeekR1ReasoningParser.parse`; streams through ``feed`` (one
call per detokenized piece, split anywhere) and ``flush`` at the end. A marker, or the start of one
that may still complete, is never emitted as text: the pieces held back are at most
``len("</think>") - 1`` characters. Empty parts are ``None`` in ``parse`` (vLLM leaves
``reasoning_content`` out, or null, the same way) and ``""`` in the stream's deltas; the stream's
parts joined (``"" -> None``) equal ``parse`` of the whole text, however it was split.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

THINK_START = "<think>"
THINK_END = "</think>"

# The stream's phases: checking for a leading <think>, inside the reasoning, after it.
_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


def partial_suffix_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers``: the
    tail a streaming parser must hold back, since the next piece may complete the marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a think block open: its last ``<think>`` comes after its
    last ``</think>``. True for R1's and V3.1's thinking generation prompts, False for V3.1's
    non-thinking one (it ends in ``</think>``) and for a prompt with no markers (DeepSeek-V3).

    Earlier turns do not confuse it (the templates render them with their reasoning closed or cut);
    a user message that itself ends in an unclosed ``<think>`` after the last marker would, so ask it
    only of prompts rendered for a reasoning model, where the generation prompt's marker is the last.
    """
    return prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)


class ReasoningDelta(NamedTuple):
    """One streamed piece split in two; either part may be empty."""

    reasoning: str
    content: str


class DeepSeekR1ReasoningParser:
    """DeepSeek-R1's ``<think>...</think>`` reasoning, for whole responses and streams.

    One instance per response (per choice): ``feed`` keeps the stream's state. ``parse`` uses only
    the two options, so it may be called on any instance.
    """

    name = "deepseek_r1"
    start_marker = THINK_START
    end_marker = THINK_END

    def __init__(self, start_in_reasoning: bool = True, *, enabled: bool = True) -> None:
        self.start_in_reasoning = start_in_reasoning
        self.enabled = enabled
        self._state = _OPENING if enabled else _CONTENT
        self._held = ""

    @classmethod
    def for_prompt(cls, prompt_text: str, *, enabled: bool = True) -> DeepSeekR1ReasoningParser:
        """The parser for an output continuing ``prompt_text`` (see :func:`starts_in_reasoning`)."""
        return cls(starts_in_reasoning(prompt_text), enabled=enabled)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; an empty part is ``None``."""
        if not self.enabled:
            return None, text or None
        inside = self.start_in_reasoning
        if text.startswith(THINK_START):
            text, inside = text[len(THINK_START) :], True
        if not inside:
            return None, text or None
        reasoning, _, content = text.partition(THINK_END)
        return reasoning or None, content or None  # no end: content is ""

    @property
    def reasoning_ended(self) -> bool:
        """Whether the stream is past its reasoning (or had none): what comes next is content."""
        return self._state == _CONTENT

    def feed(self, delta: str) -> ReasoningDelta:
        """Split the next piece of the output; text that may be part of a marker is held back."""
        text, self._held = self._held + delta, ""
        reasoning = ""
        if self._state == _OPENING:
            if text.startswith(THINK_START):
                text, self._state = text[len(THINK_START) :], _REASONING
            elif THINK_START.startswith(text):
                self._held = text  # may still become "<think>"
                return ReasoningDelta("", "")
            else:
                self._state = _REASONING if self.start_in_reasoning else _CONTENT
        if self._state == _REASONING:
            end = text.find(THINK_END)
            if end < 0:
                keep = partial_suffix_len(text, (THINK_END,))
                self._held = text[len(text) - keep :] if keep else ""
                return ReasoningDelta(text[: len(text) - keep], "")
            reasoning, text, self._state = text[:end], text[end + len(THINK_END) :], _CONTENT
        return ReasoningDelta(reasoning, text)

    def flush(self) -> ReasoningDelta:
        """At the end of the output: the held-back text, which no longer can be a marker."""
        held, self._held = self._held, ""
        if self._state == _OPENING:
            self._state = _REASONING if self.start_in_reasoning else _CONTENT
        if self._state == _REASONING:
            return ReasoningDelta(held, "")
        return ReasoningDelta("", held)


REASONING_PARSERS: dict[str, type[DeepSeekR1ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}
