"""OpenAI-compatible request models and their validation for the HTTP layer (errors in ``errors``,
logprobs formatting in ``logprobs``).

The request models parse ``/v1/completions`` and ``/v1/chat/completions`` bodies in pydantic's
strict mode, so a value of the wrong JSON type (``"temperature": "hot"``, ``"n": true``) is an
error rather than being coerced; a JSON integer is still a valid float. ``null`` for a parameter
that has a default means the default, as in OpenAI's API. Unknown fields are ignored.

``check_request`` then checks value ranges (also what the engine's gRPC fields can hold: ``top_k``
int32, ``top_p`` float32, token ids and counts uint32, ``seed`` int64) and unsupported options,
``resolve_max_tokens`` fits the completion into the model's context, and ``to_sampling_params`` maps a
request onto the engine's ``SamplingParams``. Every problem is raised as an ``APIError`` whose
``body()`` is the OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``). The models'
JSON schemas (the OpenAPI document) say the same: ``null`` allowed where it means the default, and
the ranges ``check_request`` enforces.
"""

from __future__ import annotations

import struct
import typing
from types import NoneType, UnionType
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from epserve.messages.sampling import MAX_LOGPROBS, SamplingParams
from epserve.router.errors import bad_request, context_length_exceeded
from epserve.tokenizer import ROLES

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_INT32_MAX, _UINT32_MAX = 2**31 - 1, 2**32 - 1

# What check_request enforces, as JSON-schema keywords for the OpenAPI document (a keyword such as
# `minimum` constrains numbers only, so it may sit next to the `null` that _null_means_default allows).
_COUNT = {"minimum": 1, "maximum": _UINT32_MAX}
_SCHEMA_BOUNDS: dict[str, dict[str, Any]] = {
    "n": {"minimum": 1, "maximum": MAX_N},
    "temperature": {"minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": _INT32_MAX},
    "min_p": {"minimum": 0, "maximum": 1},
    "seed": {"minimum": _INT64_MIN, "maximum": _INT64_MAX},
    "stop": {"minLength": 1, "maxItems": MAX_STOP_STRINGS, "items": {"minLength": 1}},
    "stop_token_ids": {"items": {"minimum": 0, "maximum": _UINT32_MAX}},
    "presence_penalty": {"minimum": 0, "maximum": 0},
    "frequency_penalty": {"minimum": 0, "maximum": 0},
    "max_tokens": _COUNT,
    "max_completion_tokens": _COUNT,
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt": {"minLength": 1, "minItems": 1},
    "messages": {"minItems": 1},
    "role": {"enum": list(ROLES)},
    "type": {"enum": ["text"]},  # of a content part
}


# ---------------------------------------------------------------------------------------------- models


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is NoneType:
        return True
    origin = typing.get_origin(annotation)
    return (origin is typing.Union or origin is UnionType) and NoneType in typing.get_args(annotation)


def _document_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The JSON schema says what validation does: null means the default, and the checked ranges."""
    props = schema.get("properties", {})
    for name, field in cls.model_fields.items():
        prop = props.get(name)
        if prop is None:
            continue
        if not field.is_required() and not _admits_none(field.annotation):
            branch = {k: v for k, v in prop.items() if k not in ("default", "title")}
            props[name] = prop = {"anyOf": [branch, {"type": "null"}], "default": prop.get("default")}
        prop.pop("title", None)
        if name == "logprobs":  # completions: a count; chat: a flag
            prop.update({} if field.annotation is bool else {"minimum": 0, "maximum": MAX_LOGPROBS})
        else:
            prop.update(_SCHEMA_BOUNDS.get(name, {}))


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_document_schema)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``"temperature": null`` means the default, as in OpenAI's API (fields that admit None keep it)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            drop = [
                k
                for k, v in data.items()
                if v is None
                and k in fields
                and not fields[k].is_required()
                and not _admits_none(fields[k].annotation)
            ]
            if drop:
                data = {k: v for k, v in data.items() if k not in drop}
        return data


_STRICT = ConfigDict(strict=True)
_PROMPT_LISTS: dict[type, TypeAdapter] = {  # a prompt list's form, by its first item's type
    int: TypeAdapter(list[int], config=_STRICT),
    str: TypeAdapter(list[str], config=_STRICT),
    list: TypeAdapter(list[list[int]], config=_STRICT),
}


def _union_error(value: Any, handler: ValidatorFunctionWrapHandler, expected: str) -> Any:
    """Run the union validator; on failure report one readable error instead of one per member."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "type_error", "Input should be {expected}", {"expected": expected}
        ) from None


class StreamOptions(_Model):
    include_usage: bool = False


class ContentPart(_Model):
    """One part of a chat message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: str
    content: str | list[ContentPart]
    name: str | None = None

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):
            return handler(value)  # errors inside the list keep their locations
        return _union_error(value, handler, "a string or a list of content parts")

    def text(self) -> str:
        """The content as one string (text parts joined with newlines)."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)


class _SamplingFields(_Model):
    """Fields that completions and chat completions share."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0  # only 0 is supported
    frequency_penalty: float = 0.0  # only 0 is supported
    ignore_eos: bool = False  # extension
    include_stop_str_in_output: bool = False  # extension
    skip_special_tokens: bool = True  # extension
    user: str | None = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):
            return handler(value)
        return _union_error(value, handler, "a string, a list of strings or null")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # 0..20
    echo: bool = False  # only False is supported

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        expected = "a string, a list of strings, a list of token ids or a list of token id lists"
        # A list is validated as the one form its first item allows: trying the union's members in turn
        # would build an error for every item of each member that fails (half a second for 1M token ids).
        adapter = _PROMPT_LISTS.get(type(value[0])) if isinstance(value, list) and value else None
        if adapter is None:
            return _union_error(value, handler, expected)
        try:
            return adapter.validate_python(value)
        except ValidationError:
            raise PydanticCustomError("type_error", "Input should be {expected}", {"expected": expected}) from None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens when both are given
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true

    def message_dicts(self) -> list[dict[str, str]]:
        """``[{"role", "content"}]`` for the tokenizer's chat template, text parts joined."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


AnyRequest = CompletionRequest | ChatCompletionRequest


# ---------------------------------------------------------------------------------------------- checks


def _check_range(value: float, lo: float, hi: float, param: str, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi  # NaN fails both
    if not ok:
        lo_bracket = "(" if lo_open else "["
        raise bad_request(f"{param} must be in {lo_bracket}{lo:g}, {hi:g}], got {value!r}", param)


def check_request(req: AnyRequest) -> None:
    """Raise ``APIError(400)`` for values out of range and options this server does not support."""
    _check_range(req.n, 1, MAX_N, "n")
    _check_range(req.temperature, 0, MAX_TEMPERATURE, "temperature")
    _check_range(req.top_p, 0, 1, "top_p", lo_open=True)
    if struct.unpack("f", struct.pack("f", req.top_p))[0] == 0:  # the engine's field is a float32
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p!r} (0 as a 32-bit float)", "top_p")
    if not -1 <= req.top_k <= _INT32_MAX:
        raise bad_request(
            f"top_k must be -1 or 0 (disabled) or a positive integer up to {_INT32_MAX}, got {req.top_k}", "top_k"
        )
    _check_range(req.min_p, 0, 1, "min_p")
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX:
        raise bad_request(f"seed must be a 64-bit signed integer, in [{_INT64_MIN}, {_INT64_MAX}]", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value != 0:  # also catches NaN
            raise bad_request(
                f"{name} is not supported: only 0 is allowed, got {value!r}", name, "unsupported_value"
            )
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    if req.stop_token_ids and any(not 0 <= t <= _UINT32_MAX for t in req.stop_token_ids):
        raise bad_request(f"stop_token_ids must be token ids in [0, {_UINT32_MAX}]", "stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        _check_completion(req)
    else:
        _check_chat(req)


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and not 1 <= value <= _UINT32_MAX:
        raise bad_request(f"{param} must be in [1, {_UINT32_MAX}], got {value}", param)


def _check_completion(req: CompletionRequest) -> None:
    _check_max_tokens(req.max_tokens, "max_tokens")
    if req.logprobs is not None:
        _check_range(req.logprobs, 0, MAX_LOGPROBS, "logprobs")
    if req.echo:
        raise bad_request("echo is not supported: only false is allowed", "echo", "unsupported_value")
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt:
        prompts: list[Any] = [prompt]
    elif isinstance(prompt[0], int):
        prompts = [prompt]  # one prompt given as token ids
    else:
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(p) == 0:
            raise bad_request(f"{where} must not be empty", "prompt")
        if not isinstance(p, str) and any(t < 0 for t in p):
            raise bad_request(f"{where} holds a negative token id", "prompt")


def _check_chat(req: ChatCompletionRequest) -> None:
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        _check_range(req.top_logprobs, 0, MAX_LOGPROBS, "top_logprobs")
    if not req.messages:
        raise bad_request("messages must hold at least one message", "messages")
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise bad_request(
                    f"{where}.type is {part.type!r}: only text content is supported",
                    f"{where}.type",
                    "unsupported_value",
                )
            if part.text is None:
                raise bad_request(f"{where} has type 'text' but no text", f"{where}.text")


def resolve_max_tokens(req: AnyRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens to generate: as requested (completions default 16; chat ``max_completion_tokens``
    over ``max_tokens``), else whatever room the context leaves. Raises ``context_length_exceeded``.
    ``req`` has passed ``check_request`` (which refuses a requested count below 1)."""
    if isinstance(req, ChatCompletionRequest):
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prompt_param = "messages"
    else:
        requested, param, prompt_param = req.max_tokens, "max_tokens", "prompt"
    if num_prompt_tokens >= max_model_len:
        raise context_length_exceeded(max_model_len, num_prompt_tokens, requested, prompt_param)
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise context_length_exceeded(max_model_len, num_prompt_tokens, requested, param)
    return requested


def _wrap_int64(x: int) -> int:
    return (x - _INT64_MIN) % 2**64 + _INT64_MIN


def to_sampling_params(req: AnyRequest, max_tokens: int, index: int = 0) -> SamplingParams:
    """The engine's ``SamplingParams`` for choice ``index`` of ``req`` (its seed is ``seed + index``)."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(req.temperature),
            top_k=req.top_k,
            top_p=float(req.top_p),
            min_p=float(req.min_p),
            seed=None if req.seed is None else _wrap_int64(req.seed + index),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )
    except ValueError as e:
        raise bad_request(str(e)) from None


def stop_strings(req: AnyRequest) -> list[str]:
    """``stop`` as a list: ``[]``, ``[s]`` or the given list."""
    if req.stop is None:
        return []
    if isinstance(req.stop, str):
        return [req.stop]
    return list(req.stop)
