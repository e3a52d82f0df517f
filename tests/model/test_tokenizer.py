"""The built-in byte-level BPE tokenizer and its chat template."""

from __future__ import annotations

import random

import pytest

from epserve.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    Tokenizer,
    build_tokenizer,
    write_tokenizer_files,
)

TEXTS = [
    "The capital of France is Paris.",
    "  leading and trailing spaces  \n\ttabs\r\nand newlines\n",
    "naïve café — 日本語のテキスト, 한국어, русский текст, עברית, العربية",
    "emoji 🙂👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "combining: e\u0301 a\u0308 \u200b zero-width, nul \x00 and bell \x07",
    "def f(x):\n    return x ** 2  # comment\n",
]


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> Tokenizer:
    return Tokenizer.from_dir(tiny_ckpt)


def _random_text(rng: random.Random, n: int) -> str:
    chars = []
    while len(chars) < n:
        cp = rng.choice(
            [rng.randrange(32, 127), rng.randrange(0x80, 0x3000), rng.randrange(0x1F300, 0x1FAFF)]
        )
        chars.append(chr(cp))
    return "".join(chars)


def test_special_tokens_and_vocab(tok):
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.bos_token == BOS_TOKEN and tok.eos_token == EOS_TOKEN
    assert tok.token_to_id(USER_TOKEN) is not None and tok.token_to_id(ASSISTANT_TOKEN) is not None
    assert tok.vocab_size == 512  # the tiny model's vocabulary, filled by BPE merges


def test_vocab_never_exceeds_model_vocab():
    assert build_tokenizer(300).get_vocab_size() <= 300
    assert 300 < build_tokenizer(8192).get_vocab_size() <= 8192  # the corpus runs out of merges first
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(100)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_roundtrip(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text


def test_random_unicode_roundtrip(tok):
    rng = random.Random(0)
    for _ in range(50):
        text = _random_text(rng, rng.randrange(1, 60))
        assert tok.decode(tok.encode(text)) == text


def test_bpe_merges_common_words(tok):
    text = "the capital of the weather"
    assert len(tok.encode(text, add_special_tokens=False)) <= len(text.encode()) // 2


def test_decode_drops_ids_outside_tokenizer_vocab(tok):
    ids = tok.encode("hello", add_special_tokens=False)
    assert tok.decode([*ids, tok.vocab_size, 10**6]) == "hello"


def test_training_is_deterministic(tmp_path, tiny_ckpt):
    write_tokenizer_files(tmp_path, vocab_size=512, model_max_length=2048)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / f).read_bytes() == (tiny_ckpt / f).read_bytes()


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tok.apply_chat_template(messages)
    assert text.startswith(BOS_TOKEN + "Be brief.")
    assert text.endswith(USER_TOKEN + "What is 2+2?" + ASSISTANT_TOKEN)
    assert f"{USER_TOKEN}Hi there{ASSISTANT_TOKEN}Hello!{EOS_TOKEN}" in text
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(ASSISTANT_TOKEN)
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids[-1] == tok.token_to_id(ASSISTANT_TOKEN)


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [{"role": "user"}],
        [{"content": "x"}],
        [{"role": "robot", "content": "x"}],
        [{"role": "assistant", "content": None}],  # null content only beside tool_calls
        [{"role": "user", "content": 3}],
        ["user: hi"],
    ],
)
def test_bad_messages_raise_value_error(tok, messages):
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template(messages)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_transformers_autotokenizer_agrees(tok, tiny_ckpt):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tiny_ckpt)
    assert hf.bos_token_id == tok.bos_token_id and hf.eos_token_id == tok.eos_token_id
    for text in TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == tok.encode(text)
        assert hf.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(messages)
