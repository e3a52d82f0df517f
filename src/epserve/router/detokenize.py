"""Streaming text output: incremental detokenization and stop-string matching.

``IncrementalDetokenizer`` turns a growing list of generated token ids into text pieces. With a
byte-level BPE one token may hold only part of a multi-byte UTF-8 character (it decodes to
``'\\ufffd'``), so text is only emitted once it can no longer change: the pieces never contain a
half-decoded character, and their concatenation (plus ``flush()``) equals
``tokenizer.decode(all_ids)``. Each step decodes a short window of recent tokens, not the whole
sequence, so the cost per token does not grow with the output length, also while the text keeps
ending in an incomplete character (what precedes it is cut off as soon as no later byte can change it).

``StopStringMatcher`` scans that streamed text for stop strings, holding back just the tail that
could still turn out to be the beginning of one, in time linear in the text (one KMP automaton per
stop string, never re-scanning what it holds back). ``OutputText`` puts them together for a choice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so it decodes as it would in context.
_CONTEXT_TOKENS = 4


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text pieces, never emitting a broken UTF-8 char; the
    concatenation of all pieces equals ``tokenizer.decode(all_ids)`` (with the same skip_special_tokens).

    It decodes a window of recent tokens, one added token at a time: ``_window[:_read]`` are tokens whose
    text is already emitted (kept as context, so that the next ones decode as they would in the whole
    sequence), ``_prefix_text`` their text, ``_window_text`` the text of the whole window. The window
    starts on a cut that no later token can change: before it, the text is final. ``_held`` counts the
    characters after ``_prefix_text`` already emitted while the text still ends in an incomplete
    character (the part before the trailing replacement characters cannot change).

    While the text ends in U+FFFD the window cannot simply move on: the bytes of an incomplete character
    may still be completed. It moves to the last token as soon as that token's text is its own, that
    is when ``decode(window before it) + decode([it]) == decode(window)`` (a byte-level text cut there
    cannot change: the token's first byte does not continue what came before, or what came before was
    already whole); a token with no text of its own that leaves the text as it was (a skipped special
    token) is left out of the window. An incomplete character holds at most three bytes, so the window
    stays short and each token costs two short decodes, whatever the output's length or bytes.
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
        self._outputs: list[int] = []
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = self._window_text = context_text
        self._held = 0
        self._pieces: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def _settle(self) -> None:
        """Everything in the window is emitted: its tokens after the context become the next context."""
        del self._window[: self._read]
        self._read = len(self._window)
        self._prefix_text = self._window_text = self._decode(self._window) if self._read else ""
        self._held = 0

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text that became final."""
        return "".join([self._add(int(t)) for t in token_ids])

    def _add(self, token: int) -> str:
        self._outputs.append(token)
        before = self._window_text
        self._window.append(token)
        text = self._decode(self._window)
        new = text[len(self._prefix_text) :]
        if not new.endswith(REPLACEMENT_CHAR):
            piece = new[self._held :]
            self._settle()
            return self._emit(piece)
        own = self._decode([token])
        if own and before + own == text:
            # A cut before ``token`` can no longer change: what precedes it is final, the window restarts.
            piece = before[len(self._prefix_text) + self._held :]
            self._window, self._read, self._prefix_text, self._window_text = [token], 0, "", own
            stable = own.rstrip(REPLACEMENT_CHAR)
            self._held = len(stable)
            return self._emit(piece + stable)
        if not own and text == before:
            self._window.pop()  # no text of its own, none in context: it changes nothing
            return ""
        # Ends in an incomplete character: emit what precedes it, keep the rest for later.
        self._window_text = text
        stable = new.rstrip(REPLACEMENT_CHAR)
        piece = stable[self._held :]
        self._held = max(self._held, len(stable))
        return self._emit(piece)

    def flush(self) -> str:
        """At the end of generation: whatever was held back (may contain ``'\\ufffd'``)."""
        if self._read == len(self._window) and not self._held:
            return ""
        piece = self._window_text[len(self._prefix_text) + self._held :]
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
        return list(self._outputs)


class StopStringMatcher:
    """Finds stop strings in streamed text; holds back the tail that could still begin a stop string.

    The stop whose occurrence starts earliest in the whole text wins (of two starting at the same
    place, the shorter one), however the text is split into feeds: a match is only reported once
    no stop string starting earlier can still complete.

    Linear in the text fed: each stop string has its own Knuth-Morris-Pratt automaton
    (:class:`_StopAutomaton`), which sees every character once; what is held back is the longest
    suffix of the text that is a proper prefix of some stop, kept as pieces (:class:`_Tail`), never
    re-scanned. Nothing costs in proportion to a stop string's length until that much text has come.
    """

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        if isinstance(stops, str):
            stops = [stops]
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once stopped
        self._automata = [_StopAutomaton(s) for s in self.stops]
        self._firsts = frozenset(s[0] for s in self.stops)
        self._tail = _Tail()  # the text from _emitted to _fed
        self._fed = 0  # characters fed so far
        self._emitted = 0  # of them, returned by feed
        self._best: tuple[int, int, str] | None = None  # earliest complete occurrence: (start, end, stop)

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit now, stopped)``. On a stop the text runs up to the start of
        the stop string (through its end with ``include_stop_str``); later feeds return ``("", True)``."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        base = self._fed
        self._fed += len(text)
        if self._emitted == base and self._firsts.isdisjoint(text):
            # Nothing held (no stop begun) and no stop can begin in ``text``: every automaton is, or
            # would return to, its start (one left at the end of a complete stop does so at its next
            # character, which is what it would have done here).
            self._emitted = self._fed
            return text, False
        self._tail.append(text)
        for automaton in self._automata:
            if not automaton.state and automaton.first not in text:
                continue  # at its start, and its stop cannot begin in ``text``
            end = automaton.feed(text)
            if end >= 0:
                found = (base + end - len(automaton.stop), base + end, automaton.stop)
                if self._best is None or found[:2] < self._best[:2]:
                    self._best = found
        hold_from = self._fed - max((a.partial() for a in self._automata if a.state), default=0)
        if self._best is not None and self._best[0] <= hold_from:
            start, end, stop = self._best
            self.stopped, self.matched = True, stop
            out = self._tail.take((end if self.include_stop_str else start) - self._emitted)
            self._tail = _Tail()
            return out, True
        out = self._tail.take(hold_from - self._emitted)
        self._emitted = hold_from
        return out, False

    def flush(self) -> str:
        """Held-back text at the end of generation (empty once a stop matched). Text fed after it is
        matched afresh: a stop begun before the flush no longer counts."""
        if self.stopped:
            return ""
        held = self._tail.take(self._fed - self._emitted)
        self._emitted, self._best = self._fed, None
        for automaton in self._automata:
            automaton.state = 0
        return held


class OutputText:
    """One choice's output as text: its tokens detokenized incrementally (one at a time, so that a stop
    string cuts them exactly where one token per message would have), cut at the first stop string; the
    text of a stop token that ended generation (one of ``stop_token_ids``, or EOS) left out unless
    ``include_stop_str``, as vLLM does. Without a tokenizer there is no text."""

    def __init__(self, tokenizer: _Decoder | None, skip_special_tokens: bool, prompt_token_ids: Sequence[int],
                 stops: Sequence[str], include_stop_str: bool, stop_token_ids: Collection[int]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_token_ids[-8:]) \
            if tokenizer is not None else None
        self._stopper = StopStringMatcher(stops, include_stop_str)
        self._dropped = frozenset(()) if include_stop_str else frozenset(stop_token_ids)

    def feed(self, token_ids: Sequence[int], finish_reason: str | None) -> tuple[str, int, bool]:
        """``(text, used, stopped)`` for an engine message's tokens (``finish_reason``: the engine's, on its
        last message): the new text, how many of the tokens it used (fewer once a stop string matched) and
        whether a stop string matched."""
        n = len(token_ids)
        if self._detok is None:
            return "", n, False
        text = ""
        for i, token in enumerate(token_ids):
            last = finish_reason is not None and i == n - 1
            piece = "" if last and finish_reason == "stop" and token in self._dropped else self._detok.add([token])
            part, stopped = self._stopper.feed(piece + self._detok.flush() if last else piece)
            text += part
            if stopped:
                return text, i + 1, True
        if not n and finish_reason:
            part, stopped = self._stopper.feed(self._detok.flush())
            text += part
            if stopped:
                return text, 0, True
        return text + (self._stopper.flush() if finish_reason else ""), n, False


class _StopAutomaton:
    """Knuth-Morris-Pratt over one stop string. ``state`` is the length of the longest suffix of the
    text fed so far that is a prefix of the stop (the whole stop right after an occurrence). The
    prefix function (``_pi[k - 1]``: the longest proper border of ``stop[:k]``) is computed lazily,
    only as far as the states reached: the work is linear in the text fed, whatever the stop's length.
    Runs of text are skipped or matched with ``str.find``/``str.startswith`` where they can be."""

    __slots__ = ("stop", "first", "_pi", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.first = stop[0]
        self._pi = [0]
        self.state = 0

    def _border(self, k: int) -> int:
        """The longest proper border of ``stop[:k]`` (1 <= k <= len(stop))."""
        pi = self._pi
        if k > len(pi):
            s, j = self.stop, pi[-1]
            for i in range(len(pi), k):
                c = s[i]
                while j and s[j] != c:
                    j = pi[j - 1]
                if s[j] == c:
                    j += 1
                pi.append(j)
        return pi[k - 1]

    def partial(self) -> int:
        """The length of the longest suffix of the text that is a proper prefix of the stop."""
        return self.state if self.state < len(self.stop) else self._border(self.state)

    def feed(self, text: str) -> int:
        """Advance over ``text``; the offset in it just past the first occurrence of the stop that ends
        in it, else -1."""
        s, n, size = self.stop, len(text), len(self.stop)
        m, i, first = self.state, 0, -1
        window = 8  # compare this many characters at once; 0 after a failed try, until its mismatch
        while i < n:
            if m == size:
                m = self._border(size)
            if m == 0:
                j = text.find(self.first, i)
                if j < 0:
                    break
                i, m, window = j + 1, 1, 8
            elif window and text.startswith(s[m : m + (r := min(size - m, n - i, window))], i):
                i, m, window = i + r, m + r, 2 * window
            else:
                c = text[i]
                i += 1
                if s[m] == c:
                    m, window = m + 1, 0  # the window's mismatch is further on
                else:
                    m = self._border(m)
                    while m and s[m] != c:
                        m = self._border(m)
                    if s[m] == c:
                        m += 1
                    window = 8
            if m == size and first < 0:
                first = i
        self.state = m
        return first


class _Tail:
    """Text held back, as the pieces it came in: appending costs nothing and taking from the front
    costs what it takes, however long the rest."""

    __slots__ = ("_pieces", "_offset")

    def __init__(self) -> None:
        self._pieces: deque[str] = deque()
        self._offset = 0  # into _pieces[0]

    def append(self, text: str) -> None:
        if text:
            self._pieces.append(text)

    def take(self, count: int) -> str:
        """Remove and return the first ``count`` characters."""
        out = []
        while count > 0:
            piece, offset = self._pieces[0], self._offset
            if len(piece) - offset <= count:
                out.append(piece[offset:] if offset else piece)
                count -= len(piece) - offset
                self._pieces.popleft()
                self._offset = 0
            else:
                out.append(piece[offset : offset + count])
                self._offset += count
                count = 0
        return "".join(out)
