"""OpenAI request models and validation: error bodies, JSON type errors with a named param, and the
range and consistency checks of ``check_request``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai_toys import MSGS, api_error, chat, completion
from pydantic import ValidationError

from epserve.router.app import max_chars_per_token
from epserve.router.checks import check_request
from epserve.router.errors import (
    APIError,
    bad_request,
    context_length_exceeded,
    not_found_model,
    unauthorized,
    unavailable,
    validation_error,
)
from epserve.router.json_body import MAX_JSON_DEPTH, load_json_body
from epserve.router.protocol import ChatCompletionRequest, CompletionRequest
from epserve.tokenizer import CORPUS, Tokenizer, write_tokenizer_files

# ---------------------------------------------------------------------------------------------- errors


def test_api_error_body_and_helpers() -> None:
    e = APIError("nope", 418, "teapot_error", "short", "spout")
    assert e.body() == {
        "error": {"message": "nope", "type": "teapot_error", "param": "spout", "code": "short"}
    }
    assert str(e) == "nope"
    e = bad_request("bad n", "n")
    assert (e.status, e.type, e.code, e.param) == (400, "invalid_request_error", "invalid_value", "n")
    e = not_found_model("gpt-9")
    assert (
        e.status == 404 and e.code == "model_not_found" and e.message == "The model `gpt-9` does not exist."
    )
    e = unauthorized()
    assert (e.status, e.type, e.code) == (401, "authentication_error", "invalid_api_key")
    e = unavailable("engine is restarting")
    assert (e.status, e.type, e.code, e.message) == (
        503,
        "service_unavailable_error",
        "engine_unavailable",
        "engine is restarting",
    )
    e = context_length_exceeded(100, 90, 20)
    assert e.status == 400 and e.code == "context_length_exceeded"
    assert (
        "maximum context length is 100 tokens" in e.message
        and "110 tokens (90 in the prompt, 20" in e.message
    )


# ---------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    "model, body, param",
    [
        (CompletionRequest, {"prompt": "x", "temperature": "0.5"}, "temperature"),
        (CompletionRequest, {"prompt": "x", "temperature": True}, "temperature"),
        (CompletionRequest, {"prompt": "x", "n": True}, "n"),
        (CompletionRequest, {"prompt": "x", "n": "2"}, "n"),
        (CompletionRequest, {"prompt": "x", "n": 2.0}, "n"),
        (CompletionRequest, {"prompt": "x", "max_tokens": "16"}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "stream": "true"}, "stream"),
        (CompletionRequest, {"prompt": "x", "logprobs": True}, "logprobs"),
        (CompletionRequest, {"prompt": "x", "seed": 1.5}, "seed"),
        (CompletionRequest, {"prompt": 5}, "prompt"),
        (CompletionRequest, {"prompt": {"text": "x"}}, "prompt"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt"),
        (CompletionRequest, {"prompt": [1.5]}, "prompt"),
        (CompletionRequest, {"prompt": [True, 2]}, "prompt"),
        (CompletionRequest, {}, "prompt"),
        (CompletionRequest, {"prompt": "x", "stop": 3}, "stop"),
        (CompletionRequest, {"prompt": "x", "stop": ["a", 3]}, "stop[1]"),
        (CompletionRequest, {"prompt": "x", "stop_token_ids": [1, "2"]}, "stop_token_ids[1]"),
        (
            CompletionRequest,
            {"prompt": "x", "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
        (ChatCompletionRequest, {"messages": "hi"}, "messages"),
        (ChatCompletionRequest, {"messages": {"role": "user", "content": "hi"}}, "messages"),
        (ChatCompletionRequest, {}, "messages"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}]}, "messages[0].content"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        (ChatCompletionRequest, {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
        (
            ChatCompletionRequest,
            {"messages": [{"role": "user", "content": [{"text": "x"}]}]},
            "messages[0].content[0].type",
        ),
        (ChatCompletionRequest, {"messages": MSGS, "logprobs": 1}, "logprobs"),
        (ChatCompletionRequest, {"messages": MSGS, "top_logprobs": "5"}, "top_logprobs"),
        (ChatCompletionRequest, {"messages": MSGS, "max_completion_tokens": 1.0}, "max_completion_tokens"),
    ],
)
def test_wrong_json_types_fail_with_a_named_param(model: Any, body: dict[str, Any], param: str) -> None:
    for parse in (lambda: model.model_validate_json(json.dumps(body)), lambda: model.model_validate(body)):
        with pytest.raises(ValidationError) as info:
            parse()
        err = validation_error(info.value)
        assert err.status == 400 and err.type == "invalid_request_error"
        assert err.param == param
        assert err.message.startswith(f"{param}: ")
        assert err.body()["error"]["param"] == param


def test_validation_error_messages_are_readable() -> None:
    with pytest.raises(ValidationError) as info:
        completion(temperature="hot")
    assert validation_error(info.value).message == "temperature: Input should be a valid number (got 'hot')"
    with pytest.raises(ValidationError) as info:
        completion(prompt=[1, "a"])
    msg = validation_error(info.value).message
    assert msg.startswith("prompt: Input should be a string, a list of strings, a list of token ids")
    assert "list[int]" not in msg  # no pydantic union member names
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}])
    assert (
        validation_error(info.value).message
        == "messages[0].content[0].text: Input should be a valid string (got 3)"
    )


def test_validation_error_from_fastapi_error_list() -> None:
    errors = [
        {
            "type": "float_type",
            "loc": ("body", "temperature"),
            "msg": "Input should be a valid number",
            "input": "x",
        },
        {"type": "missing", "loc": ("body", "messages"), "msg": "Field required", "input": {}},
    ]
    err = validation_error(errors)
    assert err.status == 400 and err.param == "temperature"
    assert err.message == "temperature: Input should be a valid number (got 'x'); messages: Field required"
    err = validation_error(
        [{"type": "json_invalid", "loc": ("body", 17), "msg": "JSON decode error", "input": {}}]
    )
    assert err.status == 400 and err.param is None and "Invalid JSON" in err.message


def test_json_integers_are_valid_floats() -> None:
    r = completion(temperature=1, top_p=1, min_p=0, presence_penalty=0, frequency_penalty=0)
    assert r.temperature == 1.0 and isinstance(r.temperature, float)
    assert isinstance(r.top_p, float) and isinstance(r.min_p, float)
    assert chat(temperature=0).temperature == 0.0


def test_defaults_nulls_and_unknown_fields() -> None:
    r = completion()
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.n, r.stream, r.logprobs, r.echo) == (
        16,
        1.0,
        1.0,
        -1,
        1,
        False,
        None,
        False,
    )
    # null means the default for parameters that do not take null; unknown fields are ignored
    r = completion(temperature=None, n=None, stream=None, logit_bias={"1": 2}, not_a_field="x")
    assert (r.temperature, r.n, r.stream) == (1.0, 1, False)
    c = chat(stop=None, logprobs=None, stream_options=None, tools=[])
    assert c.stop is None and c.logprobs is False and c.max_tokens is None and c.max_completion_tokens is None


def test_prompt_forms() -> None:
    assert completion(prompt="a").prompt == "a"
    assert completion(prompt=["a", "b"]).prompt == ["a", "b"]
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=[[1, 2], [3]]).prompt == [[1, 2], [3]]


def test_chat_content_parts() -> None:
    r = chat(
        messages=[
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
            },
        ]
    )
    check_request(r)
    assert r.message_dicts() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nworld"},
    ]
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, image]}])
    e = api_error(check_request, r)
    assert e.status == 400 and "only text content is supported" in e.message
    assert e.param == "messages[0].content[1].type"
    e = api_error(check_request, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]))
    assert e.status == 400 and e.param == "messages[0].content[0].text"



def test_message_names_and_an_assistant_turn_without_content() -> None:
    """OpenAI's API lets an assistant message leave ``content`` out (beside its ``tool_calls``): null; a
    message's ``name`` reaches the template, as vLLM passes it."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = chat(messages=[{"role": "user", "content": "hi", "name": "ann"}, {"role": "assistant", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    check_request(r)
    assert r.message_dicts() == [{"role": "user", "content": "hi", "name": "ann"},
                                 {"role": "assistant", "content": None, "tool_calls": [call]},
                                 {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
    assert chat(messages=[{"role": "assistant"}]).messages[0].content is None


# ---------------------------------------------------------------------------------------------- body


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"prompt": "a\\ud800"}', "prompt"),
        (b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800x"}]}]}',
         "messages[0].content[0].text"),
        (b'{"prompt": "x", "stop": "\\uDBFF"}', "stop"),
        (b'{"prompt": "x", "\\ud800": 1}', "\\ud800"),  # a key, shown escaped
    ],
)
def test_lone_surrogates_are_refused_where_they_are(body: bytes, param: str) -> None:
    e = api_error(load_json_body, body)
    assert (e.status, e.code, e.param) == (400, "invalid_unicode", param)
    json.dumps(e.body(), ensure_ascii=False).encode()  # the error itself is valid text


@pytest.mark.parametrize(
    "body, code",
    [
        (b'{"prompt": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "invalid_json"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),  # json's RecursionError
        (b'{"n": ' + b"9" * 5000 + b"}", "invalid_json"),  # more digits than int() converts
        (b"[1, 2]", "invalid_json"),
        (b"\xff{}", "invalid_json"),
    ],
)
def test_unparseable_bodies_are_400(body: bytes, code: str) -> None:
    e = api_error(load_json_body, body)
    assert e.status == 400 and e.code == code


def test_valid_bodies_load() -> None:
    assert load_json_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}  # a pair
    deep = b'{"prompt": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert load_json_body(deep)
    assert load_json_body(b'{"prompt": [' + b", ".join([b"7"] * 10_000) + b"]}")["prompt"][-1] == 7


def test_json_schema_says_what_validation_does() -> None:
    props = CompletionRequest.model_json_schema()["properties"]
    assert {"type": "null"} in props["temperature"]["anyOf"] and props["temperature"]["maximum"] == 2
    assert (props["top_k"]["minimum"], props["top_k"]["maximum"]) == (-1, 2**31 - 1)
    assert props["logprobs"]["maximum"] == 20 and props["stop_token_ids"]["items"]["maximum"] == 2**32 - 1
    chat_props = ChatCompletionRequest.model_json_schema()["properties"]
    assert "maximum" not in chat_props["logprobs"]  # a flag there
    assert chat_props["top_logprobs"]["maximum"] == 20


def test_no_token_spans_more_characters_than_the_bound(tmp_path) -> None:
    """What lets the router refuse a text that cannot fit before tokenizing it."""
    tok = Tokenizer.from_dir(write_tokenizer_files(tmp_path, 512, 1024))
    per_token = max_chars_per_token(tok)
    texts = [CORPUS, "\U0001f600é中文" * 50, "aaaa" * 300, " " * 500, "<｜User｜>" * 20]
    assert all(len(t) <= per_token * len(tok.encode(t, add_special_tokens=False)) for t in texts)


def test_unknown_fields_are_said_once_each(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="epserve.router.protocol"):
        for _ in range(3):
            completion(surely_unknown_a=1, surely_unknown_b=2)
            chat(surely_unknown_a=1, messages=[{"role": "user", "content": "x", "surely_unknown_c": 3}])
    said = [r.getMessage() for r in caplog.records]
    for name, model in (("a", "CompletionRequest"), ("b", "CompletionRequest"), ("a", "ChatCompletionRequest"),
                        ("c", "ChatMessage")):
        assert sum(f"'surely_unknown_{name}' of {model}" in m for m in said) == 1, said
    assert len(said) == 4
