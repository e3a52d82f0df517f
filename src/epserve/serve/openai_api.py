"""The OpenAI-compatible HTTP API of the router (FastAPI on uvicorn).

``/v1/completions`` and ``/v1/chat/completions`` tokenize (chat: through the tokenizer's template),
route every choice (``n`` per prompt) through :class:`~epserve.serve.router.Router` to an engine
instance, detokenize incrementally and cut at stop strings here, and answer as one JSON body or as
Server-Sent Events ending with ``data: [DONE]``. A client that goes away cancels its engine requests
(the engines abort them and free their KV blocks). Errors are OpenAI-style bodies: 400 for bad input,
401 without the API key, 404 for an unknown model, 503 when no engine instance can take the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from epserve.engine.request import SamplingParams
from epserve.serve.detokenize import IncrementalDetokenizer, StopStringMatcher
from epserve.serve.engine_client import EngineRequestError, EngineUnavailable
from epserve.serve.metrics import CONTENT_TYPE, RouterMetrics
from epserve.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    check_request,
    completion_logprobs,
    not_found_model,
    resolve_max_tokens,
    stop_strings,
    to_sampling_params,
    unauthorized,
    unavailable,
    validation_error,
)
from epserve.serve.router import Router
from epserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5


@dataclass
class Delta:
    """What one engine message adds to a choice, after detokenization and stop strings."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]
    finish_reason: str | None


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    first_of_prompt: bool  # the prompt's tokens count once in usage and metrics, with this choice
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached: int = 0
    num_output: int = 0


class OpenAIServer:
    def __init__(self, router: Router, tokenizer: Tokenizer | None, model_name: str,
                 api_key: str | None = None) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = RouterMetrics(router, model_name)
        self.created = int(time.time())
        self.app = self._build_app()

    # ---- app ---------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            await self.router.start()
            yield
            await self.router.close()

        app = FastAPI(title="epserve", lifespan=lifespan)
        if self.api_key:
            app.add_middleware(_APIKeyMiddleware, key=self.api_key, reject=self._error)

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return self._error(exc)

        @app.exception_handler(Exception)
        async def internal_error(request: Request, exc: Exception) -> JSONResponse:
            logger.exception("unhandled error in %s", request.url.path)
            return self._error(APIError(f"internal error: {exc}", 500, "internal_server_error", "internal_error"))

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics_endpoint)
        return app

    def _error(self, exc: APIError) -> JSONResponse:
        self.metrics.error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    # ---- simple endpoints ---------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        card: dict[str, Any] = {"id": self.model_name, "object": "model", "created": self.created,
                                "owned_by": "epserve"}
        info = self.router.info
        if info is not None:
            card.update(root=info.model_path, max_model_len=info.max_model_len, vocab_size=info.vocab_size)
        return {"object": "list", "data": [card]}

    async def health(self) -> JSONResponse:
        healthy = [inst.address for inst in self.router.healthy]
        body = {"status": "ok" if healthy else "unavailable", "healthy_engines": healthy,
                "engines": len(self.router.instances)}
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def metrics_endpoint(self) -> Response:
        await self.router.refresh()
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ---- generation endpoints -------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        req = await self._parse(raw, CompletionRequest)
        assert isinstance(req, CompletionRequest)
        prompts = self._completion_prompts(req.prompt)
        return await self._generate(raw, req, prompts, chat=False)

    async def chat_completions(self, raw: Request) -> Response:
        req = await self._parse(raw, ChatCompletionRequest)
        assert isinstance(req, ChatCompletionRequest)
        tokenizer = self._need_tokenizer("chat completions")
        try:
            prompt = tokenizer.encode_chat(req.message_dicts())
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        return await self._generate(raw, req, [prompt], chat=True)

    async def _parse(self, raw: Request, model: type[BaseModel]) -> BaseModel:
        try:
            body = json.loads(await raw.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"The request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("The request body must be a JSON object", code="invalid_json")
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model is not None and req.model != self.model_name:  # type: ignore[attr-defined]
            raise not_found_model(req.model)  # type: ignore[attr-defined]
        check_request(req)  # type: ignore[arg-type]
        return req

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(f"{what} need a tokenizer; this model directory has none (send token ids)")
        return self.tokenizer

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self._need_tokenizer("text prompts").encode(prompt)]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        out = []
        for p in prompt:
            out.append(self._need_tokenizer("text prompts").encode(p) if isinstance(p, str) else list(p))
        return out

    def _limits(self) -> tuple[int, int]:
        info = self.router.info
        if info is None or not self.router.healthy:
            raise unavailable("No engine instance is available; try again later")
        return info.max_model_len, info.vocab_size

    async def _generate(
        self, raw: Request, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], chat: bool
    ) -> Response:
        max_model_len, vocab = self._limits()
        choices: list[Choice] = []
        for ids in prompts:
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            max_tokens = resolve_max_tokens(req, len(ids), max_model_len)
            for j in range(req.n):
                params = to_sampling_params(req, max_tokens, index=j)
                choices.append(Choice(len(choices), ids, params, first_of_prompt=j == 0))
        if stop_strings(req) and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer; this model directory has none", param="stop")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        run = _Run(self, req, choices, request_id)
        if req.stream:
            return await run.stream(raw, chat)
        await _until_disconnect(raw, run.complete())
        return JSONResponse(run.response(chat))


class _Run:
    """One HTTP request's choices, run concurrently."""

    def __init__(self, server: OpenAIServer, req: CompletionRequest | ChatCompletionRequest,
                 choices: list[Choice], request_id: str) -> None:
        self.server = server
        self.req = req
        self.choices = choices
        self.id = request_id
        self.created = int(time.time())
        self.arrival = time.monotonic()

    # ---- one choice ----------------------------------------------------------------------------
    async def deltas(self, choice: Choice) -> AsyncIterator[Delta]:
        server, req = self.server, self.req
        tokenizer = server.tokenizer
        detok = IncrementalDetokenizer(tokenizer, req.skip_special_tokens, choice.prompt_ids[-8:]) if tokenizer else None
        stopper = StopStringMatcher(stop_strings(req), req.include_stop_str_in_output)
        metrics = server.metrics
        last = None
        rid = f"{self.id}-{choice.index}"
        try:
            async with contextlib.aclosing(server.router.generate(rid, choice.prompt_ids, choice.params)) as stream:
                async for msg in stream:
                    now = time.monotonic()
                    n = len(msg.token_ids)
                    if n:
                        if last is None:
                            metrics.ttft.observe(now - self.arrival)
                        else:
                            for _ in range(n):
                                metrics.itl.observe((now - last) / n)
                        last = now
                    choice.num_cached = msg.num_cached_tokens
                    choice.num_output = msg.num_output_tokens
                    finish = msg.finish_reason or None
                    text = detok.add(msg.token_ids) if detok is not None else ""
                    if finish and detok is not None:
                        text += detok.flush()
                    emit, stopped = stopper.feed(text)
                    if stopped:
                        finish = "stop"
                    elif finish:
                        emit += stopper.flush()
                    lps = [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in msg.logprobs]
                    delta = Delta(emit, list(msg.token_ids), lps, finish)
                    choice.text.append(emit)
                    choice.token_ids.extend(delta.token_ids)
                    choice.logprobs.extend(lps)
                    if finish:
                        choice.finish_reason = finish
                        self._finished(choice)
                    yield delta
                    if finish:
                        return  # leaving the stream early (a stop string) cancels the engine request
        finally:
            if choice.finish_reason is None and last is not None:  # cancelled (the client left) or cut off
                choice.finish_reason = "abort"
                self._finished(choice)

    def _finished(self, choice: Choice) -> None:
        first = choice.first_of_prompt
        self.server.metrics.finished(
            choice.finish_reason or "abort",
            len(choice.prompt_ids) if first else 0,
            choice.num_cached if first else 0,
            choice.num_output,
            time.monotonic() - self.arrival,
        )

    # ---- whole responses -----------------------------------------------------------------------
    async def complete(self) -> None:
        async def drain(choice: Choice) -> None:
            async for _ in self.deltas(choice):
                pass

        await _gather_or_raise([drain(c) for c in self.choices])

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(c.prompt_ids) for c in self.choices if c.first_of_prompt)
        cached = sum(c.num_cached for c in self.choices if c.first_of_prompt)
        completion = sum(c.num_output for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def response(self, chat: bool) -> dict[str, Any]:
        tokenizer = self.server.tokenizer
        out = []
        for c in self.choices:
            text = "".join(c.text)
            logprobs = None
            if c.params.logprobs is not None and tokenizer is not None:
                logprobs = (
                    {"content": chat_logprobs(tokenizer, c.token_ids, c.logprobs)}
                    if chat else completion_logprobs(tokenizer, c.token_ids, c.logprobs, 0)
                )
            if chat:
                out.append({"index": c.index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                out.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if chat else "text_completion", "created": self.created,
                "model": self.server.model_name, "choices": out, "usage": self.usage()}

    # ---- streaming -----------------------------------------------------------------------------
    async def stream(self, raw: Request, chat: bool) -> Response:
        """Start every choice; answer with an error status if one fails before its first message,
        else stream Server-Sent Events."""
        queue: asyncio.Queue = asyncio.Queue()
        first: list[asyncio.Future] = [asyncio.get_running_loop().create_future() for _ in self.choices]

        async def pump(choice: Choice) -> None:
            fut = first[choice.index]
            try:
                async for delta in self.deltas(choice):
                    if not fut.done():
                        fut.set_result(None)
                    await queue.put((choice, delta))
            except Exception as e:
                if not fut.done():
                    fut.set_exception(e)
                else:
                    await queue.put((choice, e))
            finally:
                await queue.put((choice, None))

        tasks = [asyncio.create_task(pump(c)) for c in self.choices]
        try:
            await _until_disconnect(raw, _gather_or_raise(first))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        return StreamingResponse(self._events(queue, tasks, chat), media_type="text/event-stream")

    async def _events(self, queue: asyncio.Queue, tasks: list[asyncio.Task], chat: bool) -> AsyncIterator[str]:
        tokenizer = self.server.tokenizer
        offsets = [0] * len(self.choices)
        include_usage = bool(self.req.stream_options and self.req.stream_options.include_usage)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name}
        try:
            if chat:
                for c in self.choices:
                    yield _sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}],
                                **({"usage": None} if include_usage else {})})
            remaining = len(self.choices)
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    error = unavailable(str(item)) if isinstance(item, EngineUnavailable) else APIError(str(item))
                    yield _sse(error.body())
                    continue
                delta: Delta = item
                if not delta.text and not delta.finish_reason and not delta.logprobs:
                    continue
                logprobs = None
                if choice.params.logprobs is not None and tokenizer is not None and delta.token_ids:
                    if chat:
                        logprobs = {"content": chat_logprobs(tokenizer, delta.token_ids, delta.logprobs)}
                    else:
                        logprobs = completion_logprobs(tokenizer, delta.token_ids, delta.logprobs, offsets[choice.index])
                offsets[choice.index] += len(delta.text)
                if chat:
                    body = {"index": choice.index, "delta": {"content": delta.text} if delta.text else {},
                            "logprobs": logprobs, "finish_reason": delta.finish_reason}
                else:
                    body = {"index": choice.index, "text": delta.text, "logprobs": logprobs,
                            "finish_reason": delta.finish_reason}
                yield _sse({**head, "choices": [body], **({"usage": None} if include_usage else {})})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: cancel the engine requests
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _APIKeyMiddleware:
    """``/v1/*`` needs ``Authorization: Bearer KEY``. Plain ASGI: Starlette's BaseHTTPMiddleware would
    relay every streamed chunk through a memory stream (a quarter of the router's CPU when streaming)."""

    def __init__(self, app: Any, key: str, reject: Callable[[APIError], JSONResponse]) -> None:
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.reject = reject

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = self.reject(unauthorized("Invalid or missing API key (Authorization: Bearer ...)"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _gather_or_raise(aws: list[Awaitable[Any]]) -> None:
    """Await all; the first failure cancels the rest and is raised as an APIError."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.gather(*tasks)
    except EngineUnavailable as e:
        raise unavailable(str(e)) from None
    except EngineRequestError as e:
        raise APIError(str(e)) from None
    finally:
        for t in tasks:
            t.cancel()


async def _until_disconnect(raw: Request, aw: Awaitable[Any]) -> Any:
    """Await ``aw``, cancelling it if the HTTP client disconnects first."""
    task = asyncio.ensure_future(aw)
    while True:
        done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError("client disconnected", 499, "invalid_request_error", "client_closed_request")
