"""The DeepSeek-R1 reasoning parser: whole responses, streams split anywhere, the prompt's mode."""

from __future__ import annotations

import random

import pytest

from epserve.router.reasoning import (
    REASONING_PARSERS,
    THINK_END,
    THINK_START,
    DeepSeekR1ReasoningParser,
    ReasoningDelta,
    partial_suffix_len,
    starts_in_reasoning,
)

R1_ANSWER = (
    "Okay, the user wants 17 * 24. Let me compute: 17 * 20 = 340, 17 * 4 = 68, so 408.\n"
    "Double-check: 24 * 17 = 240 + 168 = 408. Yes.\n</think>\n\n17 × 24 = **408**."
)

# (output, start_in_reasoning, enabled, expected parse). Outputs as DeepSeek-R1 and V3.1 write them.
CASES = [
    pytest.param(R1_ANSWER, True, True, (R1_ANSWER.split(THINK_END)[0], "\n\n17 × 24 = **408**."), id="r1"),
    pytest.param("<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", True, True,
                 ("\nThe user greets me.\n", "\n\nHello! How can I help?"), id="explicit-think"),
    pytest.param("<think>\nhmm\n</think>Hi", False, True, ("\nhmm\n", "Hi"), id="old-template-opens-it"),
    pytest.param("Let me think about the proof. First, assume n is", True, True,
                 ("Let me think about the proof. First, assume n is", None), id="no-end-cut-off"),
    pytest.param("", True, True, (None, None), id="empty"),
    pytest.param("<think>", True, True, (None, None), id="only-start"),
    pytest.param("</think>The answer is 4.", True, True, (None, "The answer is 4."), id="empty-reasoning"),
    pytest.param("I should answer briefly.</think>", True, True, ("I should answer briefly.", None),
                 id="empty-content"),
    pytest.param("<think>a <think>b</think> c</think>d", True, True, ("a <think>b", " c</think>d"),
                 id="nested"),
    pytest.param("x </thin k> y < / think > z <<//think></think>ok", True, True,
                 ("x </thin k> y < / think > z <<//think>", "ok"), id="marker-lookalikes"),
    pytest.param("<thinking>about it</think>done", True, True, ("<thinking>about it", "done"),
                 id="not-a-start-marker"),
    pytest.param("a<think>b", True, True, ("a<think>b", None), id="start-marker-later"),
    pytest.param("考虑一下 😀 用户的问题</think>答案是：四。", True, True, ("考虑一下 😀 用户的问题", "答案是：四。"),
                 id="multibyte"),
    pytest.param("Hello</think>x", False, True, (None, "Hello</think>x"), id="outside-no-start"),
    pytest.param("a<think>b</think>c", False, True, (None, "a<think>b</think>c"), id="outside-start-later"),
    pytest.param("<think>r</think>c", True, False, (None, "<think>r</think>c"), id="thinking-off"),
    pytest.param("The capital of France is Paris.", False, False, (None, "The capital of France is Paris."),
                 id="v31-non-thinking"),
    pytest.param("<thi", True, True, ("<thi", None), id="partial-start-inside"),
    pytest.param("<thi", False, True, (None, "<thi"), id="partial-start-outside"),
    pytest.param("reasoning </thi", True, True, ("reasoning </thi", None), id="partial-end"),
]


def stream(parser: DeepSeekR1ReasoningParser, pieces: list[str]):
    """The deltas of ``pieces`` fed one by one, and the flush."""
    return [parser.feed(p) for p in pieces], parser.flush()


def joined(deltas: list[ReasoningDelta]) -> tuple[str | None, str | None]:
    return "".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None


def splits(text: str, rng: random.Random):
    """Every 2-way split, one character at a time, and random chunkings (sizes 1..9)."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    for _ in range(30):
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(0, 9)  # empty pieces too: a token may decode to nothing yet
            pieces.append(text[i : i + k])
            i += k
        yield pieces


@pytest.mark.parametrize("text,inside,enabled,expected", CASES)
def test_parse(text, inside, enabled, expected):
    assert DeepSeekR1ReasoningParser(inside, enabled=enabled).parse(text) == expected


@pytest.mark.parametrize("text,inside,enabled,expected", CASES)
def test_stream_split_anywhere_equals_the_whole_parse(text, inside, enabled, expected):
    rng = random.Random(len(text))
    for pieces in splits(text, rng):
        deltas, last = stream(DeepSeekR1ReasoningParser(inside, enabled=enabled), pieces)
        assert joined([*deltas, last]) == expected, pieces


@pytest.mark.parametrize("split", range(len("abc</think>def") + 1))
def test_a_split_end_marker_never_shows_as_text(split):
    text = "abc</think>def"
    head, tail = text[:split], text[split:]
    for pieces in ([head, tail], [head, *tail], [*head, tail]):
        deltas, last = stream(DeepSeekR1ReasoningParser(), pieces)
        for d in [*deltas, last]:
            assert not set(d.reasoning) & set("</>") and not set(d.content) & set("</>"), pieces
        assert joined([*deltas, last]) == ("abc", "def")


def test_marker_and_text_on_both_sides_in_one_delta():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("Let me see") == ("Let me see", "")
    assert not parser.reasoning_ended
    assert parser.feed(". Done.</think>\n\nIt is 408.") == (". Done.", "\n\nIt is 408.")
    assert parser.reasoning_ended
    assert parser.feed("</think> more") == ("", "</think> more")  # a later marker is content
    assert parser.flush() == ("", "")


def test_end_marker_over_three_deltas():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("so 408.</") == ("so 408.", "")
    assert parser.feed("thi") == ("", "")
    assert parser.feed("nk>Answer") == ("", "Answer")


def test_held_back_text_is_released_when_it_cannot_be_a_marker():
    parser = DeepSeekR1ReasoningParser()
    assert parser.feed("if a </") == ("if a ", "")
    assert parser.feed("b then") == ("</b then", "")
    assert parser.feed("<") == ("", "")
    assert parser.feed("<") == ("<", "")  # "<<" cannot start "</think>": only the last "<" is held
    assert parser.flush() == ("<", "")


def test_holds_back_at_most_a_marker_less_one_character():
    text = "x</thin</thi</th</t</<" * 20
    parser, fed, out = DeepSeekR1ReasoningParser(), 0, 0
    for ch in text:
        d = parser.feed(ch)
        fed, out = fed + 1, out + len(d.reasoning) + len(d.content)
        assert fed - out <= len(THINK_END) - 1
    assert out + len(parser.flush().reasoning) == len(text)


def test_leading_start_marker_split_across_deltas():
    parser = DeepSeekR1ReasoningParser(start_in_reasoning=False)
    assert [parser.feed(p) for p in ("<", "thi", "nk>\nhm", "m</think>ok")] == [
        ("", ""), ("", ""), ("\nhm", ""), ("m", "ok")]
    parser = DeepSeekR1ReasoningParser(start_in_reasoning=False)
    assert parser.feed("<thi") == ("", "")
    assert parser.feed("s is content") == ("", "<this is content")
    assert parser.reasoning_ended


def test_thinking_off_passes_everything_through():
    parser = DeepSeekR1ReasoningParser(enabled=False)
    assert parser.reasoning_ended
    assert parser.feed("<think>") == ("", "<think>")
    assert parser.feed("a</think>b") == ("", "a</think>b")
    assert parser.flush() == ("", "")


def test_streamed_after_flush_nothing_is_left():
    parser = DeepSeekR1ReasoningParser()
    parser.feed("abc</thi")
    assert parser.flush() == ("</thi", "")
    assert parser.flush() == ("", "")


def vllm_r1_extract(output: str) -> tuple[str | None, str | None]:
    """vLLM's DeepSeek-R1 ``extract_reasoning`` as documented there: drop the first ``<think>``
    (everything before it too), then split at ``</think>``; no end means all reasoning. Its empty
    reasoning is ``""``, normalized to ``None`` here as this parser reports it."""
    before, start, after = output.partition(THINK_START)
    output = after if start else before
    if THINK_END not in output:
        return output or None, None
    reasoning, _, content = output.partition(THINK_END)
    return reasoning or None, content or None


# vLLM drops a <think> found anywhere (and the text before it), this parser only a leading one.
VLLM_COMPARABLE = [c for c in CASES if c.values[1] and c.values[2]
                   and (THINK_START not in c.values[0] or c.values[0].startswith(THINK_START))]


@pytest.mark.parametrize("text,inside,enabled,expected", VLLM_COMPARABLE)
def test_matches_vllm_for_outputs_opened_by_the_prompt(text, inside, enabled, expected):
    assert DeepSeekR1ReasoningParser().parse(text) == vllm_r1_extract(text)


def test_differs_from_vllm_only_on_a_later_start_marker():
    assert len(VLLM_COMPARABLE) >= 10
    assert vllm_r1_extract("a<think>b") == ("b", None)
    assert DeepSeekR1ReasoningParser().parse("a<think>b") == ("a<think>b", None)


R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 17 * 24?<｜Assistant｜><think>\n"
V31_THINKING = "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Who are you?<｜Assistant｜></think>I am DeepSeek" \
               "<｜end▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜><think>"
V31_NON_THINKING = "<｜begin▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜></think>"
V3_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜>"


@pytest.mark.parametrize("prompt,inside", [
    (R1_PROMPT, True), (V31_THINKING, True), (V31_NON_THINKING, False), (V3_PROMPT, False), ("", False),
    ("<think>a</think><think>", True), ("<think>a</think>", False), ("</think><think>x</think>", False),
])
def test_starts_in_reasoning(prompt, inside):
    assert starts_in_reasoning(prompt) is inside


def test_parser_for_the_rendered_prompt():
    assert DeepSeekR1ReasoningParser.for_prompt(R1_PROMPT).parse("r</think>a") == ("r", "a")
    assert DeepSeekR1ReasoningParser.for_prompt(V31_THINKING).parse("no end yet") == ("no end yet", None)
    assert DeepSeekR1ReasoningParser.for_prompt(V31_NON_THINKING).parse("2") == (None, "2")
    off = DeepSeekR1ReasoningParser.for_prompt(V31_NON_THINKING, enabled=False)
    assert off.parse("<think>x</think>2") == (None, "<think>x</think>2")


@pytest.mark.parametrize("text,markers,n", [
    ("abc", ["</think>"], 0), ("abc<", ["</think>"], 1), ("abc</think", ["</think>"], 7),
    ("abc</think>", ["</think>"], 0), ("ab", ["abc", "b"], 2), ("", ["x"], 0), ("x<", ["<a", "x<b"], 2),
])
def test_partial_suffix_len(text, markers, n):
    assert partial_suffix_len(text, markers) == n


def test_registry_has_vllm_flag_value():
    assert REASONING_PARSERS == {"deepseek_r1": DeepSeekR1ReasoningParser}
    assert DeepSeekR1ReasoningParser().parse(R1_ANSWER)[1] == "\n\n17 × 24 = **408**."
