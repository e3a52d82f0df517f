"""Streaming text output: incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` turns a growing list of generated token ids into text pieces. With a
byte-level BPE one token may hold only part of a multi-byte UTF-8 character (it decodes to
``'\\ufffd'``), so text is only emitted once it can no longer change: the pieces never contain a
half-decoded character, and their concatenation (plus ``flush()``) equals
``tokenizer.decode(all_ids)``. Each step decodes a short window of recent tokens, not the whole
sequence, so the cost per token does not grow with the output length.

``StopStringMatcher`` scans that streamed text for stop strings, holding back just the tail that
could still turn out to be the beginning of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so it decodes as it would in context.
_CONTEXT_TOKENS = 4


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text pieces, never emitting a broken UTF-8 char; the
    concatenation of all pieces equals ``tokenizer.decode(all_ids)`` (with the same skip_special_tokens).

    Bookkeeping (indices into ``_ids``, which is the prompt context followed by the outputs):
    ``_prefix_text = decode(_ids[_prefix:_read])`` is text already emitted, used only to find where
    new text starts in ``decode(_ids[_prefix:])``; ``_read`` always sits on a character boundary.
    ``_held`` counts characters after ``_prefix_text`` already emitted while the text still ended in
    an incomplete character (the part before the trailing replacement characters cannot change).
    Call ``flush()`` once, at the end; adding tokens after it is allowed but may split a character.
    """

    def __init__(
        self, tokenizer: _Decoder, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]] if len(prompt_token_ids) else []
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: its bytes would merge with the output's.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = context_text
        self._held = 0
        self._pieces: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _pending(self) -> str:
        """Text of the tokens after ``_read`` (plus any held part), decoded in the current window."""
        return self._decode(self._ids[self._prefix :])[len(self._prefix_text) :]

    def _settle(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self._held = 0

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text that became final."""
        if not len(token_ids):
            return ""
        self._ids.extend(int(t) for t in token_ids)
        new = self._pending()
        if not new.endswith(REPLACEMENT_CHAR):
            piece = new[self._held :]
            self._settle()
            return self._emit(piece)
        # Ends in an incomplete character: emit what precedes it, keep the rest for later.
        stable = new.rstrip(REPLACEMENT_CHAR)
        piece = stable[self._held :]
        self._held = max(self._held, len(stable))
        return self._emit(piece)

    def flush(self) -> str:
        """At the end of generation: whatever was held back (may contain ``'\\ufffd'``)."""
        if self._read == len(self._ids) and not self._held:
            return ""
        piece = self._pending()[self._held :]
        self._settle()
        return self._emit(piece)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """The output token ids added so far (a copy)."""
        return self._ids[self._num_context :]


class StopStringMatcher:
    """Finds stop strings in streamed text; holds back the tail that could still begin a stop string.

    The stop whose occurrence starts earliest in the whole text wins (of two starting at the same
    place, the shorter one), however the text is split into feeds: a match is only reported once
    no stop string starting earlier can still complete.
    """

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        if isinstance(stops, str):
            stops = [stops]
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once stopped

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit now, stopped)``. On a stop the text runs up to the start of
        the stop string (through its end with ``include_stop_str``); later feeds return ``("", True)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._buffer + text
        best: tuple[int, int, str] | None = None  # (start, end, stop) of the earliest complete match
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or (i, i + len(stop)) < best[:2]):
                best = (i, i + len(stop), stop)
        hold_from = self._partial_start(buf)
        if best is not None and best[0] <= hold_from:
            start, end, stop = best
            self.stopped, self.matched, self._buffer = True, stop, ""
            return buf[: end if self.include_stop_str else start], True
        self._buffer = buf[hold_from:]
        return buf[:hold_from], False

    def _partial_start(self, buf: str) -> int:
        """Earliest index from which the rest of ``buf`` is a proper prefix of some stop string."""
        start = len(buf)
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), 0, -1):
                if len(buf) - k >= start:
                    break
                if buf.endswith(stop[:k]):
                    start = len(buf) - k
                    break
        return start

    def flush(self) -> str:
        """Held-back text at the end of generation (empty once a stop matched)."""
        held, self._buffer = self._buffer, ""
        return "" if self.stopped else held
