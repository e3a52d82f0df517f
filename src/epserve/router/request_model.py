"""The base of the HTTP layer's request models (``protocol``, ``tokenize``, ``responses``): pydantic's
strict mode (a value of the wrong JSON type is an error rather than being coerced; a JSON integer is still a
valid float), ``null`` meaning a parameter's default as in OpenAI's API, unknown fields ignored with each
name said once in the log, and the JSON schemas (the OpenAPI document) saying what ``checks`` enforces:
``null`` allowed where it means the default, and the ranges."""

from __future__ import annotations

import logging
import typing
from types import NoneType, UnionType
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidatorFunctionWrapHandler, model_validator
from pydantic_core import PydanticCustomError

from epserve.chat_template import ROLES
from epserve.messages.sampling import MAX_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # entries, as OpenAI's API takes (each choice's engine request carries them all)
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
    "logit_bias": {"maxProperties": MAX_LOGIT_BIAS,
                   "additionalProperties": {"minimum": -MAX_BIAS, "maximum": MAX_BIAS}},
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



def union_error(value: Any, handler: ValidatorFunctionWrapHandler, expected: str) -> Any:
    """Run the union validator; on failure report one readable error instead of one per member."""
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError(
            "type_error", "Input should be {expected}", {"expected": expected}
        ) from None
