"""A choice's text stages (``router/text_stages``): fed an output a few tokens at a time, the chain of
detokenizing, stop strings, reasoning and tool calls gives in pieces what the whole-text parsers give for
the whole output; a stop string cuts the tokens and finishes the piece with ``stop``."""

from __future__ import annotations

import pytest

from epserve.router.detokenize import OutputText
from epserve.router.reasoning import DeepSeekR1ReasoningParser
from epserve.router.text_stages import TextPiece, run_stages, text_stages
from epserve.router.tool_calls import TOOL_CALL_PARSERS
from tests.router_toys import scripted_tokenizer

CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
OUTPUT = "Two and two: four.</think>Let me look." + TOOL_CALL_PARSERS["deepseek_v31"]().render(CALLS)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return scripted_tokenizer(tmp_path_factory)[1]


def _run(stages, tokens: list[int], size: int, finish: str = "length") -> list[TextPiece]:
    pieces = []
    for i in range(0, len(tokens), size):
        last = i + size >= len(tokens)
        pieces.append(run_stages(stages, TextPiece(tuple(tokens[i:i + size]), finish if last else None)))
        if pieces[-1].finish_reason:
            break
    return pieces


@pytest.mark.parametrize("size", [1, 3])
def test_the_chain_splits_as_the_whole_text_parsers_do(tok, size: int) -> None:
    tokens = tok.encode(OUTPUT, add_special_tokens=False)
    output = OutputText(tok, True, [1, 2], [], False, [])
    stages = text_stages(output, "deepseek_r1", thinking=True, tool_parser="deepseek_v31")
    pieces = _run(stages, tokens, size)
    reasoning, content = DeepSeekR1ReasoningParser(True).parse(OUTPUT)
    text, calls = TOOL_CALL_PARSERS["deepseek_v31"]().extract(content or "")
    assert "".join(p.reasoning for p in pieces) == reasoning
    assert "".join(p.text for p in pieces) == text
    streamed: dict[int, list[str]] = {}
    for p in pieces:
        for call in p.tool_calls:
            entry = streamed.setdefault(call["index"], [call["function"].get("name", ""), ""])
            entry[1] += call["function"]["arguments"]
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [(c.name, c.arguments) for c in calls]
    assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert sum(len(p.token_ids) for p in pieces) == len(tokens)


def test_a_stop_string_cuts_the_tokens_and_finishes(tok) -> None:
    tokens = tok.encode("one two three four", add_special_tokens=False)
    stages = text_stages(OutputText(tok, True, [], ["three"], False, []), None, include_reasoning=False)
    pieces = _run(stages, tokens, 2)
    assert "".join(p.text for p in pieces) == "one two "
    assert pieces[-1].finish_reason == "stop" and sum(len(p.token_ids) for p in pieces) < len(tokens)
    assert not any(p.reasoning or p.tool_calls for p in pieces)


def test_without_reasoning_sent_the_answer_is_still_apart(tok) -> None:
    tokens = tok.encode("thinking.</think>answer", add_special_tokens=False)
    stages = text_stages(OutputText(tok, True, [], [], False, []), "deepseek_r1", thinking=True,
                         include_reasoning=False)
    pieces = _run(stages, tokens, 1)
    assert "".join(p.text for p in pieces) == "answer" and not any(p.reasoning for p in pieces)
