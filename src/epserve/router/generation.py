"""One HTTP request's generations: every choice routed to an engine instance, detokenized and cut at
stop strings, then shaped as an OpenAI response body or as Server-Sent Events.

What a generation needs from the server that owns it (how to route a request, the tokenizer, the
metrics, the model's name) comes in a :class:`GenerationContext`; this module knows nothing of the
HTTP app itself. Requests arrive here already validated.

The client sees only OpenAI's finish reasons (``stop``, ``length``, ``tool_calls``): a request the
engine aborted (it was draining or restarting) is a 503 error, or in a stream an error event, and an
engine instance lost mid-request is told in general terms (its address and the details go to the log).
An engine message's text goes through the choice's stages (``text_stages``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from epserve.messages.engine import GeneratedTokens
from epserve.messages.sampling import SamplingParams, TokenLogprobs
from epserve.router.checks import stop_strings
from epserve.router.choices import Choice, ChoiceDelta, ChoiceDone, ChoiceEvent, ChoiceFailed, Delta
from epserve.router.detokenize import OutputText
from epserve.router.errors import ENGINE_ABORTED, unavailable
from epserve.router.logprobs import chat_logprobs, completion_logprobs
from epserve.router.output_options import OutputOptions
from epserve.router.protocol import ChatCompletionRequest, CompletionRequest
from epserve.router.response_body import (
    LARGE_COST,
    TEXT_CHARS_PER_ENTRY,
    ResponseBody,
    client_finish,
    logprob_entries,
)
from epserve.router.streaming import gather_or_raise, sse, start_in_batches, stream_error, until_disconnect
from epserve.router.text_stages import ExtractToolCalls, TextPiece, TextStage, run_stages, text_stages

if TYPE_CHECKING:
    from epserve.router.metrics import RouterMetrics
    from epserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A stream's Server-Sent Events from its choices' events (queue, their tasks): see ``Generation.stream``.
EventsShape = Callable[[asyncio.Queue[ChoiceEvent], list[asyncio.Task]], AsyncIterator[str]]

ABORTED = "abort"  # the engine's finish reason for a request it stopped; never sent to the client


@dataclass(frozen=True)
class GenerationContext:
    """What every generation of one server shares, built once by that server."""

    # Route and stream one engine request: (request id, prompt token ids, params) -> engine messages.
    # Closing the iterator cancels the request; raises EngineUnavailable or EngineRequestError.
    generate: Callable[[str, list[int], SamplingParams], AsyncIterator[GeneratedTokens]]
    tokenizer: Tokenizer | None
    metrics: RouterMetrics
    model_name: str
    reasoning_parser: str | None = None  # ``--reasoning-parser`` (chat): reasoning_content apart from content
    output: OutputOptions = OutputOptions()  # vLLM's --response-role, --return-tokens-as-token-ids, --max-logprobs
    # Runs a function off the event loop (a worker thread) and awaits its result: a large chunk's building.
    offload: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None


class Generation(ResponseBody):
    """One HTTP request's choices, run concurrently; its whole body (``ResponseBody``) or its stream."""

    def __init__(self, ctx: GenerationContext, req: CompletionRequest | ChatCompletionRequest,
                 choices: list[Choice], request_id: str, tool_parser: str | None = None,
                 thinking: bool = False) -> None:
        self.ctx = ctx
        self.thinking = thinking  # chat, with a reasoning parser: the output starts inside the reasoning
        self.tool_parser = tool_parser  # chat: the output is read for calls in that format (``router/tools``)
        self.req = req
        self.choices = choices
        self.id = request_id  # the response's (a client's request_id in it: the engine's ids stay unique)
        self._engine_id = request_id if req.request_id is None else f"{request_id}-{uuid.uuid4().hex[:12]}"
        chat = isinstance(req, ChatCompletionRequest)
        self.include_reasoning = not chat or req.include_reasoning  # type: ignore[union-attr]
        self.echo = req.echoed() if chat else ""  # type: ignore[union-attr]  # (vLLM's chat echo)
        self.as_ids = ctx.output.as_ids(req)  # logprobs' tokens as token_id:<id>
        self.created = int(time.time())
        self.arrival = time.monotonic()
        self._started: set[int] = set()  # choices whose first chunk was streamed
        self._sent = [0] * len(choices)  # each choice's output tokens streamed so far

    # ---- one choice ----------------------------------------------------------------------------
    async def deltas(self, choice: Choice) -> AsyncIterator[Delta]:
        ctx, req = self.ctx, self.req
        metrics = ctx.metrics
        last = None
        rid = f"{self._engine_id}-{choice.index}"
        echo = self._echo if isinstance(req, CompletionRequest) and req.echo else None
        stages = self._stages(choice)
        tools = next((s for s in stages if isinstance(s, ExtractToolCalls)), None)
        try:
            async with contextlib.aclosing(ctx.generate(rid, choice.prompt_ids, choice.params)) as stream:
                async for msg in stream:
                    now = time.monotonic()
                    if msg.prompt_logprobs:
                        choice.prompt_logprobs = [None, *msg.prompt_logprobs]  # (as they came: read when sent)
                    if echo is not None:  # the prompt first: its text, and its logprobs when asked
                        large = self.ctx.offload is not None and len(choice.prompt_ids) > LARGE_COST
                        yield await self.ctx.offload(functools.partial(echo, choice)) if large else echo(choice)
                        echo = None
                    n = len(msg.token_ids)
                    if n:
                        if last is None:
                            metrics.ttft.observe(now - self.arrival)
                            times = msg.times if msg.times is not None and msg.times.prefill_s else None
                            choice.engine_times = (times.queued_s, times.prefill_s) if times is not None else None
                        else:
                            for _ in range(n):
                                metrics.itl.observe((now - last) / n)
                        last = now
                    choice.num_cached = msg.num_cached_tokens
                    piece = run_stages(stages, TextPiece(msg.token_ids, msg.finish_reason))
                    used, finish = len(piece.token_ids), piece.finish_reason
                    choice.num_output = msg.num_output_tokens - (n - used)
                    lps = [_logprob(lp) for lp in msg.logprobs[:used]]
                    if finish and tools is not None:
                        choice.tool_calls = tools.calls
                    delta = Delta(piece.text, list(piece.token_ids), lps, finish, piece.reasoning,
                                  list(piece.tool_calls), choice.num_output)
                    choice.text.append(piece.text)
                    choice.reasoning.append(piece.reasoning)
                    choice.token_ids.extend(delta.token_ids)
                    choice.logprobs.extend(lps)
                    if finish:
                        choice.finish_reason = finish
                        self._finished(choice, msg)
                    yield delta
                    if finish:
                        return  # leaving the stream early (a stop string) cancels the engine request
        finally:
            if choice.finish_reason is None and last is not None:  # cancelled (the client left) or cut off
                choice.finish_reason = ABORTED
                self._finished(choice)

    def _stages(self, choice: Choice) -> list[TextStage]:
        """A choice's text stages. A chat choice's reasoning parser starts inside the reasoning when the
        rendered prompt left a ``<think>`` open (R1's template, V3.1's thinking mode: ``thinking``, told by
        the server); its tool-call parser reads the calls in that format (``router/tools``)."""
        ctx, req, tokenizer = self.ctx, self.req, self.ctx.tokenizer
        stop_ids = (*choice.params.stop_token_ids, *((tokenizer.eos_token_id,) if tokenizer is not None else ()))
        output = OutputText(tokenizer, req.skip_special_tokens, choice.prompt_ids, stop_strings(req),
                            req.include_stop_str_in_output, stop_ids)
        chat = isinstance(req, ChatCompletionRequest)
        reasoning = ctx.reasoning_parser if chat and tokenizer is not None else None
        single = getattr(req, "parallel_tool_calls", None) is False  # (then the first call only)
        return text_stages(output, reasoning, self.thinking, self.include_reasoning, self.tool_parser, single)

    def _echo(self, choice: Choice) -> Delta:
        """A completion's echoed prompt, as the choice's first delta (its logprobs when asked for)."""
        tokenizer = self.ctx.tokenizer
        text = choice.prompt_text
        if text is None and tokenizer is not None:
            text = tokenizer.decode(choice.prompt_ids, skip_special_tokens=self.req.skip_special_tokens)
        text = text or ""
        want = choice.params.logprobs is not None
        logprobs = list(choice.prompt_logprobs or [None] * len(choice.prompt_ids)) if want else []
        delta = Delta(text, list(choice.prompt_ids) if want else [], logprobs, None)  # type: ignore[arg-type]
        choice.text.append(text)
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(logprobs)  # type: ignore[arg-type]
        return delta

    def _finished(self, choice: Choice, msg: GeneratedTokens | None = None) -> None:
        """Counts it; ``msg``: its last engine message (with the engine's times if the engine finished it)."""
        n = self.req.n  # a prompt's choices: n in a row
        group = self.choices[choice.index - choice.index % n:][:n]
        self.ctx.metrics.finished(choice, time.monotonic() - self.arrival,
                                  msg if msg is not None and msg.finish_reason else None,
                                  group if all(c.finish_reason for c in group) else None)

    # ---- whole responses -----------------------------------------------------------------------
    async def complete(self) -> None:
        async def drain(choice: Choice) -> None:
            async for _ in self.deltas(choice):
                pass

        await gather_or_raise([drain(c) for c in self.choices], self.id)
        if any(c.finish_reason == ABORTED for c in self.choices):
            logger.warning("request %s: the engine aborted it", self.id)
            raise unavailable(ENGINE_ABORTED)

    # ---- streaming -----------------------------------------------------------------------------
    async def stream(self, raw: Request, chat: bool, events: EventsShape | None = None) -> Response:
        """Start every choice; answer with an error status if one fails before its first message,
        else stream Server-Sent Events (``events``: their shape, instead of completion chunks; it cancels
        the choices' tasks when it ends)."""
        queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        first: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in self.choices]

        async def pump(choice: Choice) -> None:
            fut = first[choice.index]
            try:
                async for delta in self.deltas(choice):
                    if not fut.done():
                        fut.set_result(None)
                    await queue.put(ChoiceDelta(choice, delta))
            except Exception as e:
                if not fut.done():
                    fut.set_exception(e)
                else:
                    await queue.put(ChoiceFailed(choice, e))
            finally:
                await queue.put(ChoiceDone(choice))

        tasks: list[asyncio.Future] = []
        pumps = [pump(c) for c in self.choices]
        try:
            await start_in_batches(pumps, tasks)
            await until_disconnect(raw, gather_or_raise(first, self.id))
        except BaseException:
            for t in tasks:
                t.cancel()
            for p in pumps[len(tasks):]:
                p.close()
            raise
        shape = events or functools.partial(self._events, chat=chat)
        return StreamingResponse(shape(queue, tasks), media_type="text/event-stream")

    async def _events(
        self, queue: asyncio.Queue[ChoiceEvent], tasks: list[asyncio.Task], chat: bool
    ) -> AsyncIterator[str]:
        offsets = [0] * len(self.choices)
        options = self.req.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = bool(options and options.continuous_usage_stats)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.ctx.model_name}
        try:
            if chat:  # (with continuous_usage_stats, vLLM's: the usage so far in every chunk)
                usage = {"usage": self.usage(self._sent) if continuous else None} if include_usage else {}
                role = self.ctx.output.response_role
                for c in self.choices:
                    yield sse({**head, "choices": [{"index": c.index, "delta": {"role": role, "content": ""},
                                                     "logprobs": None, "finish_reason": None}], **usage,
                               **self._padding()})
                    if self.echo:
                        yield sse({**head, "choices": [{"index": c.index, "delta": {"content": self.echo},
                                                         "logprobs": None, "finish_reason": None}], **usage,
                                   **self._padding()})
            remaining = len(self.choices)
            while remaining:
                event = await queue.get()
                if isinstance(event, ChoiceDone):
                    remaining -= 1
                    continue
                if isinstance(event, ChoiceFailed):
                    yield sse(stream_error(event.error, self.id).body())
                    continue
                choice, delta = event.choice, event.delta
                if delta.finish_reason == ABORTED:
                    logger.warning("request %s: the engine aborted choice %d", self.id, choice.index)
                    delta = dataclasses.replace(delta, finish_reason=None, tool_calls=[])
                    if delta.text or delta.reasoning or delta.logprobs:
                        yield self._chunk(head, choice, delta, offsets, include_usage, chat)
                    yield sse(unavailable(ENGINE_ABORTED).body())
                    continue
                if not (delta.text or delta.reasoning or delta.tool_calls or delta.finish_reason or delta.logprobs
                        or delta.token_ids):  # new tokens whose text is held back still get a chunk (vLLM)
                    continue
                yield await self._built_chunk(head, choice, delta, offsets, include_usage, chat)
            if include_usage:
                yield sse({**head, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: cancel the engine requests
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _built_chunk(self, head: dict[str, Any], choice: Choice, delta: Delta, offsets: list[int],
                           include_usage: bool, chat: bool) -> str:
        """``_chunk``, built off the event loop (``ctx.offload``) when it is large: logprobs over many
        tokens (a completion's echoed prompt), the first chunk's prompt logprobs, much text."""
        build = functools.partial(self._chunk, head, choice, delta, offsets, include_usage, chat)
        cost = logprob_entries(choice.params.logprobs, len(delta.token_ids)) + len(delta.text) // TEXT_CHARS_PER_ENTRY
        if not chat and choice.index not in self._started:
            cost += logprob_entries(self.req.prompt_logprobs, len(choice.prompt_ids))
        if self.ctx.offload is None or cost <= LARGE_COST:
            return build()
        return await self.ctx.offload(build)

    def _chunk(self, head: dict[str, Any], choice: Choice, delta: Delta, offsets: list[int], include_usage: bool,
               chat: bool) -> str:
        """One choice's chunk event (``offsets``: text already sent per choice, for completions' logprobs)."""
        tokenizer = self.ctx.tokenizer
        logprobs = None
        if choice.params.logprobs is not None and tokenizer is not None and delta.token_ids:
            if chat:
                logprobs = {"content": chat_logprobs(tokenizer, delta.token_ids, delta.logprobs, self.as_ids)}
            else:
                logprobs = completion_logprobs(tokenizer, delta.token_ids, delta.logprobs, offsets[choice.index],
                                               self.req.skip_special_tokens, self.as_ids)
        first = choice.index not in self._started
        self._started.add(choice.index)
        self._sent[choice.index] = max(self._sent[choice.index], delta.num_output)
        offsets[choice.index] += len(delta.text)
        if chat:
            content: dict[str, Any] = {"reasoning_content": delta.reasoning} if delta.reasoning else {}
            if delta.text:
                content["content"] = delta.text
            if delta.tool_calls:
                content["tool_calls"] = delta.tool_calls
            if not content and delta.finish_reason is None:  # tokens whose text is not out yet (a UTF-8 prefix)
                content["content"] = ""
            body = {"index": choice.index, "delta": content, "logprobs": logprobs,
                    "finish_reason": client_finish(delta.finish_reason, choice)}
        else:
            body = {"index": choice.index, "text": delta.text, "logprobs": logprobs,
                    "finish_reason": delta.finish_reason, **(self._prompt_logprobs(choice) if first else {})}
        usage: dict[str, Any] = {}
        options = self.req.stream_options
        if include_usage:  # with continuous_usage_stats (vLLM), the usage so far in every chunk
            usage["usage"] = self.usage(self._sent) if options is not None and options.continuous_usage_stats else None
        return sse({**head, "choices": [body], **usage, **self._padding()})

    def _padding(self) -> dict[str, str]:
        """With ``stream_options.include_obfuscation`` (OpenAI's), a chunk's ``obfuscation`` field: random
        characters of random length, so that a chunk's size does not tell its text's."""
        options = self.req.stream_options
        if options is None or not options.include_obfuscation:
            return {}
        return {"obfuscation": secrets.token_urlsafe(secrets.randbelow(24) + 1)}


def _logprob(lp: TokenLogprobs) -> tuple[float, list[tuple[int, float]]]:
    """A token's logprob and its top ones, as a choice keeps them."""
    return lp.logprob, list(lp.top)
