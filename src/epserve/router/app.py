"""The OpenAI-compatible HTTP API of the router (FastAPI on uvicorn).

``/v1/completions`` and ``/v1/chat/completions`` tokenize (chat: through the tokenizer's template),
route every choice (``n`` per prompt) through :class:`~epserve.router.instances.Router` to an engine
instance, detokenize incrementally and cut at stop strings (``generation``), and answer as one JSON
body or as Server-Sent Events ending with ``data: [DONE]``. A client that goes away cancels its engine requests
(the engines abort them and free their KV blocks). Errors are OpenAI-style bodies: 400 for bad input,
401 without the API key (told from the request head: served by uvicorn, ``http_connections.http_protocol``
answers it before reading any of the body; in-process, the outermost middleware does), 404 for an
unknown model, 408/413 for a body too slow or too large (``http_limits``), 503 when no engine instance
can take the request (or past ``--max-connections``). ``/v1/responses`` (OpenAI's Responses API,
``responses``) runs as the chat completion it stands for. vLLM's ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` (``tokenizer_endpoints``) go through the same tokenizer and chat-template path; a
template that fails on a conversation is a 400 ``chat_template_error``. The endpoints that describe
the server (models, health, ``/ping``, metrics) are ``info_endpoints``'.

One request cannot stall the others: a large body is parsed, a long text tokenized, a large request's
choices built and a large response's body (or stream chunk) written on a worker thread, a large body
sent a choice at a time, a large ``/tokenize`` answer built and an engine message carrying many logprobs
read back (``engine_client``) off the loop too; a text that cannot fit the context is refused by its length
before tokenizing (no token stands for more than ``max_chars_per_token`` characters), and one request fans
out to at most ``max_choices_per_request`` generations.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from epserve.chat_template import ChatTemplateError
from epserve.router import openapi_doc
from epserve.router.checks import (
    bad_words_token_ids,
    check_request,
    choices_cost,
    logit_bias,
    resolve_max_tokens,
    stop_strings,
    to_sampling_params,
    truncated_length,
)
from epserve.router.choices import Choice
from epserve.router.errors import (
    APIError,
    bad_request,
    internal_error,
    not_found_model,
    prompt_too_many_chars,
    unavailable,
    validation_error,
)
from epserve.router.generation import Generation, GenerationContext
from epserve.router.generation_defaults import GenerationDefaults
from epserve.router.http_limits import APIKeyMiddleware, HTTPLimits, RequestGate, RequestLimitsMiddleware
from epserve.router.info_endpoints import InfoEndpoints
from epserve.router.instances import Router
from epserve.router.json_body import load_json_body
from epserve.router.metrics import RouterMetrics
from epserve.router.output_options import OutputOptions
from epserve.router.protocol import ChatCompletionRequest, CompletionRequest
from epserve.router.reasoning import starts_in_reasoning
from epserve.router.response_body import LARGE_COST
from epserve.router.responses import (
    ResponsesRequest,
    chat_error,
    chat_request,
    check_responses_request,
    new_ids,
    response_body,
)
from epserve.router.responses_stream import ResponseEvents
from epserve.router.streaming import until_disconnect
from epserve.router.tokenize import (
    REQUEST_MODELS,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_tokenize_request,
    tokenize_request_model,
)
from epserve.router.tokenizer_endpoints import INLINE_TOKENIZE_CHARS, TokenizerEndpoints
from epserve.router.tools import chat_constraint
from epserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_INLINE_PARSE_BYTES = 64 << 10  # larger bodies are parsed on a worker thread
_T = TypeVar("_T")
_Req = TypeVar("_Req", CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, DetokenizeRequest)


def max_chars_per_token(tokenizer: Tokenizer) -> int:
    """The most characters one token can stand for: its longest text in UTF-8 bytes (at least its
    characters; a byte-level token that is part of a character decodes to U+FFFD, 3 bytes)."""
    decode = tokenizer.decode
    return max(len(decode([i], skip_special_tokens=False).encode()) for i in range(tokenizer.vocab_size))


class OpenAIServer(InfoEndpoints, TokenizerEndpoints):
    def __init__(self, router: Router, tokenizer: Tokenizer | None, model_name: str,
                 api_key: str | None = None, limits: HTTPLimits | None = None,
                 generation_defaults: GenerationDefaults | None = None, reasoning_parser: str | None = None,
                 tool_calls: tuple[str | None, bool] = (None, False), output: OutputOptions | None = None) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.limits = limits or HTTPLimits()
        self.generation_defaults = generation_defaults  # the checkpoint's generation_config.json
        self.tool_calls = tool_calls  # --tool-call-parser, --enable-auto-tool-choice
        self.output = output or OutputOptions()  # --response-role, --return-tokens-as-token-ids, --max-logprobs
        self.max_chars_per_token = max_chars_per_token(tokenizer) if tokenizer is not None else None
        self.metrics = RouterMetrics(router, model_name)
        self.gate = RequestGate(api_key, on_refused=self.metrics.error)  # also served: http_connections.http_protocol
        self.workers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epserve-parse")  # GIL-bound work
        self.generation_context = GenerationContext(router.generate, tokenizer, self.metrics, model_name,
                                                    reasoning_parser, self.output,
                                                    offload=functools.partial(self._offload, True))
        self.created = int(time.time())
        self.app = self._build_app()

    # ---- app ---------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            await self.router.start()
            await anyio.sleep(0)  # loads anyio's backend now, not in the first streamed response (an import)
            yield
            await self.router.close()
            self.workers.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="epserve", description="OpenAI-compatible API of the epserve router", lifespan=lifespan)
        openapi_doc.install(app, (CompletionRequest, ChatCompletionRequest, ResponsesRequest, *REQUEST_MODELS))
        app.add_middleware(RequestLimitsMiddleware, limits=self.limits, reject=self._error,
                           on_disconnect=lambda: self.metrics.error(499))
        if self.api_key:  # outermost: before any body is read
            app.add_middleware(APIKeyMiddleware, gate=self.gate, reject=self._error)

        @app.exception_handler(APIError)
        async def api_error(request: Request, exc: APIError) -> JSONResponse:
            return self._error(exc)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            response = self._error(APIError(str(exc.detail), exc.status_code, "invalid_request_error", code))
            response.headers.update(exc.headers or {})
            return response

        @app.exception_handler(Exception)
        async def internal(request: Request, exc: Exception) -> JSONResponse:  # RequestLimitsMiddleware's misses
            error_id = uuid.uuid4().hex[:12]
            logger.error("internal error %s in %s", error_id, request.url.path, exc_info=exc)
            return self._error(internal_error(error_id))

        app.add_api_route("/v1/completions", self.completions,
                          **openapi_doc.generation_route(CompletionRequest, chat=False))
        app.add_api_route("/v1/chat/completions", self.chat_completions,
                          **openapi_doc.generation_route(ChatCompletionRequest, chat=True))
        app.get("/v1/models", **openapi_doc.MODELS_ROUTE)(self.models)
        app.get("/v1/models/{model_id:path}", **openapi_doc.MODEL_ROUTE)(self.model_card)
        app.add_api_route("/tokenize", self.tokenize, **openapi_doc.TOKENIZE_ROUTE)
        app.add_api_route("/detokenize", self.detokenize, **openapi_doc.DETOKENIZE_ROUTE)
        app.get("/version", **openapi_doc.VERSION_ROUTE)(self.version)
        app.get("/health", **openapi_doc.HEALTH_ROUTE)(self.health)
        app.get("/ping", operation_id="ping", **openapi_doc.PING_ROUTE)(self.ping)  # (SageMaker's; POST as vLLM's)
        app.post("/ping", operation_id="ping_post", include_in_schema=False)(self.ping)
        app.get("/tokenizer_info", **openapi_doc.TOKENIZER_INFO_ROUTE)(self.tokenizer_info)
        app.add_api_route("/v1/responses", self.responses, **openapi_doc.RESPONSES_ROUTE)
        app.get("/metrics", **openapi_doc.METRICS_ROUTE)(self.metrics_endpoint)
        app.get("/expert_load")(self.expert_load)
        return app

    def _error(self, exc: APIError) -> JSONResponse:
        self.metrics.error(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    # ---- generation endpoints -------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        req = await self._parse(raw, CompletionRequest)
        max_model_len, vocab = self._limits()
        prompts: list[Any]
        if isinstance(req.prompt, str):
            prompts = [req.prompt]
        elif isinstance(req.prompt[0], int):
            prompts = [req.prompt]  # one prompt as token ids
        else:
            prompts = list(req.prompt)
        self._check_fan_out(len(prompts) * req.n, "n" if len(prompts) == 1 else "prompt")
        originals = [p if isinstance(p, str) else None for p in prompts]  # echo repeats a text as sent
        texts = [p for p in prompts if isinstance(p, str)]
        if texts:
            tokenizer = self._need_tokenizer("text prompts")
            for text in texts if req.truncate_prompt_tokens is None else ():  # (a long one is cut)
                self._check_chars(len(text), max_model_len, "prompt")

            def encode() -> list[list[int]]:
                return [tokenizer.encode(p, req.add_special_tokens) if isinstance(p, str) else p for p in prompts]

            prompts = await self._offload(sum(map(len, texts)) > INLINE_TOKENIZE_CHARS, encode)
        return await self._generate(raw, req, prompts, max_model_len, vocab, chat=False, prompt_texts=originals)

    async def chat_completions(self, raw: Request) -> Response:
        req = await self._parse(raw, ChatCompletionRequest)
        max_model_len, vocab = self._limits()
        tokenizer = self._need_tokenizer("chat completions")
        self._check_fan_out(req.n, "n")
        prompt = await self._encode_chat(tokenizer, req, max_model_len, req.add_special_tokens)
        return await self._generate(raw, req, [prompt], max_model_len, vocab, chat=True)

    async def responses(self, raw: Request) -> Response:
        """``POST /v1/responses``: OpenAI's Responses API, as the chat completion it stands for (``responses``)."""
        body = await raw.body()
        rreq, req = await self._offload(len(body) > _INLINE_PARSE_BYTES, self._validate_responses, body)
        max_model_len, vocab = self._limits()
        try:
            prompt = await self._encode_chat(self._need_tokenizer("responses"), req, max_model_len)
            heavy = len(body) > _INLINE_PARSE_BYTES or choices_cost(req, [prompt]) > LARGE_COST
            run = await self._offload(heavy, functools.partial(self._generation, req, [prompt], max_model_len, vocab,
                                                               chat=True, id_prefix="resp"))
        except APIError as e:
            raise chat_error(e) from None
        response_id, created = new_ids()
        if req.stream:
            return await run.stream(raw, True, ResponseEvents(rreq, run, response_id, created).events)
        await until_disconnect(raw, run.complete())
        return JSONResponse(response_body(rreq, run, response_id, created))

    def _validate_responses(self, body: bytes) -> tuple[ResponsesRequest, ChatCompletionRequest]:
        try:
            rreq = ResponsesRequest.model_validate(load_json_body(body))
        except ValidationError as e:
            raise validation_error(e) from None
        check_responses_request(rreq)
        try:
            return rreq, self._checked(chat_request(rreq), ChatCompletionRequest)
        except APIError as e:
            raise chat_error(e) from None

    async def _encode_chat(self, tokenizer: Tokenizer, req: ChatCompletionRequest | TokenizeChatRequest,
                           max_model_len: int | None, add_special_tokens: bool = False) -> list[int]:
        """The conversation's token ids through the chat template, on a worker thread when long; a text
        that cannot fit ``max_model_len`` is refused first. A template that fails is a 400 naming why."""
        messages = req.message_dicts()
        num_chars = sum(len(m["content"] or "") + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", ()))
                        for m in messages)
        if max_model_len is not None and getattr(req, "truncate_prompt_tokens", None) is None:
            self._check_chars(num_chars, max_model_len, "messages")
        options = req.template_options()  # (with the tools, for templates that describe them: DeepSeek-V3.1's)
        heavy = num_chars + (len(repr(options["chat_template_kwargs"])) if options["chat_template_kwargs"] else 0)
        encode = functools.partial(tokenizer.encode_chat, messages, add_special_tokens=add_special_tokens, **options)
        try:
            return await self._offload(heavy > INLINE_TOKENIZE_CHARS, encode)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages", "chat_template_error") from None
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    async def _offload(self, heavy: bool, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, on a worker thread when ``heavy`` (the event loop keeps serving meanwhile)."""
        if not heavy:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    async def _parse(self, raw: Request, model: type[_Req]) -> _Req:
        body = await raw.body()  # read (and limited) by RequestLimitsMiddleware
        return await self._offload(len(body) > _INLINE_PARSE_BYTES, self._validate, body, model)

    def _validate(self, body: bytes, model: type[_Req]) -> _Req:
        return self._checked(load_json_body(body), model)

    def _checked(self, data: Any, model: type[_Req]) -> _Req:
        if model is TokenizeCompletionRequest:
            model = tokenize_request_model(data)  # type: ignore[assignment]
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model is not None and req.model != self.model_name:
            raise not_found_model(req.model)
        if isinstance(req, (CompletionRequest, ChatCompletionRequest)):
            check_request(req)
            self.output.check(req)
        else:
            check_tokenize_request(req)
        return req

    def _need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(f"{what} need a tokenizer; this model directory has none (send token ids)")
        return self.tokenizer

    def _check_chars(self, num_chars: int, max_model_len: int, param: str) -> None:
        per_token = self.max_chars_per_token
        if per_token is not None and num_chars > per_token * max_model_len:
            raise prompt_too_many_chars(max_model_len, num_chars, per_token, param)

    def _check_fan_out(self, num_choices: int, param: str) -> None:
        cap = self.limits.max_choices_per_request
        if num_choices > cap:
            raise bad_request(f"This request asks for {num_choices} generations (prompts x n); this server "
                              f"allows at most {cap} per request", param, "too_many_choices")

    def _limits(self) -> tuple[int, int]:
        """The model's context and vocabulary, known once an engine instance has answered (while none is
        healthy the router holds a request for ``engine_wait_s``, then answers 503)."""
        info = self.router.info
        if info is None:
            raise unavailable()
        return info.max_model_len, info.vocab_size

    async def _generate(self, raw: Request, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                        max_model_len: int, vocab: int, chat: bool,
                        prompt_texts: list[str | None] | None = None) -> Response:
        # (a body parsed off the loop has its choices built off it too: its schemas and tools are re-read)
        heavy = len(await raw.body()) > _INLINE_PARSE_BYTES or choices_cost(req, prompts) > LARGE_COST
        run = await self._offload(heavy, self._generation, req, prompts, max_model_len, vocab, chat, prompt_texts)
        if req.stream:
            return await run.stream(raw, chat)
        await until_disconnect(raw, run.complete())
        if run.response_cost(chat) <= LARGE_COST:
            return JSONResponse(run.response(chat))
        return StreamingResponse(self._built(run.body_parts(chat)), media_type="application/json")

    async def _built(self, parts: Iterator[bytes]) -> AsyncIterator[bytes]:
        """A large body's pieces, each built on the worker thread."""
        loop = asyncio.get_running_loop()
        while (piece := await loop.run_in_executor(self.workers, next, parts, None)) is not None:
            yield piece

    def _generation(self, req: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]],
                    max_model_len: int, vocab: int, chat: bool, prompt_texts: list[str | None] | None = None,
                    id_prefix: str | None = None) -> Generation:
        """The request's generation: its choices (``n`` per prompt) with their engine parameters, checked."""
        choices: list[Choice] = []
        bias = logit_bias(req)  # (checked once: every choice carries it)
        bad_bias = next((t for t, _ in bias if t >= vocab), None)
        if bad_bias is not None:
            raise bad_request(f"logit_bias token id {bad_bias} is outside the vocabulary [0, {vocab})", "logit_bias")
        # a chat output that starts inside the reasoning (its rendered prompt left <think> open)
        thinking = (chat and self.generation_context.reasoning_parser is not None and self.tokenizer is not None
                    and starts_in_reasoning(self.tokenizer.decode(prompts[0][-64:], skip_special_tokens=False)))
        mode, constraint = chat_constraint(req, *self.tool_calls, thinking)
        bad_words = ()
        if req.bad_words:
            tokenizer = self._need_tokenizer("bad_words")
            bad_words = bad_words_token_ids(req.bad_words, lambda w: tokenizer.encode(w, add_special_tokens=False))
        for i, ids in enumerate(prompts):
            if req.truncate_prompt_tokens is not None and len(ids) > (keep := truncated_length(req, max_model_len)):
                prompts[i] = ids = ids[-keep:]  # vLLM's: the prompt's last tokens
                prompt_texts = [t if k != i else None for k, t in enumerate(prompt_texts or [None] * len(prompts))]
            max_tokens = resolve_max_tokens(req, len(ids), max_model_len)  # first: a huge prompt is not scanned
            # check_request already refused negative ids; the vocabulary's size is known only now
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise bad_request(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            for j in range(req.n):
                params = to_sampling_params(req, max_tokens, index=j, defaults=self.generation_defaults,
                                            bad_words=bad_words, structured=constraint, bias=bias)
                choices.append(Choice(len(choices), ids, params, first_of_prompt=j == 0,
                                      prompt_text=prompt_texts[i] if prompt_texts else None))
        if stop_strings(req) and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer; this model directory has none", param="stop")
        request_id = f"{id_prefix or ('chatcmpl' if chat else 'cmpl')}-{req.request_id or uuid.uuid4().hex}"
        return Generation(self.generation_context, req, choices, request_id, mode.parser, thinking)
