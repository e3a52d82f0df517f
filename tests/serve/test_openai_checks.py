"""``check_request``: the ranges of every field (also what the engine's gRPC fields hold), the fields
this server does not implement refused by name, and valid requests passing."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from openai_toys import api_error, chat, completion

from epserve.router.checks import check_request
from epserve.router.protocol import ChatCompletionRequest, CompletionRequest
from epserve.router.unsupported import UNSUPPORTED

# ---------------------------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_p": 1e-46}, "top_p"),  # 0 as the engine's float32
        ({"stop_token_ids": [2**32]}, "stop_token_ids"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["a", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias['5']"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": ["x"] * 257}, "bad_words"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"xml": "x"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"request_id": ""}, "request_id"),
        ({"request_id": "x" * 257}, "request_id"),
    ],
)
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_range_checks(kind: str, kw: dict[str, Any], param: str) -> None:
    req = completion(**kw) if kind == "completion" else chat(**kw)
    e = api_error(check_request, req)
    assert e.status == 400 and e.param == param and e.type == "invalid_request_error"
    assert param in e.message


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 2**32}, "max_tokens"),
        ({"logprobs": 2**32}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [3, -1]}, "prompt"),
    ],
)
def test_completion_checks(kw: dict[str, Any], param: str) -> None:
    e = api_error(check_request, completion(**kw))
    assert e.status == 400 and e.param == param


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2**32}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 2**32}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"store": True}, "store"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"documents": "text"}, "documents"),
        ({"documents": ["text"]}, "documents"),
    ],
)
def test_chat_checks(kw: dict[str, Any], param: str) -> None:
    e = api_error(check_request, chat(**kw))
    assert e.status == 400 and e.param == param


def test_range_messages_name_the_allowed_range() -> None:
    assert "[0, 2]" in api_error(check_request, completion(temperature=3)).message
    assert "(0, 1]" in api_error(check_request, completion(top_p=0)).message
    assert "[1, 16]" in api_error(check_request, completion(n=100)).message
    assert "[0, 20]" in api_error(check_request, completion(logprobs=50)).message


def test_nan_is_out_of_range() -> None:
    # Python's json module (which FastAPI uses) accepts NaN
    r = CompletionRequest.model_validate(json.loads('{"prompt": "x", "temperature": NaN}'))
    assert math.isnan(r.temperature)
    assert api_error(check_request, r).param == "temperature"


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"n": 16, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 1},
        {"temperature": 2, "top_p": 0.01, "top_k": -1, "min_p": 0, "seed": -(2**63)},
        {"top_k": 2**31 - 1, "stop_token_ids": [2**32 - 1], "max_tokens": 2**32 - 1, "seed": 2**63 - 1},
        {"stop": ["s"] * 16, "stop_token_ids": [0, 1]},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"logprobs": 0},
        {"logprobs": 20, "max_tokens": 1},
        {"prompt": [[1], [2, 3]]},
        {"prompt": ["a", "b"]},
        {"max_tokens": None},
    ],
)
def test_valid_completion_requests_pass(kw: dict[str, Any]) -> None:
    check_request(completion(**kw))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"logprobs": True},
        {"logprobs": True, "top_logprobs": 0},
        {"logprobs": True, "top_logprobs": 20},
        {"max_tokens": 1, "max_completion_tokens": 5},
        {"stop": "\n"},
    ],
)
def test_valid_chat_requests_pass(kw: dict[str, Any]) -> None:
    check_request(chat(**kw))


# ------------------------------------------------------------------- fields refused unless "off", and no-ops

# A value other than "off" for each field of the table (the table and this list must name the same fields).
NOT_OFF = {
    "suffix": "tail", "functions": [{"name": "f"}], "function_call": {"name": "f"}, "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "reasoning_effort": "high", "verbosity": "low", "store": True, "allowed_token_ids": [1, 2],
    "use_beam_search": True, "length_penalty": 0.5, "structural_tag": "{}", "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ", "priority": 1, "logits_processors": ["pkg.Processor"], "return_token_ids": True,
    "cache_salt": "salt", "kv_transfer_params": {"do_remote_decode": True}, "vllm_xargs": {"k": 1},
    "mm_processor_kwargs": {"num_crops": 4}, "prompt_embeds": "AAAA",
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_each_unsupported_field_is_refused_unless_off(name: str) -> None:
    assert set(NOT_OFF) == set(UNSUPPORTED)
    makers = [make for make, model in ((completion, CompletionRequest), (chat, ChatCompletionRequest))
              if name in model.model_fields]
    assert makers, f"{name} is declared by no request model"
    for make in makers:
        for off in UNSUPPORTED[name][0]:
            check_request(make(**{name: off}))
        check_request(make())  # left out
        e = api_error(check_request, make(**{name: NOT_OFF[name]}))
        error = e.body()["error"]
        assert e.status == 400 and error["param"] == name and error["code"] == "unsupported_parameter"
        assert error["message"].startswith(f"{name} is not supported by this server (")


@pytest.mark.parametrize("kw", [
    {"user": "u-1"}, {"metadata": {"k": "v"}}, {"service_tier": "auto"}, {"prompt_cache_key": "k"},
    {"safety_identifier": "s"}, {"spaces_between_special_tokens": False}, {"guided_decoding_backend": "xgrammar"},
    {"parallel_tool_calls": False}, {"include_reasoning": False}, {"echo": True}, {"documents": [{"text": "d"}]},
    {"truncate_prompt_tokens": -1}, {"request_id": "req-1"}, {"return_tokens_as_token_ids": True},
    {"add_special_tokens": True}, {"include_stop_str_in_output": True}, {"skip_special_tokens": False},
])
def test_accepted_fields_pass(kw: dict[str, Any]) -> None:
    """Fields that change nothing here (OpenAI's tags and hints; vLLM's spaces_between_special_tokens, which a
    fast tokenizer ignores in vLLM too) and the vLLM fields the router implements."""
    name = next(iter(kw))
    for make, model in ((completion, CompletionRequest), (chat, ChatCompletionRequest)):
        if name in model.model_fields:
            check_request(make(**kw))
    assert name in ChatCompletionRequest.model_fields
