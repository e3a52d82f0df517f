"""``--reasoning-parser deepseek_r1`` in chat responses: the reasoning as ``reasoning_content`` beside
``content``, whole and streamed token by token through the ``openai`` client; where the rendered prompt
left ``<think>`` open (V3.1's thinking mode) the output starts inside the reasoning, otherwise it is all
answer; vLLM's ``include_reasoning: false`` drops the reasoning; completions are untouched. Beside them, a
chat stream's ``continuous_usage_stats``."""

from __future__ import annotations

import json

import pytest

from epserve.router.server import RouterOptions
from tests.router_toys import ScriptedRouter, openai_over, scripted_tokenizer

MODEL = "tiny-r1"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% endif %}{% endif %}")
OUTPUT = "Two and two: four, surely.</think>The answer is 4."


class ScriptedEngine(ScriptedRouter):
    """Answers every request with ``OUTPUT`` (its tokens set by the fixture)."""

    prompts: list[list[int]] = []
    params: list = []


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    tok_dir, tok = scripted_tokenizer(tmp_path_factory)
    ScriptedEngine.tokens = tok.encode(OUTPUT, add_special_tokens=False)
    options = RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL,
                            chat_template=TEMPLATE, reasoning_parser="deepseek_r1")
    with openai_over(ScriptedEngine, options) as client:
        yield client


MESSAGES = [{"role": "user", "content": "2+2?"}]


def test_reasoning_content_whole_and_streamed(client) -> None:
    thinking = {"chat_template_kwargs": {"thinking": True}}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=thinking)
    message = whole.choices[0].message
    assert message.reasoning_content == "Two and two: four, surely." and message.content == "The answer is 4."
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=thinking, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)
    assert sum(1 for d in deltas if getattr(d, "reasoning_content", None)) > 1  # streamed as it came
    # the answer only starts after the reasoning: no delta carries content before the last reasoning one
    kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas if d.content or
             getattr(d, "reasoning_content", None)]
    assert kinds == ["r"] * kinds.count("r") + ["c"] * kinds.count("c") and kinds.count("c") > 0


def test_no_open_think_block_means_all_answer(client) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES)  # thinking off: no <think> opened
    assert whole.choices[0].message.reasoning_content is None
    assert whole.choices[0].message.content == OUTPUT


def test_completions_are_untouched(client) -> None:
    out = client.completions.create(model=MODEL, prompt="x")
    assert out.choices[0].text == OUTPUT


def test_a_constraint_applies_to_the_answer_after_the_reasoning(client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt,
                                   extra_body={"chat_template_kwargs": {"thinking": True}})
    wrapped = ScriptedEngine.params[-1].structured
    assert wrapped.kind == "structural_tag" and "</think>" in wrapped.spec and '"n"' in wrapped.spec
    client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt)  # not thinking
    plain = ScriptedEngine.params[-1].structured
    assert plain.kind == "json_schema" and json.loads(plain.spec) == schema


def test_include_reasoning_false_drops_it(client) -> None:
    extra = {"chat_template_kwargs": {"thinking": True}, "include_reasoning": False}
    message = client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra).choices[0].message
    assert message.reasoning_content is None and message.content == "The answer is 4."
    deltas = [c.choices[0].delta for c in client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                                         extra_body=extra, stream=True)]
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."
    assert not any(getattr(d, "reasoning_content", None) for d in deltas)


def test_continuous_usage_stats_in_a_chat_stream(client) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk, the role's first, carries the usage so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, stream_options=options))
    assert all(c.usage is not None for c in chunks) and len({c.usage.prompt_tokens for c in chunks}) == 1
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == len(ScriptedEngine.tokens)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]
