"""The OpenAI-compatible HTTP API of the router (FastAPI on uvicorn).

``/v1/completions`` and ``/v1/chat/completions`` tokenize (chat: through the tokenizer's template),
route every choice (``n`` per prompt) through :class:`~epserve.serve.router.Router` to an engine
instance, detokenize incrementally and cut at stop strings (``generation``), and answer as one JSON
body or as Server-Sent Events ending with ``data: [DONE]``. A client that goes away cancels its engine requests
(the engines abort them and free their KV blocks). Errors are OpenAI-style bodies: 400 for bad input,
401 without the API key, 404 for an unknown model, 503 when no engine instance can take the request.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from epserve.serve.errors import APIError, not_found_model, unauthorized, unavailable, validation_error
from epserve.serve.generation import Choice, Generation, GenerationContext, until_disconnect
from epserve.serve.metrics import CONTENT_TYPE, RouterMetrics
from epserve.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_request,
    resolve_max_tokens,
    stop_strings,
    to_sampling_params,
)
from epserve.serve.router import Router
from epserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class OpenAIServer:
    def __init__(self, router: Router, tokenizer: Tokenizer | None, model_name: str,
                 api_key: str | None = None) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.metrics = RouterMetrics(router, model_name)
        self.generation_context = GenerationContext(router.generate, tokenizer, self.metrics, model_name)
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
        app.get("/expert_load")(self.expert_load)
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

    async def expert_load(self) -> dict[str, Any]:
        """Each engine world's expert load since start-up (``epserve plan --expert-load`` reads it)."""
        return {"instances": [load.summary() for load in await self.router.expert_loads()]}

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
            # check_request already refused negative ids; the vocabulary's size is known only now
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise APIError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            max_tokens = resolve_max_tokens(req, len(ids), max_model_len)
            for j in range(req.n):
                params = to_sampling_params(req, max_tokens, index=j)
                choices.append(Choice(len(choices), ids, params, first_of_prompt=j == 0))
        if stop_strings(req) and self.tokenizer is None:
            raise APIError("stop strings need a tokenizer; this model directory has none", param="stop")
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        run = Generation(self.generation_context, req, choices, request_id)
        if req.stream:
            return await run.stream(raw, chat)
        await until_disconnect(raw, run.complete())
        return JSONResponse(run.response(chat))


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
