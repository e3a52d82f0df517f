"""``epserve serve --speculative mtp``: the OpenAI API answers exactly as plain decoding does (text,
finish reason, usage), stop strings cut accepted drafts where one token at a time would have stopped,
and Prometheus exports the draft acceptance counters."""

from __future__ import annotations

import openai
import pytest

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from tests.serve_harness import Proc, metric, wait_http_ok

pytestmark = pytest.mark.slow

MODEL = "counter"
ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "128", "--block-size", "8", "--max-model-len", "512"]
PROMPTS = ["Once upon a time", "A class definition", "Tell me", "Names"]


@pytest.fixture(scope="module")
def server(counter_ckpt, tmp_path_factory):
    port = free_port()
    proc = Proc(["serve", str(counter_ckpt), "--port", str(port), "--served-model-name", MODEL, "--speculative", "mtp",
                 "--num-speculative-tokens", "3", *ENGINE_ARGS], tmp_path_factory.mktemp("mtp-serve") / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        proc.kill_all()


@pytest.fixture(scope="module")
def plain(counter_ckpt):
    return LLM(counter_ckpt, dtype="float32", num_blocks=128, block_size=8, max_model_len=512, num_speculative_tokens=0)


def test_answers_and_usage_equal_plain_decoding(server, plain):
    _, client = server
    for prompt in PROMPTS:
        want = plain.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 20


def test_stop_strings_cut_accepted_drafts_exactly(server, plain):
    _, client = server
    tok = plain.tokenizer
    for prompt in PROMPTS:
        ids = plain.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].token_ids
        full = tok.decode(ids)
        stop = next(full[i:i + 2] for i in range(6, len(full) - 2)
                    if full[i:i + 2].strip() and "\ufffd" not in full[i:i + 2] and full.index(full[i:i + 2]) == i)
        # plain decoding stops at the first token whose text completes the stop string
        needed = next(m for m in range(1, len(ids) + 1) if stop in tok.decode(ids[:m]))
        kw = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
        out = client.completions.create(**kw)
        assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == needed
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full[: full.index(stop)]
        assert chunks[-1].usage.completion_tokens == needed


def test_spec_decode_metrics_are_exported(server):
    url, client = server
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=16, temperature=0)
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    drafted = metric(text, "epserve:spec_decode_num_draft_tokens_total")
    accepted = metric(text, "epserve:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafted
    assert metric(text, "epserve:spec_decode_num_drafts_total") > 0
    per_pos = [metric(text, "epserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(3)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
