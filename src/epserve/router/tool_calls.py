"""Tool-call parsers: DeepSeek's tool-call text turned into OpenAI ``tool_calls``.

DeepSeek models write their calls as one block of added tokens (not marked special in DeepSeek's tokenizers:
they survive ``skip_special_tokens``) after any text, and stop::

    text<｜tool▁calls▁begin｜>CALL CALL ...<｜tool▁calls▁end｜><｜end▁of▁sentence｜>

(``｜`` is U+FF5C FULLWIDTH VERTICAL LINE, ``▁`` U+2581 LOWER ONE EIGHTH BLOCK), each call being

- ``deepseek_v3`` (V3, R1; calls separated by ``\\n`` in the chat template)::

      <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>

- ``deepseek_v31`` (V3.1; no separator)::

      <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>

The ``--tool-call-parser`` names are vLLM's. ``extract`` parses a whole output, ``feed``/``flush``
a stream split anywhere; both run the same grammar, so the stream's events, accumulated as the
``openai`` client does (content concatenated, each call's ``function.arguments`` concatenated by
``index``), give exactly what ``extract`` gives for the whole text (ids aside: each call gets a fresh
one, vLLM's ``chatcmpl-tool-<32 hex>``). The choices, where the formats leave room:

- Content is the text before ``<｜tool▁calls▁begin｜>``, verbatim (vLLM's); the block is recognized
  only by that marker. What follows ``<｜tool▁calls▁end｜>`` is dropped (vLLM and SGLang drop it: the
  model ends there; it is only the end-of-sentence token when special tokens are not skipped).
- Arguments are the model's text, verbatim: not re-serialized, not checked. Invalid JSON is passed
  on as generated, as OpenAI's API does; the client validates. DeepSeek-V3's code fence around them
  is not part of them: the opening line ends the name, and a closing newline and three backticks
  (or the backticks alone) before the call's end are removed.
- A name is streamed once it is complete, in the call's first delta (``index``, ``id``, ``type``,
  ``function.name``, empty ``arguments``); the arguments follow as they come, holding back only a
  tail that may begin the call's end (and, for V3, the closing fence).
- A call may also end at the next ``<｜tool▁call▁begin｜>`` or at ``<｜tool▁calls▁end｜>`` when the
  model skips its ``<｜tool▁call▁end｜>``.
- Missing end markers (output cut by ``max_tokens``): a call whose name is complete is kept, with the
  arguments generated so far, since a stream has already sent them, less the tail a stream holds back
  (what may begin the call's end: a partial marker, V3's closing fence; no fence is stripped there).
  A marker spelled in bytes and cut inside a character ends in U+FFFD: that counts as the marker's next
  character (``held_len``), so no piece of a marker, nor the replacement character, reaches the
  arguments; before the block, a tail that may begin ``<｜tool▁calls▁begin｜>`` is dropped when the output
  was cut (``flush(cut=True)``, ``extract(text, cut=True)``) or the tail ends in a cut character, and
  is content when the model ended there itself.
  A call cut before its name is complete is dropped, as is a partial marker between calls.
- A block that breaks the format (text other than whitespace where a call or the block's end should
  be; a marker inside a call's name; an empty name) is not guessed at: the calls before stand, and
  the rest of the output, from the broken call's ``<｜tool▁call▁begin｜>`` (or the stray text) on,
  becomes content, markers and all, so nothing the model wrote is lost silently.

For constrained decoding (``tool_choice`` required or named) each parser also gives the exact text
around a call's arguments, ``call_prefix(name)`` and ``call_suffix()``, and the block's
``block_begin``/``call_separator``/``block_end``: a call to ``NAME`` is
``block_begin + call_prefix(NAME) + <JSON by its schema> + call_suffix() + block_end``; ``render``
writes a whole block that way. Generation with tools free to choose triggers on ``block_begin``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence

from epserve.router.detokenize import REPLACEMENT_CHAR
from epserve.router.reasoning import partial_suffix_len
from epserve.router.tool_call_events import ContentDelta, ToolCall, ToolCallDelta, ToolCallEvent

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
_ARGS_ENDS = (CALL_END, CALL_BEGIN, CALLS_END)  # what ends a call's arguments
_MAX_MARKER = max(len(m) for m in MARKERS)

# The stream's states: text before the block; between calls; a call's header (V3's type), name and
# arguments; after the block (dropped); after a broken block (passed on as content).
_TEXT, _BETWEEN, _HEADER, _NAME, _ARGS = "text", "between", "header", "name", "args"
_DONE, _RAW = "done", "raw"


def make_tool_call_id() -> str:
    """A fresh call id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _first(text: str, patterns: Iterable[str], start: int = 0) -> tuple[int, str]:
    """The earliest occurrence at or after ``start`` of any pattern: ``(position, pattern)``, or
    ``(-1, "")``. (No marker contains another, so the earliest found in a prefix of the text stays
    the earliest in the whole text.)"""
    best, which = -1, ""
    for p in patterns:
        i = text.find(p, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, p
    return best, which


def held_len(text: str, patterns: Iterable[str]) -> int:
    """Length of the tail of ``text`` that may begin one of ``patterns`` (a proper prefix of one: a stream
    holds it back; a cut output drops it). A trailing run of U+FFFD, the detokenizer's spelling of a
    character whose bytes were cut off, counts as the pattern's next character when that one is not ASCII
    (``<｜tool▁call`` + U+FFFD: a marker spelled in bytes, cut inside ``▁``)."""
    stem = text.rstrip(REPLACEMENT_CHAR)
    if len(stem) == len(text):
        return partial_suffix_len(text, patterns)
    best = -1
    for p in patterns:
        for k in range(min(len(p) - 1, len(stem)), best, -1):
            if ord(p[k]) >= 0x80 and stem.endswith(p[:k]):
                best = k
                break
    return best + len(text) - len(stem) if best >= 0 else 0


def _cut_marker(rest: str) -> bool:
    """Whether ``rest`` (between calls, whitespace stripped) may still become a call or the block's end."""
    return not rest or held_len(rest, (CALL_BEGIN, CALLS_END)) == len(rest)


def _dropped_at_end(held: str, cut: bool) -> bool:
    """Whether a held tail before the block (the beginning of ``<｜tool▁calls▁begin｜>``) is left out when
    the output ends there: when the output was cut (``max_tokens``), or the tail ends in a character cut
    short (a marker spelled in bytes, cut inside one); else it is text the model ended with."""
    return bool(held) and (cut or held.endswith(REPLACEMENT_CHAR))


class DeepSeekToolParser:
    """The DeepSeek block grammar, for whole outputs and streams; the subclasses set a call's layout.
    One instance per response (per choice): ``feed`` keeps the stream's state, ``extract`` none."""

    name = ""
    header_end = ""  # ends a header before the name ("" when the name follows the call's begin)
    name_end = ""  # ends the name
    fences: tuple[str, ...] = ()  # closings stripped from the end of the arguments
    call_separator = ""
    block_begin, block_end = CALLS_BEGIN, CALLS_END

    def __init__(self, make_id: Callable[[], str] = make_tool_call_id) -> None:
        self.make_id = make_id
        self._calls: list[tuple[str, str, list[str]]] = []  # streamed: id, name, argument pieces
        self._state = _TEXT
        self._buf = ""  # text not yet consumed (a held tail, or a call up to its name)
        self._mark = 0  # where, in _buf, the field being read starts
        self._scan = 0  # where, in _buf, a marker may still start
        self._hold = _ARGS_ENDS + tuple(f + m for f in self.fences for m in _ARGS_ENDS)  # arguments' tail

    # -- grammar ---------------------------------------------------------------------------------
    def call_prefix(self, name: str) -> str:
        raise NotImplementedError

    def call_suffix(self) -> str:
        raise NotImplementedError

    def render(self, calls: Sequence[tuple[str, str]]) -> str:
        """The block for ``(name, arguments)`` pairs, as the chat template writes it."""
        body = self.call_separator.join(self.call_prefix(n) + a + self.call_suffix() for n, a in calls)
        return self.block_begin + body + self.block_end

    def _name_fields(self) -> list[tuple[str, tuple[str, ...]]]:
        """The fields from a call's begin to its arguments: (terminator, markers that break it)."""
        ends = (self.header_end, self.name_end) if self.header_end else (self.name_end,)
        return [(end, tuple(m for m in MARKERS if m != end)) for end in ends]

    def _strip_fence(self, args: str) -> str:
        for fence in self.fences:
            if args.endswith(fence):
                return args[: -len(fence)]
        return args

    # -- whole responses -------------------------------------------------------------------------
    def extract(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output; content is ``None`` when empty. ``cut``: the output
        ended at ``max_tokens`` (as ``flush``)."""
        start = text.find(CALLS_BEGIN)
        if start < 0:  # (less a cut marker at the end, as a stream leaves it out)
            held = held_len(text, (CALLS_BEGIN,))
            text = text[: len(text) - held] if _dropped_at_end(text[len(text) - held :], cut) else text
            return text or None, []
        content, calls = text[:start], []
        pos = start + len(CALLS_BEGIN)
        while True:
            rest = text[pos:].lstrip()
            call_start = len(text) - len(rest)
            if not rest.startswith(CALL_BEGIN):
                if not (rest.startswith(CALLS_END) or _cut_marker(rest)):
                    content += rest  # stray text: the block is broken
                break
            pos = call_start + len(CALL_BEGIN)
            broken = False
            for end, breaks in self._name_fields():
                at, which = _first(text, (end, *breaks), pos)
                if at < 0:
                    return content or None, calls  # cut before the name is complete
                field, pos = text[pos:at], at + len(which)
                broken = which != end
                if broken:
                    break
            name = field.strip()
            if broken or not name:
                content += text[call_start:]
                break
            at, which = _first(text, _ARGS_ENDS, pos)
            if at >= 0:
                args = self._strip_fence(text[pos:at])
            else:  # cut in the arguments: what a stream sent, less a tail that may begin the call's end
                args = text[pos:]
                args = args[: len(args) - held_len(args, self._hold)]
            calls.append(ToolCall(self.make_id(), name, args))
            if at < 0 or which == CALLS_END:
                break
            pos = at + len(CALL_END) if which == CALL_END else at
        return content or None, calls

    # -- streams ---------------------------------------------------------------------------------
    @property
    def streamed_calls(self) -> list[ToolCall]:
        """The calls streamed so far, with their arguments so far."""
        return [ToolCall(id_, name, "".join(pieces)) for id_, name, pieces in self._calls]

    @property
    def tools_called(self) -> bool:
        """Whether the stream has begun a call (the choice then finishes with ``tool_calls``)."""
        return bool(self._calls)

    def feed(self, delta: str) -> list[ToolCallEvent]:
        """Events for the next piece of the output (possibly none)."""
        self._buf += delta
        events: list[ToolCallEvent] = []
        while self._step(events):
            pass
        return events

    def flush(self, cut: bool = False) -> list[ToolCallEvent]:
        """Once, at the end of the output: held text before the block is content, unless the output was
        ``cut`` (``max_tokens``) or it ends in a character cut short (a piece of a marker, then); a partial
        marker or an unfinished name inside the block is dropped."""
        events: list[ToolCallEvent] = []
        if self._state == _TEXT and self._buf and not _dropped_at_end(self._buf, cut):
            events.append(ContentDelta(self._buf))
        self._buf, self._mark, self._scan = "", 0, 0
        self._state = _DONE
        return events

    def _content(self, events: list[ToolCallEvent], text: str) -> None:
        if text:
            events.append(ContentDelta(text))

    def _step(self, events: list[ToolCallEvent]) -> bool:
        """Consume what the state can from ``_buf``; True when the state changed (step again)."""
        buf, state = self._buf, self._state
        if state == _TEXT:
            at = buf.find(CALLS_BEGIN)
            if at < 0:
                keep = held_len(buf, (CALLS_BEGIN,))
                self._content(events, buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            self._content(events, buf[:at])
            self._buf, self._state = buf[at + len(CALLS_BEGIN) :], _BETWEEN
            return True
        if state == _BETWEEN:
            rest = buf.lstrip()
            if rest.startswith(CALL_BEGIN):
                self._buf, self._state = rest, _HEADER if self.header_end else _NAME
                self._mark = self._scan = len(CALL_BEGIN)
                return True
            if rest.startswith(CALLS_END):
                self._buf, self._state = "", _DONE
                return False
            if _cut_marker(rest):
                self._buf = rest  # whitespace dropped; a marker may be coming
                return False
            self._buf, self._state = rest, _RAW  # stray text: the block is broken
            return True
        if state in (_HEADER, _NAME):
            fields = self._name_fields()
            end, breaks = fields[0] if state == _HEADER else fields[-1]
            at, which = _first(buf, (end, *breaks), self._scan)
            if at < 0:
                self._scan = max(self._mark, len(buf) - _MAX_MARKER)
                return False
            field, after = buf[self._mark : at], at + len(which)
            if which != end or (state == _NAME and not field.strip()):
                self._state = _RAW  # a marker inside the call's head, or an empty name
                return True
            if state == _HEADER:
                self._state, self._mark = _NAME, after
                self._scan = after
                return True
            self._calls.append((self.make_id(), field.strip(), []))
            events.append(ToolCallDelta(len(self._calls) - 1, "", *self._calls[-1][:2]))
            self._buf, self._state = buf[after:], _ARGS
            return True
        if state == _ARGS:
            at, which = _first(buf, _ARGS_ENDS)
            if at < 0:
                keep = held_len(buf, self._hold)
                self._args(events, buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            self._args(events, self._strip_fence(buf[:at]))
            if which == CALLS_END:
                self._buf, self._state = "", _DONE
                return False
            self._buf = buf[at + len(CALL_END) :] if which == CALL_END else buf[at:]
            self._state = _BETWEEN
            return True
        if state == _RAW:
            self._content(events, buf)
        self._buf = ""  # _RAW passed on, _DONE dropped
        return False

    def _args(self, events: list[ToolCallEvent], piece: str) -> None:
        if piece:
            self._calls[-1][2].append(piece)
            events.append(ToolCallDelta(len(self._calls) - 1, piece))


class DeepSeekV3ToolParser(DeepSeekToolParser):
    """DeepSeek-V3/R1: ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
    <｜tool▁call▁end｜>`` (one line), calls joined by ``\\n``. The type before the separator (always
    ``function``) is not checked."""

    name = "deepseek_v3"
    header_end = SEP
    name_end = "\n```json\n"
    fences = ("\n```", "```")
    call_separator = "\n"

    def call_prefix(self, name: str) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n"

    def call_suffix(self) -> str:
        return f"\n```{CALL_END}"


class DeepSeekV31ToolParser(DeepSeekToolParser):
    """DeepSeek-V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``, calls back to back."""

    name = "deepseek_v31"
    name_end = SEP

    def call_prefix(self, name: str) -> str:
        return f"{CALL_BEGIN}{name}{SEP}"

    def call_suffix(self) -> str:
        return CALL_END


TOOL_CALL_PARSERS: dict[str, type[DeepSeekToolParser]] = {
    DeepSeekV3ToolParser.name: DeepSeekV3ToolParser,
    DeepSeekV31ToolParser.name: DeepSeekV31ToolParser,
}
