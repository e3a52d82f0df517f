"""Tool calls in chat responses (``--tool-call-parser deepseek_v3 --enable-auto-tool-choice``): a
DeepSeek-V3 tool-call block in the output becomes ``message.tool_calls`` (content before it kept,
``finish_reason: tool_calls``), streamed as ``tool_calls`` deltas the ``openai`` client reassembles; a
conversation with the assistant's calls (content null) and the tools' answers renders through the chat
template; what the server cannot do with tools is a 400 saying why."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from epserve.router.server import RouterOptions
from epserve.router.tool_calls import TOOL_CALL_PARSERS
from epserve.router.tools import tool_mode
from epserve.tokenizer import Tokenizer, write_tokenizer_files
from tests.router_toys import ScriptedRouter, build_over

MODEL = "tiny-tools"
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET", "h24": true}')]
OUTPUT = "Let me look." + TOOL_CALL_PARSERS["deepseek_v3"]().render(CALLS)
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("get_weather", "get_time")]


class ScriptedEngine(ScriptedRouter):
    """Answers every request with ``OUTPUT`` (its tokens set by the fixture)."""

    prompts: list[list[int]] = []
    params: list = []


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tok_dir: Path = write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=512, model_max_length=2048)
    tok = Tokenizer.from_dir(tok_dir)
    ScriptedEngine.tokens = tok.encode(OUTPUT, add_special_tokens=False)
    assert tok.decode(ScriptedEngine.tokens) == OUTPUT  # (the markers survive detokenizing)
    options = RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL,
                            tool_call_parser="deepseek_v3", enable_auto_tool_choice=True)
    server = build_over(ScriptedEngine, options)
    with TestClient(server.app) as http:
        yield tok, openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)


MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


def test_calls_in_a_whole_response(served) -> None:
    _, client = served
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2 and all(c.type == "function" for c in
                                                                       choice.message.tool_calls)


def test_calls_streamed_reassemble(served) -> None:
    _, client = served
    calls: dict[int, dict[str, str]] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            call["name"] += piece.function.name or ""
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Let me look." and finish == "tool_calls"
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == CALLS
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())
    assert "tool" not in content and "｜" not in content


def test_parallel_tool_calls_false_keeps_the_first_call(served) -> None:
    _, client = served
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False)
    assert [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls] == CALLS[:1]
    names = [p.function.name for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False, stream=True)
        for p in (c.choices[0].delta.tool_calls or ()) if p.function.name]
    assert names == ["get_weather"]


def test_required_allows_several_calls_unless_parallel_is_off(served) -> None:
    parallel = tool_mode(TOOLS, "required", "deepseek_v3", False)
    single = tool_mode(TOOLS, "required", "deepseek_v3", False, parallel=False)
    assert json.loads(parallel.constraint.spec)["format"]["type"] == "or"  # one block of 1..4 calls
    assert json.loads(single.constraint.spec)["format"]["type"] == "sequence"  # one call


def test_tool_choice_none_leaves_the_text(served) -> None:
    _, client = served
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.content == OUTPUT and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_a_tool_round_trip_renders_through_the_template(served) -> None:
    tok, client = served
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none")
    prompt = tok.decode(ScriptedEngine.prompts[-1], skip_special_tokens=False)
    assert TOOL_CALL_PARSERS["deepseek_v3"]().render([("get_weather", '{"city": "Paris"}')]) in prompt
    assert "<｜tool▁output▁begin｜>20 degrees<｜tool▁output▁end｜>" in prompt


def test_what_the_server_cannot_do_with_tools_is_a_400(served) -> None:
    _, client = served
    for kw, param in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                      ({"tools": [{"type": "function", "function": {}}]}, "tools"),
                      ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **{"tools": TOOLS, **kw})
        assert info.value.body["param"] == param, kw
    with pytest.raises(Exception, match="tool-call-parser"):
        tool_mode(TOOLS, "auto", None, False)
    with pytest.raises(Exception, match="enable-auto-tool-choice"):
        tool_mode(TOOLS, "auto", "deepseek_v3", False)
    forced = tool_mode(TOOLS, {"type": "function", "function": {"name": "get_time"}}, "deepseek_v3", False)
    tag = json.loads(forced.constraint.spec)
    assert forced.parser == "deepseek_v3" and "get_time" in forced.constraint.spec and "get_weather" not in str(tag)
    with pytest.raises(ValueError, match="tool-call-parser"):
        RouterOptions(model=None, engines=(), enable_auto_tool_choice=True)
