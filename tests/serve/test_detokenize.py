"""Incremental detokenization and stop-string matching for streamed output."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from epserve.router.detokenize import IncrementalDetokenizer, StopStringMatcher
from epserve.tokenizer import Tokenizer, write_tokenizer_files

MULTILINGUAL = [
    "héllo wörld, café crème brûlée à la française",
    "日本語のテキストと中文文本，还有한국어",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 mixed with text: naïve façade",
    "Ελληνικά και русский текст — with dashes… and “quotes”",
    "The morning train left the station a few minutes late.",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, vocab_size=512, model_max_length=2048)
    return Tokenizer.from_dir(path)


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call got."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(det: IncrementalDetokenizer, ids: Sequence[int], rng: random.Random | None = None) -> list[str]:
    """Feed ``ids`` one at a time (or in random chunks of 1..3 with ``rng``); return the pieces."""
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randint(1, 3) if rng else 1
        pieces.append(det.add(ids[i : i + k]))
        i += k
    return pieces


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multibyte_text_one_token_at_a_time(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 4  # the small vocabulary really splits characters into bytes
    det = IncrementalDetokenizer(tok)
    pieces = stream(det, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert det.text == text
    assert det.flush() == ""
    assert det.token_ids == ids


def test_partial_character_is_held_then_released(tok: Tokenizer) -> None:
    ids = tok.encode("ab", add_special_tokens=False) + tok.encode("😀", add_special_tokens=False)
    assert tok.decode(ids[-4:-3]) == "\ufffd"  # one byte of the 4-byte emoji
    det = IncrementalDetokenizer(tok)
    out = [det.add([i]) for i in ids]
    assert "".join(out[:-4]) == "ab"  # text before the emoji is not held back
    assert out[-4:-1] == ["", "", ""]  # the emoji's first three bytes are held
    assert out[-1] == "😀"


def test_text_before_an_incomplete_char_in_the_same_window_is_emitted(tok: Tokenizer) -> None:
    a = tok.encode("a", add_special_tokens=False)
    e = tok.encode("é", add_special_tokens=False)
    assert len(e) == 2
    det = IncrementalDetokenizer(tok)
    assert det.add([*a, e[0]]) == "a"  # 'a' final, the lead byte of 'é' held back
    assert det.add([e[1]]) == "é"
    assert det.text == "aé"


def test_flush_releases_a_trailing_broken_character(tok: Tokenizer) -> None:
    ids = tok.encode("x世", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    got = "".join(det.add([i]) for i in ids[:-1])
    assert got == "x"
    tail = det.flush()
    assert tail.startswith("\ufffd")
    assert got + tail == tok.decode(ids[:-1])
    assert det.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    for _ in range(400):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        context = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        det = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_token_ids=context)
        pieces = stream(det, ids, rng)
        pieces.append(det.flush())
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(pieces) == full
        assert det.text == full
        if "\ufffd" not in full:
            assert all("\ufffd" not in p for p in pieces)


def test_random_multibyte_token_streams(tok: Tokenizer) -> None:
    """Ids drawn from real multi-byte text, shuffled into new (mostly valid) sequences."""
    pool = [i for t in MULTILINGUAL for i in tok.encode(t, add_special_tokens=False)]
    rng = random.Random(7)
    for _ in range(300):
        start = rng.randrange(len(pool))
        ids = pool[start : start + rng.randint(1, 30)]
        full = tok.decode(ids)
        det = IncrementalDetokenizer(tok)
        pieces = stream(det, ids)
        tail = det.flush()
        assert "".join(pieces) + tail == full
        if "\ufffd" not in full:
            assert all("\ufffd" not in p for p in pieces) and tail == ""


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<｜User｜>hi<｜Assistant｜>", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id and 2 in ids and 3 in ids
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, skip_special_tokens=True)
    assert "".join(stream(kept, ids)) + kept.flush() == tok.decode(ids, skip_special_tokens=False)
    assert "".join(stream(skipped, ids)) + skipped.flush() == "hi"
    assert kept.text.startswith("<｜begin▁of▁sentence｜><｜User｜>")


def test_prompt_context_does_not_leak_into_output(tok: Tokenizer) -> None:
    prompt = tok.encode("Question: what is 世界? Answer:", add_special_tokens=True)
    out = tok.encode(" 世界 means world 😀", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    pieces = stream(det, out)
    assert "".join(pieces) == " 世界 means world 😀"
    assert det.token_ids == out
    # a prompt that ends in the middle of a character is not used as context
    broken = tok.encode("é", add_special_tokens=False)[:1]
    det = IncrementalDetokenizer(tok, prompt_token_ids=broken)
    assert "".join(stream(det, out)) + det.flush() == tok.decode(out)


def test_cost_per_token_is_bounded(tok: Tokenizer) -> None:
    counting = CountingTokenizer(tok)
    text = " ".join(MULTILINGUAL) * 10
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > 2000
    det = IncrementalDetokenizer(counting)
    pieces = stream(det, ids)
    assert "".join(pieces) == text
    assert max(counting.lengths) <= 8  # a short window, never the whole sequence
    assert len(counting.lengths) <= 2 * len(ids) + 2


def byte_token(tok: Tokenizer, byte: int) -> int:
    """The id of the token that is just ``byte`` (a byte-level BPE spells bytes as GPT-2's characters)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = chr(byte) if byte in printable else chr(256 + [b for b in range(256) if b not in printable].index(byte))
    token = tok.token_to_id(char)
    assert token is not None and tok.decode([token]) == "\ufffd"
    return token


@pytest.mark.parametrize("case", ["continuation byte", "lead byte", "lead byte, then skipped special tokens"])
def test_cost_per_token_is_bounded_while_the_text_ends_in_an_incomplete_character(tok: Tokenizer, case: str) -> None:
    """Issue 45: a text that keeps ending in U+FFFD (a byte token forced again and again, or a lead byte
    followed by tokens with no text) re-decoded everything since its last whole character at every token."""
    lead, follow = byte_token(tok, 0xE2), byte_token(tok, 0x82)  # (E2 82 AC is the euro sign)
    n = 2000
    ids = {"continuation byte": [follow] * n, "lead byte": [lead] * n,
           "lead byte, then skipped special tokens": [lead] + [2] * (n - 1)}[case]
    counting = CountingTokenizer(tok)
    det = IncrementalDetokenizer(counting)
    pieces = [*stream(det, ids), det.flush()]
    assert "".join(pieces) == tok.decode(ids)
    held = 1 if case != "lead byte, then skipped special tokens" else n  # (only the last can still change)
    assert "".join(pieces[:-1]) == "\ufffd" * (n - held)
    assert max(counting.lengths) <= 8 and len(counting.lengths) <= 2 * n + 2  # as for any text
    assert IncrementalDetokenizer(tok).add([lead, follow, byte_token(tok, 0xAC)]) == "€"


def test_empty_add(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok)
    assert det.add([]) == ""
    assert det.flush() == "" and det.text == "" and det.token_ids == []


# ---------------------------------------------------------------------------------------------- stops


def feed_all(m: StopStringMatcher, chunks: Sequence[str]) -> tuple[str, bool]:
    out, stopped = [], False
    for c in chunks:
        piece, stopped = m.feed(c)
        out.append(piece)
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, bool]:
    """Earliest-starting occurrence wins; of two starting together, the shorter."""
    hits = [(i, i + len(s)) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, False
    start, end = min(hits)
    return text[: end if include else start], True


def test_no_stops_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("hello wor") == ("hello wor", False)
    assert m.feed("ld") == ("ld", False)
    assert m.flush() == ""


def test_stop_within_one_feed() -> None:
    m = StopStringMatcher(["\n\n"])
    assert m.feed("one\n\ntwo") == ("one", True)
    assert m.matched == "\n\n"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_spanning_feeds_and_held_tail() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)  # "ST" could begin STOP: held
    assert m.feed("O") == ("", False)
    assert m.feed("P and more") == ("", True)
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("OW") == ("STOW", False)  # not a stop after all: released
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"  # end of generation releases the held tail


def test_include_stop_str() -> None:
    m = StopStringMatcher(["</s>"], include_stop_str=True)
    assert m.feed("answer</") == ("answer", False)
    assert m.feed("s> junk") == ("</s>", True)


def test_stop_at_very_start() -> None:
    m = StopStringMatcher(["Hello"])
    assert m.feed("Hello world") == ("", True)
    m = StopStringMatcher(["Hello"])
    assert m.feed("Hel") == ("", False)
    assert m.feed("lo") == ("", True)


def test_earliest_stop_wins_regardless_of_order() -> None:
    for stops in (["world", "o w"], ["o w", "world"]):
        m = StopStringMatcher(stops)
        assert m.feed("hello world") == ("hell", True)
        assert m.matched == "o w"
    # a longer stop that starts earlier wins over a shorter one that completes first
    m = StopStringMatcher(["bcd", "abcdef"], include_stop_str=True)
    assert m.feed("xabcd") == ("x", False)
    assert m.feed("ef!") == ("abcdef", True)
    m = StopStringMatcher(["bcd", "abcdef"])
    assert m.feed("xabcd") == ("x", False)
    assert m.feed("eX") == ("a", True)  # "abcdef" failed: "bcd" at 2 is the earliest complete stop


def test_matcher_agrees_with_whole_text_reference() -> None:
    rng = random.Random(3)
    for _ in range(500):
        alphabet = "abc d"
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        ]
        include = rng.random() < 0.5
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert feed_all(StopStringMatcher(stops, include), chunks) == reference(text, stops, include), (
            text,
            stops,
            chunks,
        )


def feeds_reference(stops: Sequence[str], include: bool,
                    chunks: Sequence[str]) -> tuple[list[tuple[str, bool]], str, str | None]:
    """Brute force over the whole text after each feed: what each feed returns, what ``flush`` returns and
    the stop matched. A feed returns the text up to the earliest index from which the rest could still
    begin a stop (the held tail: a proper prefix of one), unless a complete stop starts at or before it:
    then up to the earliest-starting one (of two, the shorter), through its end with ``include``."""
    text, emitted, out, matched = "", 0, [], None
    for chunk in chunks:
        if matched is not None:
            out.append(("", True))
            continue
        text += chunk
        hits = [(i, i + len(s), s) for s in stops if (i := text.find(s)) >= 0]
        hold = next(i for i in range(len(text) + 1)
                    if any(len(text) - i < len(s) and s.startswith(text[i:]) for s in stops))
        if hits and min(hits)[0] <= hold:
            start, end, matched = min(hits)
            out.append((text[emitted : end if include else start], True))
        else:
            out.append((text[emitted:hold], False))
            emitted = hold
    return out, ("" if matched is not None else text[emitted:]), matched


def test_matcher_agrees_with_brute_force_after_every_feed() -> None:
    """Random small alphabets (so stops overlap, repeat themselves and half-match often) and random
    splits, empty pieces included: every feed returns what the brute force says, and so does flush."""
    rng = random.Random(25)
    for case in range(3000):
        alphabet = rng.choice(["ab", "ab", "abc", "aab ", "xyz\n"])
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.3:  # a periodic stop: long borders, the automata's hard case
            unit = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))
            stops.append((unit * 6)[: rng.randint(2, 12)] + rng.choice(alphabet))
        if rng.random() < 0.3:
            text = "".join(rng.choice(stops) + rng.choice(["", rng.choice(alphabet)]) for _ in range(rng.randint(0, 8)))
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        chunks, i = [], 0
        while i < len(text) or (not chunks and rng.random() < 0.5):
            k = rng.choice([0, 1, 1, 1, 2, 3, 5, 40])
            chunks.append(text[i : i + k])
            i += k
        include = rng.random() < 0.5
        m = StopStringMatcher(stops, include)
        got = [m.feed(c) for c in chunks]
        expected, flushed, matched = feeds_reference(list(dict.fromkeys(stops)), include, chunks)
        assert (got, m.flush(), m.matched) == (expected, flushed, matched), (case, stops, chunks, include)


def test_matcher_work_grows_with_the_text_not_the_stops() -> None:
    """15 stop strings of 60k characters, the text a prefix of the last one (held back as it grows) and
    the others sharing its beginning: no automaton computes more of its stop's prefix function than
    the text fed, and the tail held back is the text itself, returned whole by flush."""
    text = "".join(random.Random(5).choice("ab ") for _ in range(6000))
    stops = [text[: 100 * k] + "#" * (60_000 - 100 * k) for k in range(1, 15)] + [text + "#" * 54_000]
    m = StopStringMatcher(stops)
    for i in range(0, len(text), 4):
        assert m.feed(text[i : i + 4]) == ("", False)
    assert all(len(a._pi) <= len(text) + 1 for a in m._automata)
    assert m.flush() == text


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_detokenizer_and_matcher_together(tok: Tokenizer, tmp_path: Path) -> None:
    text = "Réponse: 42 😀 END of the answer"
    ids = tok.encode(text, add_special_tokens=False)
    det, m = IncrementalDetokenizer(tok), StopStringMatcher([" END"])
    out = []
    for i in ids:
        piece, stopped = m.feed(det.add([i]))
        out.append(piece)
        if stopped:
            break
    assert "".join(out) == "Réponse: 42 😀"
