"""Shared helpers of the OpenAI protocol tests: build validated requests and catch an ``APIError``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epserve.router.errors import APIError
from epserve.router.protocol import ChatCompletionRequest, CompletionRequest

MSGS = [{"role": "user", "content": "hi"}]


def completion(**kw: Any) -> CompletionRequest:
    kw.setdefault("prompt", "Hello")
    return CompletionRequest.model_validate_json(json.dumps(kw))


def chat(**kw: Any) -> ChatCompletionRequest:
    kw.setdefault("messages", MSGS)
    return ChatCompletionRequest.model_validate_json(json.dumps(kw))


def api_error(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value
