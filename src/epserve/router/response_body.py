"""A generation's whole (not streamed) OpenAI response body: as one dict for a small one, or as JSON
pieces, one choice at a time, for a large one (:meth:`ResponseBody.body_parts`), which the server builds
on a worker thread and sends as they come: its event loop never holds a large body's building (logprobs
decoded token by token, prompt logprobs, the JSON text) and it never holds the whole body at once.
Either way the bytes say the same JSON.

What the body costs to build is told ahead by :meth:`ResponseBody.response_cost` (logprob entries and
text characters, the units ``LARGE_COST`` counts)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from epserve.router.choices import Choice
from epserve.router.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from epserve.router.output_options import OutputOptions
from epserve.router.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from epserve.tokenizer import Tokenizer

LARGE_COST = 4096  # logprob entries (or 64 text characters each): more is built off the event loop
TEXT_CHARS_PER_ENTRY = 64


def dumps(obj: Any) -> bytes:
    """JSON as the server's JSONResponse writes it."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def logprob_entries(params_logprobs: int | None, num_tokens: int) -> int:
    """How many token entries ``num_tokens`` tokens' logprobs hold (each with its top ones)."""
    return 0 if params_logprobs is None else num_tokens * (1 + params_logprobs)


def client_finish(reason: str | None, choice: Choice) -> str | None:
    """The finish reason the client sees: ``tool_calls`` for a choice that stopped after calling tools."""
    return "tool_calls" if reason == "stop" and choice.tool_calls else reason


class _Context(Protocol):
    """What a body needs of the generation's ``GenerationContext``."""

    tokenizer: Tokenizer | None
    model_name: str
    reasoning_parser: str | None
    output: OutputOptions


class ResponseBody:
    """The whole-body half of :class:`~epserve.router.generation.Generation` (its state: ``ctx``, ``req``,
    ``choices``, ``id``, ``created``, ``echo``, ``as_ids``)."""

    ctx: _Context
    req: CompletionRequest | ChatCompletionRequest
    choices: list[Choice]
    id: str
    created: int
    echo: str
    as_ids: bool

    def usage(self, sent: list[int] | None = None) -> dict[str, Any]:
        """The usage; ``sent``: each choice's output tokens streamed so far, instead of all it generated."""
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.first_of_prompt)
        cached = sum(c.num_cached for c in self.choices if c.first_of_prompt)
        completion = sum(sent) if sent is not None else sum(c.num_output for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def response_cost(self, chat: bool) -> int:
        """What building the body costs, in logprob entries (text: ``TEXT_CHARS_PER_ENTRY`` characters
        an entry); read from the choices' lengths, nothing built."""
        cost = 0
        for c in self.choices:
            cost += logprob_entries(c.params.logprobs, len(c.token_ids)) + sum(map(len, c.text)) // TEXT_CHARS_PER_ENTRY
            if self.req.prompt_logprobs is not None and (not chat or c.index == 0):
                cost += logprob_entries(self.req.prompt_logprobs, len(c.prompt_ids))
        return cost

    def response(self, chat: bool) -> dict[str, Any]:
        """The body as one dict."""
        body = self._head(chat)
        body.update(choices=[self._choice_body(c, chat) for c in self.choices], **self._tail(chat))
        return body

    def body_parts(self, chat: bool) -> Iterator[bytes]:
        """The body as JSON text in pieces: the head, then one choice at a time, then the usage (the same
        JSON as ``dumps(self.response(chat))``)."""
        yield dumps(self._head(chat))[:-1] + b',"choices":['
        for i, c in enumerate(self.choices):
            yield (b"," if i else b"") + dumps(self._choice_body(c, chat))
        yield b"]," + dumps(self._tail(chat))[1:]

    def _head(self, chat: bool) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion" if chat else "text_completion", "created": self.created,
                "model": self.ctx.model_name}

    def _tail(self, chat: bool) -> dict[str, Any]:
        tail: dict[str, Any] = {"usage": self.usage()}
        if chat and self.req.prompt_logprobs is not None:  # vLLM puts a chat's beside its choices
            tail.update(self._prompt_logprobs(self.choices[0]))
        return tail

    def _choice_body(self, c: Choice, chat: bool) -> dict[str, Any]:
        tokenizer = self.ctx.tokenizer
        text = self.echo + "".join(c.text)
        logprobs, as_ids = None, self.as_ids
        if c.params.logprobs is not None and tokenizer is not None:
            skip = self.req.skip_special_tokens
            logprobs = ({"content": chat_logprobs(tokenizer, c.token_ids, c.logprobs, as_ids)} if chat else
                        completion_logprobs(tokenizer, c.token_ids, c.logprobs, 0, skip, as_ids))
        if not chat:
            return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                    **self._prompt_logprobs(c)}
        message: dict[str, Any] = {"role": self.ctx.output.response_role, "content": text}
        if self.ctx.reasoning_parser is not None:
            message["reasoning_content"] = "".join(c.reasoning) or None
            message["content"] = text or None
        if c.tool_calls:
            message.update(content=text or None, tool_calls=[call.to_openai() for call in c.tool_calls])
        return {"index": c.index, "message": message, "logprobs": logprobs,
                "finish_reason": client_finish(c.finish_reason, c)}

    def _prompt_logprobs(self, choice: Choice) -> dict[str, Any]:
        """vLLM's ``prompt_logprobs`` field, when asked for."""
        if self.req.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(self.ctx.tokenizer, choice.prompt_ids, choice.prompt_logprobs)}
