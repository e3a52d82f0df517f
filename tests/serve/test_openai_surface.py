"""The OpenAI surface a vLLM user reaches for, against a real ``epserve serve`` through the official
``openai`` client and raw HTTP: penalties, ``logit_bias`` and ``min_tokens`` change the text exactly as
the offline engine does; ``echo`` with ``logprobs`` answers lm-evaluation-harness's loglikelihood request
(checked against transformers); ``prompt_logprobs`` on both endpoints; ``max_tokens`` 0;
``continuous_usage_stats``; the checkpoint's ``generation_config.json`` as defaults; fields this server
does not implement refused by name, unknown ones said once in the log; structured outputs (vLLM's
``guided_*`` too) and forced tool calls, streamed through the client's helper, in DeepSeek-V3.1's format
(an in-process router over the same engine) and in a whole round trip."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import torch
from fastapi.testclient import TestClient

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from epserve.router.server import RouterOptions, build_router
from tests.serve_harness import Proc, wait_http_ok, wait_output

pytestmark = pytest.mark.slow

MODEL = "tiny"
ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "128", "--max-model-len", "512"]
PROMPT = [5, 17, 99, 230, 41, 41, 7]
REPEATS = [5, 17, 99, 3, 3, 3, 8]  # its greedy continuation repeats a token from the seventh on
STOPPER = 3  # the position, in PROMPT's greedy continuation, of the token the generation config makes an EOS
TOKEN = "surface-engine-token"  # (known, so that an in-process router can reach the same engine instance)


@pytest.fixture(scope="module")
def offline(make_ckpt):
    return LLM(make_ckpt("tiny", dtype="float32"), dtype="float32", num_blocks=128, max_model_len=512)


@pytest.fixture(scope="module")
def greedy(offline) -> list[int]:
    return offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids


@pytest.fixture(scope="module")
def ckpt(make_ckpt, tmp_path_factory, greedy) -> Path:
    """The tiny checkpoint with a generation_config.json: greedy by default (top_k 1) and one more EOS id."""
    path = tmp_path_factory.mktemp("gencfg") / "model"
    shutil.copytree(make_ckpt("tiny", dtype="float32"), path)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "top_k": 1, "temperature": 0.9, "eos_token_id": [1, greedy[STOPPER]]}))
    return path


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("surface") / "serve.log"
    proc = Proc(["serve", str(ckpt), "--dp", "1", "--port", str(port), "--served-model-name", MODEL, *ENGINE_ARGS,
                 "--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice", "--engine-token", TOKEN], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        yield proc, url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_logit_bias_penalties_and_min_tokens_change_the_text_as_offline(server, offline):
    _, url, client = server
    cases = [
        ({"logit_bias": {"77": 100}}, {"logit_bias": {77: 100.0}}),
        ({"frequency_penalty": 2.0, "presence_penalty": 1.5},
         {"frequency_penalty": 2.0, "presence_penalty": 1.5}),
        ({"extra_body": {"repetition_penalty": 3.0, "ignore_eos": True}}, {"repetition_penalty": 3.0}),
    ]
    plain = client.completions.create(model=MODEL, prompt=REPEATS, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    for api, engine in cases:
        extra = api.pop("extra_body", {"ignore_eos": True})
        out = client.completions.create(model=MODEL, prompt=REPEATS, max_tokens=12, temperature=0, extra_body=extra,
                                        **api)
        want = offline.generate([REPEATS], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **engine))[0]
        assert out.choices[0].text == want.text, api
        assert out.choices[0].text != plain, api  # the field was not ignored
    # min_tokens: EOS forced by a bias, then held off until min_tokens tokens
    eos = offline.config.model.eos_token_ids[0]
    forced = {str(eos): 100, "300": 50}
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=forced)
    assert first.usage.completion_tokens == 1 and first.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=forced,
                                     extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"77": 100})
    assert chat.choices[0].message.content == offline.tokenizer.decode([77] * 4)
    # bad_words: the word as the tokenizer spells it is never completed
    word = offline.tokenizer.decode([77])
    out = client.completions.create(model=MODEL, prompt=REPEATS, max_tokens=4, temperature=0,
                                    logit_bias={"77": 100}, extra_body={"bad_words": [word]})
    assert word not in out.choices[0].text and out.usage.completion_tokens == 4


def test_loglikelihood_request_shaped_as_lm_eval_sends_it(server, ckpt):
    """lm-evaluation-harness's local-completions: token-id prompts, echo, logprobs 1, max_tokens 1; it reads
    ``token_logprobs[ctxlen:-1]`` and checks greediness against ``top_logprobs``."""
    _, url, _ = server
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    context, continuations = [9, 120, 33, 41, 250], [[7, 8], [300], [41, 41, 2]]
    prompts = [context + c for c in continuations]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        want = [float(ref[p - 1, prompt[p]]) for p in range(len(context), len(prompt))]
        got = lp["token_logprobs"][len(context):-1]
        assert got == pytest.approx(want, abs=1e-4)
        greedy = [prompt[p] == int(ref[p - 1].argmax()) for p in range(len(context), len(prompt))]
        tops = lp["top_logprobs"][len(context):-1]
        assert [tok == max(top.values()) for tok, top in zip(got, tops)] == greedy
    # max_tokens 0: the prompt alone, with its logprobs
    r = post(url, "/v1/completions", {**body, "prompt": prompts[0], "max_tokens": 0})
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_logprobs"]) == len(prompts[0])
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        choices[0]["logprobs"]["token_logprobs"][1:-1], abs=1e-5)


def test_echo_text_streamed_and_not(server):
    _, _, client = server
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True, logprobs=2)
    whole = client.completions.create(**kw)
    assert whole.choices[0].text.startswith("Once upon a time")
    assert whole.usage.completion_tokens == 5
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    expected = whole.choices[0].logprobs.token_logprobs
    n_prompt = whole.usage.prompt_tokens
    assert len(expected) == n_prompt + 5 and expected[0] is None and streamed[0] is None
    assert streamed[1:] == pytest.approx(expected[1:], abs=1e-5)
    only = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=0, echo=True)
    assert only.choices[0].text == "Once upon a time" and only.usage.completion_tokens == 0


def test_prompt_logprobs_on_both_endpoints(server, offline):
    _, url, _ = server
    want = offline.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2})
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = got[pos]
        token = str(PROMPT[pos])
        assert entry[token]["logprob"] == pytest.approx(want[pos].logprob, abs=1e-4)
        ranked = sorted((v["rank"], k) for k, v in entry.items() if v["rank"] is not None)
        assert [k for _, k in ranked][:2] == [str(t) for t, _ in want[pos].top]
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2, "prompt_logprobs": 0})
    body = r.json()
    assert body["prompt_logprobs"][0] is None
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


def test_continuous_usage_stats(server):
    """Every chunk's usage counts the tokens streamed so far (each chunk's tokens are its logprobs' tokens:
    how many an engine message carries depends on the host's speed, what usage says of them does not)."""
    _, _, client = server
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            logprobs=0, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == len(PROMPT) for c in chunks)
    streamed = 0
    for c in chunks:
        streamed += sum(len(choice.logprobs.tokens) for choice in c.choices if choice.logprobs)
        assert c.usage.completion_tokens == streamed
    assert streamed == 6


def test_generation_config_is_the_default(server, greedy):
    proc, _, client = server
    assert "default sampling from" in proc.output() and "top_k=1" in proc.output()
    # unset sampling fields take the file's: top_k 1 is greedy, and its extra EOS id stops the text
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8)
        assert out.usage.completion_tokens == STOPPER + 1 and out.choices[0].finish_reason == "stop"
    # a request that sets a field keeps its own value; ignore_eos drops the extra EOS too
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8
    sampled = {client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, top_p=1.0,
                                         extra_body={"top_k": -1, "ignore_eos": True}).choices[0].text
               for _ in range(4)}
    assert len(sampled) > 1  # top_k -1 given: no longer greedy


def test_unimplemented_fields_refused_unknown_ones_logged(server):
    proc, url, client = server
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       functions=[{"name": "f", "parameters": {}}])
    assert info.value.body["param"] == "functions"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", best_of=3, n=1)
    assert info.value.body["param"] == "best_of"
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"100000": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and "vocabulary" in r.text
    assert client.completions.create(model=MODEL, prompt="x", best_of=2, n=2, max_tokens=2).choices[1].index == 1
    for _ in range(2):
        r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "frobnicate": True})
        assert r.status_code == 200
    assert proc.output().count("'frobnicate'") == 1


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    tags: list[Literal["a", "b", "c"]] = pydantic.Field(max_length=3)


def test_structured_outputs_through_the_client(server):
    _, url, client = server
    for seed in range(3):  # the openai client's own parse(): a pydantic model as the schema
        parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "a person"}],
                                               response_format=Person, max_tokens=200, temperature=1.0, seed=seed)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=100,
                                         response_format={"type": "json_object"}, temperature=0)
    assert out.choices[0].finish_reason == "length" or isinstance(json.loads(out.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=4,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    streamed = client.completions.create(model=MODEL, prompt="Code:", max_tokens=10, temperature=0, stream=True,
                                         extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{3}", "".join(c.choices[0].text for c in streamed))
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": {"type": "objectx"}})
    assert r.status_code == 400 and "objectx" in r.json()["error"]["message"], r.text
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "(", "stream": True})
    assert r.status_code == 400 and "parenthesis" in r.json()["error"]["message"], r.text


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]


def test_forced_tool_calls_parse_and_follow_the_schema(server):
    """A named tool_choice and `required`, on random weights: the grammar, not the model, makes the call."""
    jsonschema = pytest.importorskip("jsonschema")
    _, _, client = server
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                             max_tokens=400, temperature=1.0, seed=seed)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    calls: dict[int, list[str]] = {}  # `required`: one or more calls (parallel_tool_calls), each valid
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                                max_tokens=490, temperature=1.0, seed=9, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or ():
            call = calls.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
    assert calls
    for name, arguments in calls.values():
        schema = WEATHER if name == "get_weather" else TOOLS[1]["function"]["parameters"]
        jsonschema.validate(json.loads(arguments), schema)


@pytest.fixture(scope="module")
def v31(server, ckpt):
    """An openai client of an in-process router parsing DeepSeek-V3.1's tool calls, over the engine instance
    ``server`` runs (no second ``epserve serve``)."""
    proc = server[0]
    wait_output(proc, "(engines: ")
    address = re.search(r"\(engines: (\S+)\)", proc.output())[1]
    options = RouterOptions(model=str(ckpt), engines=(address,), served_model_name=MODEL, engine_token=TOKEN,
                            tool_call_parser="deepseek_v31")
    with TestClient(build_router(options).app) as http:
        yield openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)


WEATHER_Q = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_call_streamed_through_the_client_helper(server):
    """``chat.completions.stream`` (the client's own reassembly of the deltas; strict tools) ends with the call,
    its arguments parsed and valid."""
    jsonschema = pytest.importorskip("jsonschema")
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    with server[2].chat.completions.stream(model=MODEL, messages=WEATHER_Q, tools=strict, tool_choice=NAMED,
                                           max_tokens=400, temperature=1.0, seed=0) as stream:
        pieces = sum(1 for event in stream if event.type == "tool_calls.function.arguments.delta")
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather" and pieces > 1
    jsonschema.validate(call.function.parsed_arguments, WEATHER)


def test_a_forced_call_in_the_deepseek_v31_format(v31, offline):
    jsonschema = pytest.importorskip("jsonschema")
    named = {"type": "function", "function": {"name": "get_time"}}
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=named, max_tokens=300, temperature=1.0, seed=1)
    out = v31.chat.completions.create(**kw, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])
    raw = offline.tokenizer.decode([int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content])
    assert f"<｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{call.function.arguments}<｜tool▁call▁end｜>" in raw  # V3.1's
    arguments = "".join(p.function.arguments or "" for c in v31.chat.completions.create(**kw, stream=True)
                        for p in c.choices[0].delta.tool_calls or ())
    assert arguments == call.function.arguments


def test_a_tool_round_trip_through_the_engine(server):
    """The response's message fed back as the client returned it, then the tool's answer, then the reply: the
    prompt renders both (the same ids as /tokenize with the tools gives)."""
    _, url, client = server
    message = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=NAMED,
                                             max_tokens=400, temperature=1.0, seed=0).choices[0].message
    call = message.tool_calls[0]
    messages = [*WEATHER_Q, message, {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=6, temperature=0)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason in ("stop", "length")
    sent = [*WEATHER_Q, message.model_dump(exclude_unset=True), messages[-1]]
    tokens = post(url, "/tokenize", {"model": MODEL, "messages": sent, "tools": TOOLS}).json()["tokens"]
    assert len(tokens) == answer.usage.prompt_tokens
    prompt = post(url, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert call.function.arguments in prompt and '<｜tool▁output▁begin｜>{"temp": 21}<｜tool▁output▁end｜>' in prompt


def test_guided_json_regex_and_grammar(server):
    """vLLM's guided_* fields over raw HTTP, both endpoints: the output follows the constraint and ends."""
    jsonschema = pytest.importorskip("jsonschema")
    _, url, _ = server
    schema = {"type": "object", "properties": {"id": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
              "required": ["id", "ok"], "additionalProperties": False}
    def valid(text: str) -> bool:
        return jsonschema.validate(json.loads(text), schema) is None  # (raises when it is not)

    cases = [({"guided_json": schema}, valid), ({"guided_json": json.dumps(schema)}, valid),
             ({"guided_regex": "[a-c]{2,4}-[0-9]{2}"}, lambda text: re.fullmatch("[a-c]{2,4}-[0-9]{2}", text)),
             ({"guided_grammar": 'root ::= ("yes" | "no") " " [0-9]'},
              lambda text: re.fullmatch("(yes|no) [0-9]", text))]
    for i, (field, check) in enumerate(cases):
        chat = i % 2 == 1
        body = {"model": MODEL, "max_tokens": 60, "temperature": 1.0, "seed": i, **field,
                **({"messages": [{"role": "user", "content": "Answer"}]} if chat else {"prompt": "Answer:"})}
        r = post(url, "/v1/chat/completions" if chat else "/v1/completions", body)
        choice = r.json()["choices"][0]
        assert r.status_code == 200 and choice["finish_reason"] == "stop", (field, r.text)
        assert check(choice["message"]["content"] if chat else choice["text"]), (field, choice)
