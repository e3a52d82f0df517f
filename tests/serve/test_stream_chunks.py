"""Streams carry a chunk for every engine message that brought tokens, as vLLM's do, even while the
tokens' text is held back (the bytes of a character split over several tokens): a client's inter-chunk
gap is the time per output token, not a burst each time a character completes."""

from __future__ import annotations

import pytest

from epserve.router.server import RouterOptions
from tests.router_toys import ScriptedRouter, openai_over, scripted_tokenizer

MODEL = "tiny"
OUTPUT = "naïve → 世界 ok"  # characters of two and three UTF-8 bytes, each likely several tokens


class ScriptedEngine(ScriptedRouter):
    prompts: list[list[int]] = []
    params: list = []


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory):
    tok_dir, tok = scripted_tokenizer(tmp_path_factory)
    ScriptedEngine.tokens = tok.encode(OUTPUT, add_special_tokens=False)
    # the test means something only if some token ends inside a character
    assert any("\ufffd" in tok.decode(ScriptedEngine.tokens[: i + 1]) for i in range(len(ScriptedEngine.tokens)))
    options = RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL,
                            chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with openai_over(ScriptedEngine, options) as client:
        yield client


def test_a_completion_stream_has_a_chunk_per_token(client) -> None:
    chunks = [c for c in client.completions.create(model=MODEL, prompt="x", stream=True) if c.choices]
    assert len(chunks) == len(ScriptedEngine.tokens)
    assert "".join(c.choices[0].text for c in chunks) == OUTPUT
    assert any(c.choices[0].text == "" for c in chunks[:-1])  # held-back bytes: an empty chunk, not none
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_chat_stream_has_a_chunk_per_token(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant"
    assert len(deltas) == 1 + len(ScriptedEngine.tokens)  # the role chunk, then one per token
    assert "".join(d.content or "" for d in deltas) == OUTPUT
    assert all(d.content is not None for d in deltas[1:-1])  # an empty content, never a delta without one
