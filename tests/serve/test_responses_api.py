"""The endpoints users' tools call, against a real ``epserve serve`` started with vLLM's flags as vLLM users
type them: OpenAI's Responses API through the ``openai`` client (``responses.create``, streamed and not, and
the ``responses.stream`` helper) and langchain-openai's ``use_responses_api``, the same text as the chat
completion it stands for; forced function calls as ``function_call`` items and fed back as input items;
``previous_response_id`` refused; lm-evaluation-harness's ``local-completions`` with no ``tokenizer``
(``/tokenizer_info``, ``/tokenize``, ``/detokenize``); ``/ping``; the last request fields that were ignored,
now working or refused by name."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from epserve.parallel.launch import free_port
from tests.serve_harness import Proc, wait_http_ok

pytestmark = pytest.mark.slow

MODEL = "tiny"
# vLLM's spellings, each accepted here (--dtype auto: the checkpoint's float32; --tool-call-parser deepseekv3: SGLang's)
VLLM_FLAGS = ["--dtype", "auto", "--enable-prefix-caching", "--enable-chunked-prefill", "--seed", "0",
              "--disable-log-requests", "--max-logprobs", "20", "--uvicorn-log-level", "warning",
              "--response-role", "assistant", "--tool-call-parser", "deepseekv3", "--enable-auto-tool-choice"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER,
        "strict": None}
FORCED = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(make_ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("responses") / "serve.log"
    proc = Proc(["serve", str(make_ckpt("tiny", dtype="float32")), "--port", str(port), "--served-model-name", MODEL,
                 "--num-blocks", "128", "--max-model-len", "512", *VLLM_FLAGS], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        yield url, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60), log
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


def test_the_vllm_flags_served_with_their_notes(server):
    url, client, log = server
    assert client.models.list().data[0].id == MODEL
    text = log.read_text()
    for note in ("--seed 0 changes nothing", "--disable-log-requests changes nothing", "--max-logprobs 20 changes"):
        assert note in text
    assert "Application startup complete" not in text  # uvicorn's INFO lines: gone at --uvicorn-log-level warning
    assert "(float32 weights)" in text  # --dtype auto: the checkpoint's own
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/ping").content == b""


def test_a_response_is_the_chat_completion_it_stands_for(server):
    _, client, _ = server
    response = client.responses.create(model=MODEL, instructions="Answer briefly.", input=QUESTION,
                                       max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    as_items = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert as_items.output_text == response.output_text


def test_streamed_events_as_the_client_reads_them(server):
    _, client, _ = server
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # (with its status incomplete when max_output_tokens cut it)
    assert events[-1].response.status == whole.status
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.usage == whole.usage
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text == whole.output_text


def test_a_forced_call_is_a_function_call_item_and_goes_back_as_input(server):
    jsonschema = pytest.importorskip("jsonschema")
    _, client, _ = server
    response = client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL], tool_choice=FORCED,
                                       max_output_tokens=400, temperature=1.0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    streamed = list(client.responses.create(model=MODEL, input=QUESTION, tools=[TOOL], tool_choice="required",
                                            parallel_tool_calls=False, max_output_tokens=400, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather"
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == done[0].arguments and json.loads(done[0].arguments)
    assert [i.type for i in streamed[-1].response.output][-1] == "function_call"
    follow_up = [{"role": "user", "content": QUESTION}, calls[0].model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}]
    answer = client.responses.create(model=MODEL, input=follow_up, tools=[TOOL], max_output_tokens=4, temperature=0)
    assert answer.output[0].type == "message" and answer.usage.input_tokens > response.usage.input_tokens


def test_refused_by_name_in_openai_form(server):
    _, client, _ = server
    cases = [({"previous_response_id": "resp_1"}, "previous_response_id", "send the whole conversation as input"),
             ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be in [1,"),
             ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning is not supported"),
             ({"tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
             ({"tools": [{**TOOL, "strict": True}], "tool_choice": "auto"}, "tools[0].strict", "force the call")]
    for extra, param, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input=QUESTION, **extra)
        error = info.value.body
        assert info.value.status_code == 400 and error["param"] == param and message in error["message"], error
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input=QUESTION)
    stored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=True)  # nothing kept
    assert stored.output_text is not None


def test_langchain_with_the_responses_api(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    url, client, _ = server
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="none", use_responses_api=True,
                                      max_tokens=8, temperature=0, max_retries=0)
    reply = llm.invoke(QUESTION)
    assert reply.text == client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8,
                                                 temperature=0).output_text
    assert "".join(chunk.text for chunk in llm.stream(QUESTION)) == reply.text
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": WEATHER}}]
    caller = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="none", use_responses_api=True,
                                         max_tokens=400, max_retries=0)
    call = caller.bind_tools(tools, tool_choice="get_weather").invoke(QUESTION)
    assert [c["name"] for c in call.tool_calls] == ["get_weather"] and "city" in call.tool_calls[0]["args"]


def test_lm_eval_local_completions_without_a_tokenizer(server):
    url, client, _ = server
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] and info["bos_token"] and info["chat_template"] and info["model_max_length"] == 512
    from lm_eval.api.instance import Instance  # (slow to import)
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL, max_length=512)
    assert lm.tokenizer_backend == "remote"
    [(logprob, greedy)] = lm.loglikelihood([Instance("loglikelihood", {}, ("The weather in", " Paris"), 0)])
    context = httpx.post(f"{url}/tokenize", json={"prompt": "The weather in", "add_special_tokens": False}).json()
    ids = context["tokens"] + httpx.post(f"{url}/tokenize", json={"prompt": " Paris",
                                                                   "add_special_tokens": False}).json()["tokens"]
    echo = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    expected = sum(echo.choices[0].logprobs.token_logprobs[context["count"]:])
    assert math.isclose(logprob, expected, rel_tol=1e-5, abs_tol=1e-5) and isinstance(greedy, bool)
    [text] = lm.generate_until([Instance("generate_until", {}, ("Hello", {"until": ["\n\n"], "max_gen_toks": 4}), 0)])
    assert isinstance(text, str)


def test_the_last_ignored_fields_work_or_are_refused_by_name(server):
    url, client, _ = server
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = [("moderation", {"model": "omni-moderation-latest"}), ("prompt_cache_options", {"mode": "explicit"}),
               ("prompt_cache_retention", "24h"), ("media_io_kwargs", {"video": {"num_frames": 8}}),
               ("best_of", 2)]
    for name, value in refused:
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, name: value})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == name and error["code"] in (
            "unsupported_parameter", "unsupported_value") and name in error["message"], (name, error)
    for name, value in [("prompt_cache_retention", "in_memory"), ("best_of", 1), ("media_io_kwargs", {})]:
        assert httpx.post(f"{url}/v1/chat/completions", json={**chat, name: value}).status_code == 200, name
    strict = [{"type": "function", "function": {"name": "f", "parameters": WEATHER, "strict": True}}]
    r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "tools": strict, "tool_choice": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.strict"
    forced = {"type": "function", "function": {"name": "f"}}  # strict holds for a forced call: accepted
    assert httpx.post(f"{url}/v1/chat/completions", json={**chat, "tools": strict, "tool_choice": forced,
                                                          "max_tokens": 200}).status_code == 200
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 10**6], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": r.json()["error"]["message"], "type": "invalid_request_error", "param": "prompt",
        "code": "invalid_value"}
    chunks = list(client.chat.completions.create(**chat, stream=True, stream_options={"include_obfuscation": True}))
    padded = [c for c in chunks if c.choices]
    assert padded and all(isinstance(c.to_dict().get("obfuscation"), str) for c in padded)
    plain = list(client.chat.completions.create(**chat, stream=True))
    assert not any("obfuscation" in c.to_dict() for c in plain)


def test_a_json_schema_text_format_is_a_structured_output(server):
    jsonschema = pytest.importorskip("jsonschema")
    _, client, _ = server
    response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=200, temperature=1.0, text={
        "format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)
