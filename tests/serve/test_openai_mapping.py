"""From OpenAI requests to the engine and back: max_tokens against the context length, the
sampling-parameter mapping, stop strings, and logprobs formatting."""

from __future__ import annotations

import json

import pytest
from openai_toys import api_error, chat, completion

from epserve.messages.sampling import SamplingParams, TokenLogprobs
from epserve.router.checks import bad_words_token_ids, resolve_max_tokens, stop_strings, to_sampling_params
from epserve.router.detokenize import OutputText
from epserve.router.generation_defaults import GenerationDefaults
from epserve.router.logprobs import chat_logprobs, completion_logprobs
from epserve.tokenizer import Tokenizer, write_tokenizer_files


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, vocab_size=512, model_max_length=2048)
    return Tokenizer.from_dir(path)


# ---------------------------------------------------------------------------------------------- context


def test_context_length_math() -> None:
    assert resolve_max_tokens(completion(), 10, 100) == 16
    assert resolve_max_tokens(completion(max_tokens=90), 10, 100) == 90  # exactly at the limit
    e = api_error(resolve_max_tokens, completion(max_tokens=91), 10, 100)
    assert e.status == 400 and e.code == "context_length_exceeded"
    assert e.message == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(10 in the prompt, 91 for the completion). Please reduce the length of the prompt or the completion."
    )
    # the prompt alone fills the context
    e = api_error(resolve_max_tokens, completion(max_tokens=1), 100, 100)
    assert e.code == "context_length_exceeded" and "101 tokens (100 in the prompt, 1 for" in e.message
    assert resolve_max_tokens(completion(max_tokens=1), 99, 100) == 1
    # completions with max_tokens null fill the context
    assert resolve_max_tokens(completion(max_tokens=None), 30, 100) == 70


def test_chat_max_tokens_resolution() -> None:
    assert resolve_max_tokens(chat(), 30, 100) == 70  # default: fill the context
    assert resolve_max_tokens(chat(), 99, 100) == 1
    e = api_error(resolve_max_tokens, chat(), 100, 100)
    assert e.code == "context_length_exceeded" and "100 tokens" in e.message
    assert resolve_max_tokens(chat(max_tokens=5), 30, 100) == 5
    assert resolve_max_tokens(chat(max_tokens=5, max_completion_tokens=7), 30, 100) == 7
    assert resolve_max_tokens(chat(max_completion_tokens=70), 30, 100) == 70
    e = api_error(resolve_max_tokens, chat(max_completion_tokens=71, max_tokens=1), 30, 100)
    assert e.code == "context_length_exceeded" and "(30 in the prompt, 71 for the completion)" in e.message


# ---------------------------------------------------------------------------------------------- mapping


def test_to_sampling_params_maps_fields() -> None:
    r = completion(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=11,
        stop_token_ids=[5, 6],
        ignore_eos=True,
        logprobs=3,
    )
    sp = to_sampling_params(r, max_tokens=32)
    assert sp == SamplingParams(
        max_tokens=32,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        seed=11,
        stop_token_ids=(5, 6),
        ignore_eos=True,
        logprobs=3,
    )
    assert (
        to_sampling_params(completion(), 16).top_k == -1 and to_sampling_params(completion(), 16).seed is None
    )
    assert to_sampling_params(completion(temperature=0), 4).is_greedy


def test_seed_plus_index() -> None:
    r = completion(seed=100, n=3)
    assert [to_sampling_params(r, 8, index=i).seed for i in range(3)] == [100, 101, 102]
    assert to_sampling_params(completion(n=3), 8, index=2).seed is None
    # stays a valid 64-bit seed at the top of the range
    assert to_sampling_params(completion(seed=2**63 - 1), 8, index=1).seed == -(2**63)


def test_only_a_chats_first_choice_asks_for_prompt_logprobs() -> None:
    """A chat's body shows the first choice's prompt logprobs only (beside its choices, as vLLM does), so the
    other choices do not ask the engine for them (each carried the whole prompt's: n times the work); every
    choice of a completion shows its own."""
    assert [to_sampling_params(chat(n=3, prompt_logprobs=2), 8, index=i).prompt_logprobs for i in range(3)] == [
        2, None, None]
    assert [to_sampling_params(completion(n=3, prompt_logprobs=2), 8, index=i).prompt_logprobs
            for i in range(3)] == [2, 2, 2]


def test_chat_logprobs_mapping() -> None:
    assert to_sampling_params(chat(), 8).logprobs is None
    assert to_sampling_params(chat(logprobs=True), 8).logprobs == 0
    assert to_sampling_params(chat(logprobs=True, top_logprobs=5), 8).logprobs == 5
    assert to_sampling_params(completion(logprobs=0), 8).logprobs == 0


def test_sampling_params_errors_become_api_errors() -> None:
    e = api_error(to_sampling_params, completion(min_tokens=5), 3)
    assert e.status == 400 and "min_tokens" in e.message


def test_logits_processing_fields_map_onto_the_engine() -> None:
    r = completion(presence_penalty=-0.5, frequency_penalty=1.25, repetition_penalty=1.1, min_tokens=2,
                   logit_bias={"7": -100, "12": 3.5}, prompt_logprobs=4)
    sp = to_sampling_params(r, 8)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_tokens) == (-0.5, 1.25, 1.1, 2)
    assert sp.logit_bias == ((7, -100.0), (12, 3.5)) and sp.prompt_logprobs == 4
    # echo with logprobs asks the engine for the prompt tokens' logprobs too (at least as many top ones)
    assert to_sampling_params(completion(echo=True, logprobs=2), 1).prompt_logprobs == 2
    assert to_sampling_params(completion(echo=True, logprobs=2, prompt_logprobs=5), 1).prompt_logprobs == 5
    assert to_sampling_params(completion(echo=True), 1).prompt_logprobs is None
    assert to_sampling_params(completion(max_tokens=0, echo=True, logprobs=1), 0).max_tokens == 0


def test_bad_words_are_tokenized_as_vllm_does(tok: Tokenizer) -> None:
    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    words = bad_words_token_ids(["hello", "  world", "x"], encode)
    assert tuple(encode("hello")) in words and tuple(encode("world")) in words and tuple(encode("x")) in words
    spaced = tuple(encode(" hello"))  # after another word: kept when it is as long and starts differently
    assert (spaced in words) == (len(spaced) == len(encode("hello")) and spaced[0] != encode("hello")[0])
    sp = to_sampling_params(completion(bad_words=["hello"]), 8, bad_words=words)
    assert sp.bad_words == words


def test_generation_config_fills_only_what_a_request_leaves_unset(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05,
         "eos_token_id": [1, 77], "bos_token_id": 0}))
    defaults = GenerationDefaults.resolve("auto", tmp_path)
    sp = to_sampling_params(completion(), 8, defaults=defaults)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.6, 0.95, 20, 0.0, 1.05)
    assert sp.stop_token_ids == (1, 77)  # the file's EOS ids stop generation
    sp = to_sampling_params(completion(temperature=1.0, top_k=-1, stop_token_ids=[77, 9]), 8, defaults=defaults)
    assert (sp.temperature, sp.top_k, sp.top_p) == (1.0, -1, 0.95)  # set by the request, even to the API's default
    assert sp.stop_token_ids == (77, 9, 1)
    assert to_sampling_params(completion(ignore_eos=True), 8, defaults=defaults).stop_token_ids == ()
    assert to_sampling_params(completion(temperature=None), 8, defaults=defaults).temperature == 0.6  # null: unset
    assert GenerationDefaults.resolve("vllm", tmp_path) == GenerationDefaults()
    assert GenerationDefaults.resolve(str(tmp_path), None).top_k == 20
    assert "temperature=0.6" in defaults.describe() and "eos_token_ids=[1, 77]" in defaults.describe()
    assert GenerationDefaults.resolve("auto", tmp_path / "nothing-here") == GenerationDefaults()
    with pytest.raises(ValueError, match="generation_config.json"):
        GenerationDefaults.resolve(str(tmp_path / "missing"), None)
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="temperature must be a number"):
        GenerationDefaults.resolve("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match="top_p"):
        GenerationDefaults.resolve("auto", tmp_path)


def test_stop_strings() -> None:
    assert stop_strings(completion()) == []
    assert stop_strings(completion(stop="\n")) == ["\n"]
    assert stop_strings(chat(stop=["a", "b"])) == ["a", "b"]
    assert stop_strings(chat(stop=[])) == []



def test_a_stop_token_leaves_its_text_out_unless_asked(tok: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output covers the stop token (or EOS) that ended generation too; a stop
    string still cuts the text whatever the tokens."""
    ids = tok.encode("one two. three", add_special_tokens=False)
    stop_id = ids[-1]

    def text(include: bool, finish: str = "stop", stops: tuple[str, ...] = ()) -> tuple[str, int, bool]:
        out = OutputText(tok, False, [], stops, include, (stop_id, tok.eos_token_id))
        first = out.feed(ids[:2], None)
        rest = out.feed([*ids[2:], tok.eos_token_id] if finish == "eos" else ids[2:], "stop" if finish else None)
        return first[0] + rest[0], rest[1], rest[2]

    cut = tok.decode(ids[:-1])
    assert text(False) == (cut, len(ids) - 2, False)
    assert text(True)[0] == tok.decode(ids)
    assert text(False, "eos")[0] == tok.decode(ids) and text(True, "eos")[0].endswith("<｜end▁of▁sentence｜>")
    dot = next(i for i in range(len(ids)) if "." in tok.decode(ids[: i + 1]))  # (the token ending at the stop)
    assert text(False, stops=(".",)) == ("one two", dot + 1 - 2, True)
    assert OutputText(None, True, [], (), False, ()).feed(ids, "stop") == ("", len(ids), False)


# ---------------------------------------------------------------------------------------------- logprobs


def test_completion_logprobs_ascii(tok: Tokenizer) -> None:
    text = "The capital of France is Paris."
    ids = tok.encode(text, add_special_tokens=False)
    entries = [(-0.1 * (i + 1), [(t, -0.05), ((t + 1) % 500 + 4, -2.0)]) for i, t in enumerate(ids)]
    out = completion_logprobs(tok, ids, entries, text_offset=7)
    assert set(out) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert "".join(out["tokens"]) == text
    assert out["token_logprobs"] == pytest.approx([-0.1 * (i + 1) for i in range(len(ids))])
    offsets = out["text_offset"]
    assert offsets[0] == 7
    for tok_str, start, end in zip(out["tokens"], offsets, [*offsets[1:], 7 + len(text)]):
        assert text[start - 7 : end - 7] == tok_str
    first = out["top_logprobs"][0]
    assert first == {tok.decode([ids[0]]): -0.05, tok.decode([(ids[0] + 1) % 500 + 4]): -2.0}


def test_completion_logprobs_multibyte_offsets(tok: Tokenizer) -> None:
    text = "café 😀 ok"
    ids = tok.encode(text, add_special_tokens=False)
    out = completion_logprobs(tok, ids, [(-1.0, [])] * len(ids), text_offset=0)
    offsets = out["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    assert text[offsets[-1] :] == out["tokens"][-1]  # last token "ok" sits at the end of the text
    assert out["top_logprobs"] == [{}] * len(ids)  # k = 0: no top tokens


def test_completion_top_logprobs_duplicates_keep_higher(tok: Tokenizer) -> None:
    a = tok.encode("a", add_special_tokens=False)[0]
    entries = [(-0.1, [(a, -0.1), (a, -0.5), (tok.eos_token_id, -3.0)])]
    out = completion_logprobs(tok, [a], entries, 0)
    assert out["top_logprobs"] == [{"a": -0.1, "<｜end▁of▁sentence｜>": -3.0}]


def test_logprobs_clamped_and_token_logprobs_objects(tok: Tokenizer) -> None:
    a = tok.encode("a", add_special_tokens=False)[0]
    entry = TokenLogprobs(token_id=a, logprob=float("-inf"), top=((a, float("-inf")),))
    out = completion_logprobs(tok, [a], [entry], 0)
    assert out["token_logprobs"] == [-9999.0] and out["top_logprobs"] == [{"a": -9999.0}]
    json.dumps(out, allow_nan=False)
    chat_out = chat_logprobs(tok, [a], [entry])
    assert chat_out[0]["logprob"] == -9999.0
    json.dumps(chat_out, allow_nan=False)


def test_chat_logprobs_format(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 世", add_special_tokens=False)
    entries = [(-0.2, [(t, -0.2), (tok.eos_token_id, -4.0)]) for t in ids]
    out = chat_logprobs(tok, ids, entries)
    assert len(out) == len(ids)
    for t, item in zip(ids, out):
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["token"] == tok.decode([t], skip_special_tokens=False)
        assert item["bytes"] == list(item["token"].encode("utf-8"))
        assert item["logprob"] == pytest.approx(-0.2)
        assert [x["token"] for x in item["top_logprobs"]] == [item["token"], "<｜end▁of▁sentence｜>"]
        assert item["top_logprobs"][1] == {
            "token": "<｜end▁of▁sentence｜>",
            "logprob": -4.0,
            "bytes": list("<｜end▁of▁sentence｜>".encode()),
        }
    assert "Hi 世".startswith("".join(x["token"] for x in out if "\ufffd" not in x["token"]))
    assert chat_logprobs(tok, [ids[0]], [(-1.0, [])])[0]["top_logprobs"] == []


def test_logprobs_tokens_as_token_ids(tok: Tokenizer) -> None:
    """vLLM's return_tokens_as_token_ids: every token of the logprobs written ``token_id:<id>``."""
    ids = tok.encode("Hi there", add_special_tokens=False)
    entries = [(-0.5, [(t, -0.5), (7, -3.0)]) for t in ids]
    out = completion_logprobs(tok, ids, entries, 0, as_ids=True)
    assert out["tokens"] == [f"token_id:{t}" for t in ids] and set(out["top_logprobs"][0]) == {
        f"token_id:{ids[0]}", "token_id:7"}
    chat_out = chat_logprobs(tok, ids, entries, as_ids=True)
    assert [x["token"] for x in chat_out] == out["tokens"] and chat_out[0]["bytes"] == list(out["tokens"][0].encode())
    assert chat_out[0]["top_logprobs"][1]["token"] == "token_id:7"
