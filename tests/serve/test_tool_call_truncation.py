"""A tool-call block cut by ``max_tokens`` where the tokenizer has no single tokens for DeepSeek's markers
(the project's byte-level one: a marker is 10 or more tokens, and a cut may fall inside one of its
characters, which the detokenizer writes as U+FFFD): whole and streamed through the ``openai`` client,
what parsed comes back with ``finish_reason: length``, and no piece of a marker, nor the replacement
character, in the arguments or the content. The parser's own rules for it beside."""

from __future__ import annotations

import openai
import pytest

from epserve.router.server import RouterOptions
from epserve.router.tool_call_events import ContentDelta
from epserve.router.tool_calls import CALL_END, CALLS_BEGIN, TOOL_CALL_PARSERS, held_len
from tests.router_toys import ScriptedRouter, openai_over, scripted_tokenizer

MODEL = "tiny-cut"
CALLS = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]
TEXT = "Let me look."
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name, _ in CALLS]


class CutEngine(ScriptedRouter):
    """Answers with ``tokens`` (set per case), finishing with ``length``."""

    finish_reason = "length"
    prompts: list[list[int]] = []
    params: list = []


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tok_dir, tok = scripted_tokenizer(tmp_path_factory)
    options = RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL,
                            tool_call_parser="deepseek_v3", enable_auto_tool_choice=True)
    with openai_over(CutEngine, options) as client:
        yield tok, client


def _streamed(client: openai.OpenAI) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}],
                                                tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_call_cut_anywhere_shows_no_marker(served) -> None:
    tok, client = served
    output = TEXT + TOOL_CALL_PARSERS["deepseek_v3"]().render(CALLS)
    tokens = tok.encode(output, add_special_tokens=False)
    assert len(tokens) > 200 and tok.decode(tokens) == output
    cut_inside_a_char = 0
    for n in range(1, len(tokens), 3):  # (every third of the 241 cuts: a marker is 12 to 24 tokens)
        CutEngine.tokens = tokens[:n]
        text = tok.decode(tokens[:n])
        cut_inside_a_char += text.endswith("\ufffd")
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "?"}], tools=TOOLS)
        choice = out.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        content = choice.message.content or ""
        assert choice.finish_reason == "length", n
        assert _streamed(client) == (content, calls, "length"), n
        for (name, arguments), (want_name, want_arguments) in zip(calls, CALLS):
            assert name == want_name and want_arguments.startswith(arguments), (n, text, arguments)
        assert "\ufffd" not in content, (n, text, content)
        assert TEXT.startswith(content), (n, text, content)
        if CALLS_BEGIN in text:  # the block began: the text before it, nothing of the markers
            assert content == TEXT, (n, text, content)
    assert cut_inside_a_char > 5  # (the cuts inside a marker's multi-byte characters were tried)


def test_the_tail_a_cut_marker_leaves_is_held() -> None:
    fence_end = "\n```" + CALL_END
    assert held_len('{"a": 1}\n```<｜tool▁call', [fence_end]) == len("\n```<｜tool▁call")
    assert held_len('{"a": 1}\n```<｜tool▁call\ufffd', [fence_end]) == len("\n```<｜tool▁call\ufffd")
    assert held_len("Hi <\ufffd", [CALLS_BEGIN]) == 2  # "<" then the first bytes of "｜"
    assert held_len("Hi \ufffd", [CALLS_BEGIN]) == 0  # a cut character, but "<" is one byte: not a marker's
    assert held_len("Hi <｜tool\ufffd", [CALLS_BEGIN]) == 7  # cut inside "▁"
    assert held_len("Hi <｜to\ufffd", [CALLS_BEGIN]) == 0  # "o" is ASCII: the cut character is not the marker's
    parser = TOOL_CALL_PARSERS["deepseek_v3"]()
    assert parser.feed("Hi <｜tool") == [ContentDelta("Hi ")]
    assert parser.flush(cut=True) == []  # cut by max_tokens: the piece of the marker is dropped
    parser = TOOL_CALL_PARSERS["deepseek_v3"]()
    assert parser.feed("Hi <") == [ContentDelta("Hi ")] and parser.feed("\ufffd") == []
    assert parser.flush() == []  # a marker cut inside a character, whatever ended the output
    assert parser.extract("Hi <｜tool", cut=True) == ("Hi ", []) and parser.extract("Hi <\ufffd") == ("Hi ", [])
    assert parser.extract("Hi <｜tool") == ("Hi <｜tool", [])  # the model ended there itself: its text
