"""A streamed Response (``POST /v1/responses`` with ``stream: true``): the Server-Sent Events OpenAI's
clients consume (``responses.create(stream=True)``, ``responses.stream``), from the chat generation's
deltas.

``response.created`` and ``response.in_progress`` first; then each output item in turn: a ``reasoning``
item (``response.reasoning_text.delta``), a ``message`` item (``output_item.added``,
``content_part.added``, ``output_text.delta``..., ``output_text.done``, ``content_part.done``,
``output_item.done``), a ``function_call`` item per call (``function_call_arguments.delta``...,
``.done``); last ``response.completed`` with the whole output and the usage (its status ``incomplete``
when ``max_output_tokens`` cut it: the clients and agent loops wait for that event, as vLLM sends it).
Every event carries its ``sequence_number``; a choice that fails is an ``error`` event followed by
``response.failed``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from epserve.router.choices import ChoiceDone, ChoiceEvent, ChoiceFailed
from epserve.router.errors import ENGINE_ABORTED, APIError, unavailable
from epserve.router.responses import (
    ResponsesRequest,
    call_item,
    finished,
    item_id,
    message_item,
    reasoning_item,
    response_head,
    usage,
)
from epserve.router.streaming import stream_error

if TYPE_CHECKING:
    from epserve.router.generation import Generation

logger = logging.getLogger(__name__)

_ABORTED = "abort"  # (the engine's finish reason for a request it stopped: generation.ABORTED)


class ResponseEvents:
    """One streamed Response's events; :meth:`events` is the ``Generation.stream`` shape."""

    def __init__(self, req: ResponsesRequest, run: Generation, response_id: str, created: float) -> None:
        self.req, self.run = req, run
        self.head = response_head(req, response_id, created, run.ctx.model_name, "in_progress")
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the items done
        self.open: dict[str, Any] | None = None  # the item being streamed (its text or arguments so far)
        self.calls: dict[int, dict[str, Any]] = {}  # a call's index in the choice -> its item

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def events(self, queue: asyncio.Queue[ChoiceEvent], tasks: list[asyncio.Task]) -> AsyncIterator[str]:
        finish: str | None = None
        try:
            yield self._event("response.created", response=self.head)
            yield self._event("response.in_progress", response=self.head)
            while True:
                event = await queue.get()
                if isinstance(event, ChoiceDone):
                    break
                if isinstance(event, ChoiceFailed):
                    for text in self._failed(stream_error(event.error, self.run.id)):
                        yield text
                    return
                delta = event.delta
                if delta.finish_reason == _ABORTED:
                    logger.warning("request %s: the engine aborted it", self.run.id)
                    for text in self._failed(unavailable(ENGINE_ABORTED)):
                        yield text
                    return
                if delta.reasoning:
                    for text in self._text("reasoning", delta.reasoning):
                        yield text
                if delta.text:
                    for text in self._text("message", delta.text):
                        yield text
                for call in delta.tool_calls:
                    for text in self._call(call):
                        yield text
                finish = delta.finish_reason or finish
            for text in self._close():
                yield text
            done = finished(self.head, finish)  # (an incomplete one too: what the clients wait for, as vLLM's)
            yield self._event("response.completed", response={**done, "output": self.output, "usage": usage(self.run)})
        finally:  # also when the client went away: cancel the engine request
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _failed(self, err: APIError) -> list[str]:
        error = err.body()["error"]
        return [self._event("error", code=error["code"], message=error["message"], param=error["param"]),
                self._event("response.failed", response={**self.head, "status": "failed", "output": self.output,
                                                         "error": {"code": error["code"] or "server_error",
                                                                   "message": error["message"]}})]

    # ---- items --------------------------------------------------------------------------------------
    def _index(self) -> int:
        return len(self.output)

    def _text(self, kind: str, piece: str) -> list[str]:
        """Text of a reasoning or message item, opening it first when another item is open (or none)."""
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            out += self._open_text(kind)
        item, index = self.open, self._index()
        assert item is not None
        item["text"] += piece
        if kind == "message":
            out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                   content_index=0, delta=piece, logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                                   content_index=0, delta=piece))
        return out

    def _open_text(self, kind: str) -> list[str]:
        index = self._index()
        if kind == "message":
            self.open = {"type": kind, "id": item_id("msg"), "text": ""}
            added = {**message_item(self.open["id"], "", "in_progress"), "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [self._event("response.output_item.added", output_index=index, item=added),
                    self._event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                content_index=0, part=part)]
        self.open = {"type": kind, "id": item_id("rs"), "text": ""}
        added = {**reasoning_item(self.open["id"], ""), "content": [], "status": "in_progress"}
        return [self._event("response.output_item.added", output_index=index, item=added)]

    def _call(self, call: dict[str, Any]) -> list[str]:
        """A piece of a tool call (a chat delta's ``tool_calls`` entry): its first opens its item."""
        out: list[str] = []
        function = call.get("function") or {}
        item = self.calls.get(call["index"])
        if item is None:
            out += self._close()
            item = self.calls[call["index"]] = self.open = {
                "type": "function_call", "id": item_id("fc"), "call_id": call.get("id") or item_id("call"),
                "name": function.get("name", ""), "text": ""}
            added = call_item(item["id"], item["call_id"], item["name"], "", "in_progress")
            out.append(self._event("response.output_item.added", output_index=self._index(), item=added))
        arguments = function.get("arguments") or ""
        if arguments:
            item["text"] += arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index(), delta=arguments))
        return out

    def _close(self) -> list[str]:
        """The open item's done events; it joins the output."""
        item, index = self.open, self._index()
        if item is None:
            return []
        self.open = None
        text = item["text"]
        if item["type"] == "message":
            done = message_item(item["id"], text)
            part = done["content"][0]
            out = [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[]),
                   self._event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=part)]
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            out = [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=text)]
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text)
            out = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=text)]
        self.output.append(done)
        out.append(self._event("response.output_item.done", output_index=index, item=done))
        return out
