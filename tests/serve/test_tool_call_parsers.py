"""DeepSeek tool-call parsers: whole outputs, streams split anywhere (accumulated as the ``openai``
client does), truncated and broken blocks, the grammar's prefix and suffix."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from epserve.router.tool_call_events import ContentDelta, ToolCallDelta, openai_delta
from epserve.router.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    TOOL_CALL_PARSERS,
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    make_tool_call_id,
)

EOS = "<｜end▁of▁sentence｜>"
V3, V31 = "deepseek_v3", "deepseek_v31"
WEATHER = ("get_current_weather", '{"location": "Beijing", "unit": "celsius"}')
TIME = ("get_time", '{"timezone": "Europe/Paris"}')
SEARCH = ("web_search", '{"query": "天气 北京 😀", "filters": {"site": ["a.cn", "b.com"], "n": 3}}')
TRICKY = ("run_code", '{"code": "print(\\"```\\")\\n# <｜ not a marker", "lang": "py"}')
PRETTY = ("create_event", '{\n  "title": "Standup",\n  "attendees": ["ana", "bo"]\n}')


def block(fmt: str, *calls: tuple[str, str]) -> str:
    return TOOL_CALL_PARSERS[fmt]().render(calls)


# (format, output, expected content, expected [(name, arguments)]); outputs as the models write them.
WELL_FORMED = [
    (V3, block(V3, WEATHER) + EOS, None, [WEATHER]),
    (V3, "Let me check both.\n\n" + block(V3, WEATHER, TIME) + EOS, "Let me check both.\n\n",
     [WEATHER, TIME]),
    (V3, block(V3, SEARCH, TRICKY, PRETTY), None, [SEARCH, TRICKY, PRETTY]),
    (V3, block(V3, ("ping", "{}")), None, [("ping", "{}")]),
    (V31, block(V31, WEATHER) + EOS, None, [WEATHER]),
    (V31, "I'll look that up. " + block(V31, WEATHER, TIME), "I'll look that up. ", [WEATHER, TIME]),
    (V31, block(V31, SEARCH, TRICKY, PRETTY) + EOS, None, [SEARCH, TRICKY, PRETTY]),
    (V31, "好的，我来查一下。" + block(V31, ("ping", "{}")), "好的，我来查一下。", [("ping", "{}")]),
]

# Outputs the grammar must bear: no block, bad JSON, skipped or missing end markers, broken blocks.
ODD = [
    (V3, "The weather in Paris is sunny, 21 °C.", "The weather in Paris is sunny, 21 °C.", []),
    (V31, "Use <｜tool to call; <｜tool▁call▁begin｜> alone is text.", "Use <｜tool to call; "
          "<｜tool▁call▁begin｜> alone is text.", []),
    (V3, block(V3, ("get_weather", '{"city": "Paris"')), None, [("get_weather", '{"city": "Paris"')]),
    (V31, block(V31, ("get_weather", "city=Paris")), None, [("get_weather", "city=Paris")]),
    (V31, f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{}}{CALLS_END}", None, [("f", "{}")]),
    (V31, f"{CALLS_BEGIN}{CALL_BEGIN}f{SEP}{{\"a\": 1}}{CALL_BEGIN}g{SEP}[]{CALL_END}{CALLS_END}", None,
     [("f", '{"a": 1}'), ("g", "[]")]),
    (V3, f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n```json\n{{}}```{CALL_END}{CALLS_END}", None,
     [("f", "{}")]),
    (V3, f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP} spaced \n```json\n{{}}\n```{CALL_END}\n\n {CALLS_END}",
     None, [("spaced", "{}")]),
    (V3, block(V3, TIME) + "\nDone.", None, [TIME]),
    (V31, "Hi" + block(V31, TIME)[: -len(CALLS_END)] + " oops" + CALL_BEGIN + "g" + SEP + "{}" + CALL_END,
     "Hi" + "oops" + CALL_BEGIN + "g" + SEP + "{}" + CALL_END, [TIME]),
    (V31, f"{CALLS_BEGIN}{CALL_BEGIN}f{CALL_END}{SEP}{{}}{CALL_END}{CALLS_END}",
     f"{CALL_BEGIN}f{CALL_END}{SEP}{{}}{CALL_END}{CALLS_END}", []),
    (V31, f"x{CALLS_BEGIN}{CALL_BEGIN} {SEP}{{}}{CALL_END}", f"x{CALL_BEGIN} {SEP}{{}}{CALL_END}", []),
    (V3, f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}f\n{{}}{CALL_END}{CALLS_END}",
     f"{CALL_BEGIN}function{SEP}f\n{{}}{CALL_END}{CALLS_END}", []),
    (V3, f"{CALLS_BEGIN}{CALL_BEGIN}function{CALLS_END}", f"{CALL_BEGIN}function{CALLS_END}", []),
]
CASES = [pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(WELL_FORMED + ODD)]


def run(fmt: str, pieces: list[str]) -> list:
    parser = TOOL_CALL_PARSERS[fmt]()
    events = [e for p in pieces for e in parser.feed(p)]
    return events + parser.flush()


def accumulate(events: list) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    """Content, calls and ids as a client accumulates a stream (and checks of the stream's shape)."""
    content, calls, ids = "", [], []
    for e in events:
        if isinstance(e, ContentDelta):
            assert e.text
            content += e.text
        elif e.index == len(calls):  # a new call: its first delta has the id and the name
            assert e.id and e.name and e.arguments == ""
            calls.append([e.name, ""])
            ids.append(e.id)
        else:
            assert e.index == len(calls) - 1 and e.id is None and e.name is None and e.arguments
            calls[-1][1] += e.arguments
    return content or None, [tuple(c) for c in calls], ids


def splits(text: str, rng: random.Random, n_random: int = 25):
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    for _ in range(n_random):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def whole(fmt: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = TOOL_CALL_PARSERS[fmt]().extract(text)
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_extract(fmt, text, content, calls):
    got_content, got = TOOL_CALL_PARSERS[fmt]().extract(text)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", c.id) for c in got)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_stream_split_anywhere_equals_extract(fmt, text, content, calls):
    for pieces in splits(text, random.Random(text)):
        got_content, got_calls, ids = accumulate(run(fmt, pieces))
        assert (got_content, got_calls) == (content, calls), pieces
        assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("fmt,text,content,calls", CASES[: len(WELL_FORMED)])
def test_nothing_is_held_back_once_it_cannot_be_a_marker(fmt, text, content, calls):
    """Fed a character at a time: the content is all sent when the block begins, and a call's
    arguments all sent when its closing begins (``<｜ not a marker`` was held only while it could be)."""
    parser = TOOL_CALL_PARSERS[fmt]()
    checkpoints, pos = {text.index(CALLS_BEGIN): None}, 0
    for i, (name, args) in enumerate(calls):
        pos = text.index(parser.call_prefix(name) + args, pos) + len(parser.call_prefix(name) + args)
        checkpoints[pos] = i
    events = []
    for k, ch in enumerate(text):
        if k in checkpoints:
            got_content, got_calls, _ = accumulate(events)
            if checkpoints[k] is None:
                assert (got_content, got_calls) == (content, [])
            else:
                assert got_calls == calls[: checkpoints[k] + 1]
        events += parser.feed(ch)
    assert len(checkpoints) == len(calls) + 1


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_truncated_anywhere_stream_equals_extract(fmt, text, content, calls):
    """Cut at every point (``max_tokens``), streamed in random chunks then flushed: as extracted."""
    rng = random.Random(2)
    for cut in range(len(text) + 1):
        part = text[:cut]
        pieces = next(itertools.islice(splits(part, rng, 1), len(part) + 2, None))  # a random chunking
        assert accumulate(run(fmt, pieces))[:2] == whole(fmt, part), cut


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_a_stream_never_sends_what_it_must_take_back(fmt, text, content, calls):
    """Before the flush, what a client holds at every point is a prefix of the final result: a
    content prefix, the final calls' names (never sent before they are complete), argument prefixes."""
    parser, events = TOOL_CALL_PARSERS[fmt](), []
    for ch in text:
        events += parser.feed(ch)
        got_content, got_calls, _ = accumulate(events)
        assert (content or "").startswith(got_content or "") and len(got_calls) <= len(calls)
        for (name, args), (full_name, full_args) in zip(got_calls, calls):
            assert name == full_name and full_args.startswith(args)


def openai_client_view(fmt: str, pieces: list[str]):
    """The message the ``openai`` client's own stream accumulation builds from our chunks."""
    state, parser = ChatCompletionStreamState(), TOOL_CALL_PARSERS[fmt]()
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    deltas = [{"role": "assistant", "content": ""}]
    deltas += [openai_delta(parser.feed(p)) for p in pieces] + [openai_delta(parser.flush())]
    for delta in filter(None, deltas):
        state.handle_chunk(ChatCompletionChunk.model_validate(
            {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}))
    finish = "tool_calls" if parser.tools_called else "stop"
    state.handle_chunk(ChatCompletionChunk.model_validate(
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}))
    return state.get_final_completion().choices[0].message, parser


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_openai_client_accumulation_reassembles_extract(fmt, text, content, calls):
    rng = random.Random(3)
    for pieces in [[text], list(text), *itertools.islice(splits(text, rng, 5), len(text) + 2, None)]:
        message, parser = openai_client_view(fmt, pieces)
        assert (message.content or None) == content
        got = [(t.function.name, t.function.arguments) for t in message.tool_calls or []]
        assert got == calls
        assert [t.id for t in message.tool_calls or []] == [c.id for c in parser.streamed_calls]
        assert [(c.name, c.arguments) for c in parser.streamed_calls] == calls


def test_first_delta_names_the_call_then_arguments_follow():
    text = "Sure." + block(V31, WEATHER, TIME)
    ids = iter(["id-a", "id-b"])
    parser = DeepSeekV31ToolParser(make_id=lambda: next(ids))
    assert parser.feed("Sure." + CALLS_BEGIN[:5]) == [ContentDelta("Sure.")]
    events = parser.feed(text[5 + 5 : text.index(SEP) + len(SEP) + 6])
    assert events == [ToolCallDelta(0, "", "id-a", "get_current_weather"), ToolCallDelta(0, '{"loca')]
    assert parser.feed(text[text.index(SEP) + len(SEP) + 6 :]) == [
        ToolCallDelta(0, 'tion": "Beijing", "unit": "celsius"}'), ToolCallDelta(1, "", "id-b", "get_time"),
        ToolCallDelta(1, '{"timezone": "Europe/Paris"}')]
    assert parser.flush() == [] and parser.tools_called
    function = {"name": "get_current_weather", "arguments": '{"loca'}
    entry = {"index": 0, "id": "id-a", "type": "function", "function": function}
    assert openai_delta(events) == {"tool_calls": [entry]}


def test_v3_fence_is_held_until_it_proves_to_be_the_end():
    parser = DeepSeekV3ToolParser()
    parser.feed(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n```json\n")
    assert parser.feed('{"a": 1}\n``') == [ToolCallDelta(0, '{"a": 1}')]
    assert parser.feed("`x") == [ToolCallDelta(0, "\n```x")]  # not the end after all
    assert parser.feed("}\n```" + CALL_END[:3]) == [ToolCallDelta(0, "}")]
    assert parser.feed(CALL_END[3:] + CALLS_END + EOS) == []
    assert parser.streamed_calls[0].arguments == '{"a": 1}\n```x}'


def test_text_after_the_block_is_dropped_and_a_partial_marker_flushes_as_content():
    parser = DeepSeekV31ToolParser()
    assert parser.feed(block(V31, TIME) + "\nanything")[-1] == ToolCallDelta(0, TIME[1])
    assert parser.flush() == []
    parser = DeepSeekV31ToolParser()
    assert parser.feed("a <｜tool▁calls") == [ContentDelta("a ")]
    assert parser.flush() == [ContentDelta("<｜tool▁calls")]


def test_arguments_are_verbatim_not_reserialized():
    args = '{ "b" : 1,\t"a": "é\\u00e9" }'
    for fmt in (V3, V31):
        assert whole(fmt, block(fmt, ("f", args))) == (None, [("f", args)])
        assert json.loads(args) == {"b": 1, "a": "éé"}


V3_RECORDED = (  # vLLM's DeepSeek-V3 parser docstring example
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_current_weather\n```json\n'
    '{"location": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
    'get_current_weather\n```json\n{"location": "Beijing"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    '<｜end▁of▁sentence｜>')
V31_RECORDED = (  # SGLang's DeepSeek-V3.1 detector docstring example
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{"location": "Tokyo"}'
    '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>{"location": "Paris"}'
    '<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>')


def test_render_is_the_chat_templates_format():
    assert block(V3, ("get_current_weather", '{"location": "Beijing"}'),
                 ("get_current_weather", '{"location": "Beijing"}')) + EOS == V3_RECORDED
    assert block(V31, ("get_current_weather", '{"location": "Tokyo"}'),
                 ("get_current_weather", '{"location": "Paris"}')) + EOS == V31_RECORDED


def vllm_reference(fmt: str, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """vLLM's whole-output extraction, restated: the content before the block, and each call matched
    by its regular expression (V3: type, name, fenced JSON on one line each; V3.1: non-greedy)."""
    if CALLS_BEGIN not in text:
        return text, []
    if fmt == V3:
        found = re.findall(f"{CALL_BEGIN}(.*){SEP}(.*)\n```json\n(.*)\n```{CALL_END}", text)
        calls = [(name, args) for _, name, args in found]
    else:
        calls = re.findall(f"{CALL_BEGIN}(.*?){SEP}(.*?){CALL_END}", text)
    return text[: text.index(CALLS_BEGIN)] or None, calls


@pytest.mark.parametrize("fmt,text", [(V3, V3_RECORDED), (V31, V31_RECORDED)] + [
    (c[0], c[1]) for c in WELL_FORMED if "\n  " not in c[1]])
def test_matches_vllm_on_well_formed_output(fmt, text):
    assert whole(fmt, text) == vllm_reference(fmt, text)


def test_grammar_prefix_and_suffix():
    v3, v31 = DeepSeekV3ToolParser(), DeepSeekV31ToolParser()
    assert v3.call_prefix("f") == "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
    assert v3.call_suffix() == "\n```<｜tool▁call▁end｜>"
    assert v31.call_prefix("f") == "<｜tool▁call▁begin｜>f<｜tool▁sep｜>"
    assert v31.call_suffix() == "<｜tool▁call▁end｜>"
    for p in (v3, v31):
        assert (p.block_begin, p.block_end) == ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
        forced = p.block_begin + p.call_prefix("get_time") + TIME[1] + p.call_suffix() + p.block_end
        assert forced == block(p.name, TIME)
        assert whole(p.name, forced) == (None, [TIME])
    assert (v3.call_separator, v31.call_separator) == ("\n", "")


def test_marker_spellings():
    """Fullwidth bars (U+FF5C) and lower one-eighth blocks (U+2581), as in DeepSeek's tokenizers."""
    for marker, words in [(CALLS_BEGIN, "tool calls begin"), (CALLS_END, "tool calls end"),
                          (CALL_BEGIN, "tool call begin"), (CALL_END, "tool call end"), (SEP, "tool sep")]:
        assert marker == "<\uff5c" + words.replace(" ", "\u2581") + "\uff5c>"


def test_registry_and_ids():
    assert TOOL_CALL_PARSERS == {"deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser}
    assert all(p.name == k for k, p in TOOL_CALL_PARSERS.items())
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", make_tool_call_id())
    assert openai_delta([]) is None
    assert openai_delta([ContentDelta("a"), ContentDelta("b")]) == {"content": "ab"}


@pytest.mark.parametrize("fmt", [V3, V31])
def test_long_arguments_full_of_marker_lookalikes(fmt):
    """A few thousand characters of near-markers, a character at a time: all of it arrives, in order,
    with nothing held back longer than a marker."""
    args = '{"text": "' + "a <｜tool▁call b\\n``` <｜ " * 150 + '"}'
    text = "Text. " + block(fmt, ("echo", args), TIME)
    start, longest_hold = text.index(args), len("\n```" + CALL_END) - 1
    parser, sent = TOOL_CALL_PARSERS[fmt](), 0
    for k, ch in enumerate(text, 1):
        sent += sum(len(e.arguments) for e in parser.feed(ch) if isinstance(e, ToolCallDelta) and e.index == 0)
        assert 0 <= min(max(k - start, 0), len(args)) - sent <= longest_hold
    assert parser.flush() == [] and [(c.name, c.arguments) for c in parser.streamed_calls] == [("echo", args), TIME]
