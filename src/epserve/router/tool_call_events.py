"""What the tool-call parsers (``tool_calls``) give: a whole response's calls (:class:`ToolCall`), a
stream's events (:class:`ContentDelta`, :class:`ToolCallDelta`) and their OpenAI form (one chunk's
``delta``: :func:`openai_delta`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call of a whole response; ``arguments`` is the model's JSON text, unchecked."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ContentDelta:
    """Streamed text outside the calls."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: the first carries ``id`` and ``name``, the next ones arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The entry of a chunk's ``delta.tool_calls``."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function = {"name": self.name, **function}
        out["function"] = function
        return out


ToolCallEvent = ContentDelta | ToolCallDelta


def openai_delta(events: Iterable[ToolCallEvent]) -> dict[str, Any] | None:
    """One chunk's ``delta`` for ``events``: content joined, consecutive pieces of a call merged into
    one ``tool_calls`` entry; ``None`` when there is nothing to send. Content only ever precedes the
    calls or follows them (a broken block), so the order lost by merging does not change what a
    client accumulates."""
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentDelta):
            content += event.text
        elif calls and calls[-1].index == event.index and event.id is None:
            last = calls[-1]
            calls[-1] = ToolCallDelta(last.index, last.arguments + event.arguments, last.id, last.name)
        else:
            calls.append(event)
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [c.to_openai() for c in calls]
    return delta or None
