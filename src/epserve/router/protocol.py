"""OpenAI-compatible request models of the HTTP layer (their checks and their mapping onto the engine
in ``checks``, errors in ``errors``, logprobs formatting in ``logprobs``).

The request models parse ``/v1/completions`` and ``/v1/chat/completions`` bodies in pydantic's
strict mode, so a value of the wrong JSON type (``"temperature": "hot"``, ``"n": true``) is an
error rather than being coerced; a JSON integer is still a valid float. ``null`` for a parameter
that has a default means the default, as in OpenAI's API. Unknown fields are ignored, each name said
once in the log; fields OpenAI or vLLM define that this server does not implement are declared, so
that ``checks`` can refuse them unless they hold the value that means "off". The models' JSON schemas
(the OpenAPI document) say what ``checks.check_request`` enforces: ``null`` allowed where it means the
default, and the ranges.
"""

from __future__ import annotations

import logging
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

from epserve.chat_template import ROLES
from epserve.messages.sampling import (
    MAX_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
)

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_TEMPERATURE = 2.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
INT32_MAX, UINT32_MAX = 2**31 - 1, 2**32 - 1

# What check_request enforces, as JSON-schema keywords for the OpenAPI document (a keyword such as
# `minimum` constrains numbers only, so it may sit next to the `null` that _null_means_default allows).
_COUNT = {"minimum": 1, "maximum": UINT32_MAX}
_SCHEMA_BOUNDS: dict[str, dict[str, Any]] = {
    "n": {"minimum": 1, "maximum": MAX_N},
    "temperature": {"minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1, "maximum": INT32_MAX},
    "min_p": {"minimum": 0, "maximum": 1},
    "seed": {"minimum": INT64_MIN, "maximum": INT64_MAX},
    "stop": {"minLength": 1, "maxItems": MAX_STOP_STRINGS, "items": {"minLength": 1}},
    "stop_token_ids": {"items": {"minimum": 0, "maximum": UINT32_MAX}},
    "presence_penalty": {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
    "frequency_penalty": {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
    "repetition_penalty": {"exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY},
    "logit_bias": {"additionalProperties": {"minimum": -MAX_BIAS, "maximum": MAX_BIAS}},
    "min_tokens": {"minimum": 0, "maximum": UINT32_MAX},
    "prompt_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "bad_words": {"maxItems": 256, "items": {"maxLength": 256, "pattern": "\\S"}},
    "truncate_prompt_tokens": {"minimum": -1, "maximum": UINT32_MAX, "not": {"const": 0}},
    "request_id": {"minLength": 1, "maxLength": 256},
    "max_tokens": _COUNT,
    "max_completion_tokens": _COUNT,
    "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    "prompt": {"minLength": 1, "minItems": 1},
    "messages": {"minItems": 1},
    "role": {"enum": list(ROLES)},
    "tokens": {"items": {"minimum": 0, "maximum": UINT32_MAX}},  # /detokenize (and the vocabulary's size)
    "chat_template": {"type": "null"},  # a request's own template is refused
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
        elif name == "max_tokens" and cls.__name__ == "CompletionRequest":  # 0: the prompt alone
            prop.update({"minimum": 0, "maximum": UINT32_MAX})
        else:
            prop.update(_SCHEMA_BOUNDS.get(name, {}))


_warned_unknown: set[tuple[str, str]] = set()


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra=_document_schema)

    @model_validator(mode="before")
    @classmethod
    def _warn_unknown(cls, data: Any) -> Any:
        """An unknown field is ignored, with one warning per field name in the log (vLLM's behaviour)."""
        if isinstance(data, dict):
            for key in data.keys() - cls.model_fields.keys():
                if (cls.__name__, key) not in _warned_unknown and len(_warned_unknown) < 1024:
                    _warned_unknown.add((cls.__name__, key))
                    logger.warning("ignoring the unknown field %r of %s (said once per field)",
                                   str(key)[:64], cls.__name__)
        return data

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


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage so far in every chunk


class ContentPart(RequestModel):
    """One part of a chat message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class ToolCallFunction(RequestModel):
    name: str
    arguments: str


class MessageToolCall(RequestModel):
    """A call an assistant message made (OpenAI's ``tool_calls`` entries)."""

    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: str
    content: str | list[ContentPart] | None  # an assistant's may be left out: null (OpenAI's, beside tool_calls)
    name: str | None = None  # the participant's name: passed to the template, as vLLM does
    tool_calls: list[MessageToolCall] | None = None  # an assistant's (its content may then be null)
    tool_call_id: str | None = None  # a tool's answer to that call

    @model_validator(mode="before")
    @classmethod
    def _assistant_content_optional(cls, data: Any) -> Any:
        """An assistant message may leave ``content`` out (OpenAI's API: beside ``tool_calls``): null."""
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant":
            data = {**data, "content": None}
        return data

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list) or value is None:
            return handler(value)  # errors inside the list keep their locations
        return _union_error(value, handler, "a string or a list of content parts")

    def text(self) -> str | None:
        """The content as one string (text parts joined with newlines); None when null."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _SamplingFields(RequestModel):
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias
    min_tokens: int = 0  # extension (vLLM)
    prompt_logprobs: int | None = None  # extension (vLLM)
    bad_words: list[str] | None = None  # extension (vLLM): words never completed
    ignore_eos: bool = False  # extension
    include_stop_str_in_output: bool = False  # extension (vLLM): stop strings and stop tokens' text kept
    skip_special_tokens: bool = True  # extension (vLLM)
    spaces_between_special_tokens: bool = True  # extension (vLLM): no effect with a fast tokenizer (vLLM's too)
    truncate_prompt_tokens: int | None = None  # extension (vLLM): the prompt's last k tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs' tokens as "token_id:<id>"
    request_id: str | None = None  # extension (vLLM): the response's id (after "cmpl-" / "chatcmpl-")
    user: str | None = None
    # Structured outputs (``tools.structured_output``): OpenAI's, and vLLM's older and newer forms.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # Defined by vLLM, not implemented: a value other than "off" is refused (``checks.UNSUPPORTED``).
    allowed_token_ids: Any = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structural_tag: Any = None
    guided_decoding_backend: Any = None  # None, "auto" or "xgrammar" (the one here) are accepted
    guided_whitespace_pattern: Any = None
    priority: int = 0
    logits_processors: Any = None
    return_token_ids: bool = False
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

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
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' too)
    best_of: int | None = None  # only equal to n: the n choices are the n best of n
    add_special_tokens: bool = True  # extension (vLLM): a text prompt starts with bos
    suffix: Any = None  # not supported
    prompt_embeds: Any = None  # vLLM's, not supported

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


class ChatFields(RequestModel):
    """A conversation and how the chat template renders it (chat completions, ``/tokenize``)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM): the last (assistant) message is left open
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): more variables for the template
    chat_template: str | None = None  # vLLM's per-request template: refused (the server's applies)
    tools: Any = None  # the functions, for templates that describe them (DeepSeek-V3.1's)

    def message_dicts(self) -> list[dict[str, Any]]:
        """``[{"role", "content", ...}]`` for the tokenizer's chat template, text parts joined (a
        message's ``name``, an assistant's ``tool_calls``, a tool's ``tool_call_id`` kept)."""
        return [m.template_dict() for m in self.messages]

    def template_variables(self) -> dict[str, Any]:
        """The template's variables beyond the conversation: ``tools`` (and a chat request's
        ``documents``) when given, under the request's ``chat_template_kwargs``."""
        variables = {k: v for k in ("tools", "documents") if (v := getattr(self, k, None))}
        return {**variables, **(self.chat_template_kwargs or {})}

    def template_options(self) -> dict[str, Any]:
        """Keywords of ``Tokenizer.encode_chat``: continuing the final message adds no generation prompt."""
        return {"add_generation_prompt": self.generation_prompt(),
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.template_variables() or None}

    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's generation prompt (not when continuing its message)."""
        return self.add_generation_prompt and not self.continue_final_message


class ChatCompletionRequest(_SamplingFields, ChatFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens when both are given
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true
    tool_choice: Any = None  # (``tools``: ChatFields)
    add_special_tokens: bool = False  # extension (vLLM): the tokenizer's special tokens on top of the template's
    echo: bool = False  # extension (vLLM): the final message's content first, when it is the assistant's
    documents: Any = None  # extension (vLLM): a template variable (retrieval-augmented templates)
    include_reasoning: bool = True  # extension (vLLM): with a reasoning parser, false drops reasoning_content
    # Defined by OpenAI, not implemented: a value other than "off" is refused (``checks.UNSUPPORTED``).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call (``router/tools``)
    # Defined by OpenAI and accepted: they change nothing here (tags and hints for OpenAI's own service).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def echoed(self) -> str:
        """What ``echo`` puts before the output: the final message's text, when the output continues that
        role's turn (the assistant's, or any without a generation prompt), as vLLM's chat echo."""
        last = self.messages[-1]
        return (last.text() or "") if self.echo and (last.role == "assistant" or not self.generation_prompt()) else ""


AnyRequest = CompletionRequest | ChatCompletionRequest
