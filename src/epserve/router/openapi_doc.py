"""The router's OpenAPI document (``GET /openapi.json``).

The generation endpoints parse their bodies by hand (for the OpenAI-style error messages), so FastAPI
cannot see their request models: the request bodies are declared here (``CompletionRequest`` and
``ChatCompletionRequest``, whose JSON schemas carry the ranges ``check_request`` enforces; vLLM's
``/tokenize`` and ``/detokenize`` bodies likewise, and ``/v1/responses``' ``ResponsesRequest``), with every
answer they give: 200 as JSON or Server-Sent Events, and the errors, each with the OpenAI error body.
``/tokenizer_info`` and ``/ping`` are described with their answers too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from pydantic import BaseModel

from epserve.router.errors import ErrorResponse

_ERRORS = {
    400: "Bad input: malformed JSON, a wrong type, a value out of range, an unsupported option, a prompt "
         "or completion that does not fit the context (`context_length_exceeded`)",
    401: "Missing or wrong API key (when the server has one)",
    404: "Another model's name (`model_not_found`)",
    408: "The request body did not arrive in time (`request_timeout`)",
    413: "The request body is larger than the server's limit (`request_too_large`)",
    503: "No engine instance can take the request, or it stopped before finishing (`engine_unavailable`)",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def _object(required: dict[str, Any], **optional: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": {**required, **optional}}


_INT, _STR = {"type": "integer"}, {"type": "string"}
_USAGE = _object({"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT},
                 prompt_tokens_details=_object({"cached_tokens": _INT}))
_FINISHED = {"enum": ["stop", "length"]}  # never anything else in a whole response


def _response(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return _object({"id": _STR, "object": {"const": kind}, "created": _INT, "model": _STR,
                    "choices": {"type": "array", "items": choice}, "usage": _USAGE})


_COMPLETION = _response("text_completion", _object({"index": _INT, "text": _STR, "finish_reason": _FINISHED}))
_CHAT = _response("chat.completion", _object({
    "index": _INT, "message": _object({"role": _STR, "content": _STR}),  # (role: --response-role)
    "finish_reason": _FINISHED}))


# The stream: as a whole a string (OpenAPI 3.1), or, as OpenAPI 3.2 tools read a stream's schema, each event
# (an object with its `data`): either reading holds.
_SSE = {"anyOf": [_STR, {"type": "object", "required": ["data"], "properties": {"data": _STR, "event": _STR}}]}


def generation_route(request_model: type[BaseModel], chat: bool) -> dict[str, Any]:
    """Keywords of ``app.add_api_route`` for a generation endpoint taking ``request_model``'s JSON."""
    ref = {"$ref": f"#/components/schemas/{request_model.__name__}"}
    ok = {"description": "The whole response as JSON, or with `stream: true` Server-Sent Events (`data: {chunk}` "
                         "lines ending with `data: [DONE]`; an error after the first chunk is a `data: {\"error\": "
                         "...}` event)",
          "content": {"application/json": {"schema": _CHAT if chat else _COMPLETION},
                      "text/event-stream": {"schema": _SSE}}}
    return {
        "methods": ["POST"],
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}},
        "responses": {200: ok, **_errors(400, 401, 404, 408, 413, 503)},
    }


_HEALTH = {"application/json": {"schema": _object(
    {"status": {"enum": ["ok", "unavailable"]}, "num_engines": _INT, "num_healthy_engines": _INT})}}
HEALTH_ROUTE: dict[str, Any] = {"responses": {
    200: {"description": "At least one engine instance is healthy", "content": _HEALTH},
    503: {"description": "No engine instance is healthy", "content": _HEALTH},
}}
MODELS_ROUTE: dict[str, Any] = {"responses": _errors(401)}
MODEL_ROUTE: dict[str, Any] = {"responses": _errors(401, 404)}  # (404: `model_not_found` for another id)
VERSION_ROUTE: dict[str, Any] = {"responses": {
    200: {"description": "The server's version",
          "content": {"application/json": {"schema": _object({"version": _STR})}}},
    **_errors(401)}}


def _body(*models: str) -> dict[str, Any]:
    """``openapi_extra`` declaring a JSON request body of one of ``models`` (names of installed schemas)."""
    refs = [{"$ref": f"#/components/schemas/{m}"} for m in models]
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_INTS = {"type": "array", "items": _INT}
TOKENIZE_ROUTE: dict[str, Any] = {
    "methods": ["POST"], "openapi_extra": _body("TokenizeCompletionRequest", "TokenizeChatRequest"),
    "responses": {200: _json("The token ids (`token_strs`: as the vocabulary spells them, when asked for)", _object(
        {"count": _INT, "max_model_len": _INT, "tokens": _INTS}, token_strs={"type": "array", "items": _STR})),
        **_errors(400, 401, 404, 408, 413, 503)},
}
DETOKENIZE_ROUTE: dict[str, Any] = {
    "methods": ["POST"], "openapi_extra": _body("DetokenizeRequest"),
    "responses": {200: _json("The text of the token ids, special tokens included", _object({"prompt": _STR})),
                  **_errors(400, 401, 404, 408, 413)},
}
_OUTPUT_ITEM = _object({"type": {"enum": ["message", "reasoning", "function_call"]}, "id": _STR, "status": _STR})
_RESPONSE = _object({
    "id": _STR, "object": {"const": "response"}, "created_at": {"type": "number"}, "model": _STR,
    "status": {"enum": ["completed", "incomplete"]}, "output": {"type": "array", "items": _OUTPUT_ITEM},
    "usage": _object({"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT})})
RESPONSES_ROUTE: dict[str, Any] = {
    "methods": ["POST"], "openapi_extra": _body("ResponsesRequest"),
    "responses": {200: {
        "description": "The Response (status `incomplete` when cut by `max_output_tokens`), or with `stream: true` "
                       "its events (`event: response.created` ... `response.completed`, or `response.failed`)",
        "content": {"application/json": {"schema": _RESPONSE}, "text/event-stream": {"schema": _SSE}}},
        **_errors(400, 401, 404, 408, 413, 503)},
}
TOKENIZER_INFO_ROUTE: dict[str, Any] = {"responses": {
    200: _json("vLLM's: the tokenizer's configuration as transformers reads it (special tokens, chat template, "
               "`model_max_length`: the served context)", _object(
                   {"tokenizer_class": _STR, "vocab_size": _INT},
                   eos_token={"type": ["string", "null"]}, chat_template={"type": ["string", "null"]})),
    404: {"model": ErrorResponse, "description": "The model directory has no tokenizer"}}}
PING_ROUTE: dict[str, Any] = {"response_class": Response, "responses": {
    200: {"description": "The router can serve (an empty body; SageMaker's health check, as `/health`)"},
    503: {"description": "No engine instance is healthy (an empty body)"}}}
METRICS_ROUTE: dict[str, Any] = {"responses": {200: {"description": "Prometheus text format",
                                                     "content": {"text/plain": {"schema": _STR}}}}}


def install(app: FastAPI, request_models: Sequence[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` serves) include ``request_models``' schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
