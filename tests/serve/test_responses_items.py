"""A Response's output items in the order the model wrote them (an in-process router over a scripted engine,
``--reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3 --enable-auto-tool-choice``): the reasoning
as a ``reasoning`` item, the text as a ``message`` item, each call as a ``function_call`` item, whole and
streamed; the stream read by the ``openai`` client's ``responses.stream`` helper (which checks that every
item's events agree) gives the same Response as the whole one; an engine error mid-stream is an ``error``
event and ``response.failed``."""

from __future__ import annotations

import pytest

from epserve.router.engine_client import EngineUnavailable
from epserve.router.server import RouterOptions
from epserve.router.tool_calls import TOOL_CALL_PARSERS
from tests.router_toys import ScriptedRouter, openai_over, scripted_tokenizer

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
