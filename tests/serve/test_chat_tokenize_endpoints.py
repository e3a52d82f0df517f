"""The router's chat-template options and vLLM's extra endpoints, in process (no engine: a stub router
records the prompt each request would send and answers one token): ``chat_template_kwargs``,
``add_generation_prompt``, ``continue_final_message`` (and vLLM's chat ``echo``), the ``developer`` role,
``tools`` and ``documents`` as template variables, a template that raises, ``--chat-template``; vLLM's
``truncate_prompt_tokens``, ``add_special_tokens`` and ``request_id``; ``/tokenize`` (with tools),
``/detokenize``, ``/v1/models/{id}``, ``/version`` and the API key on them; the OpenAPI document."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from starlette.testclient import TestClient

from epserve import __version__
from epserve.router.http_limits import RequestGate
from epserve.router.server import RouterOptions
from epserve.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    Tokenizer,
    write_tokenizer_files,
)
from tests.router_toys import ScriptedRouter, build_over

MODEL, KEY, MAX_MODEL_LEN = "tiny-chat", "sk-inproc", 256
THINKING = ("{{ bos_token }}{% for t in tools or [] %}<tool:{{ t['function']['name'] }}>{% endfor %}"
            "{% for d in documents or [] %}<doc:{{ d['text'] }}>{% endfor %}"
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% endif %}{% endif %}"
            "{% if messages[-1]['content'] == 'boom' %}{{ raise_exception('no booms here') }}{% endif %}")


class StubRouter(ScriptedRouter):
    """No engine: each request's prompt recorded (per router), one token back."""

    max_model_len = MAX_MODEL_LEN
    finish_reason = "length"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []
        self.params: list = []


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=512, model_max_length=2048)


def _serve(tok_dir: Path, chat_template: str | None = None):
    """The router as ``epserve router TOK_DIR --chat-template ...`` builds it, over a StubRouter."""
    options = RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL,
                            chat_template=chat_template)
    server = build_over(StubRouter, options, api_key=KEY)
    return server


@pytest.fixture(scope="module")
def served(tok_dir):
    """(the app's server object, an httpx client with the key, an openai client) over the built-in template."""
    server = _serve(tok_dir)
    with TestClient(server.app, headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield server, http, openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=KEY, http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def thinking(tok_dir):
    """The same over ``--chat-template THINKING`` (given as text)."""
    server = _serve(tok_dir, THINKING)
    with TestClient(server.app, headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield server, http, openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=KEY, http_client=http, max_retries=0)


def _chat(client: openai.OpenAI, messages: list[dict], **extra) -> None:
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra or None)
    assert out.choices[0].finish_reason == "length"


def _text(tok_dir: Path, ids: list[int]) -> str:
    return Tokenizer.from_dir(tok_dir).decode(ids, skip_special_tokens=False)


def test_chat_template_kwargs_and_the_developer_role(thinking, tok_dir):
    server, _, client = thinking
    _chat(client, [{"role": "developer", "content": "rules"}, {"role": "user", "content": "hi"}])
    _chat(client, [{"role": "user", "content": "hi"}], chat_template_kwargs={"thinking": True})
    _chat(client, [{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert [_text(tok_dir, p) for p in server.router.prompts[-3:]] == [
        f"{BOS_TOKEN}<system>rules<user>hi<assistant>", f"{BOS_TOKEN}<user>hi<assistant><think>",
        f"{BOS_TOKEN}<user>hi"]


def test_continue_final_message(served, tok_dir):
    server, _, client = served
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    _chat(client, messages, continue_final_message=True)  # (implies no generation prompt, as vLLM renders it)
    assert _text(tok_dir, server.router.prompts[-1]) == f"{BOS_TOKEN}{USER_TOKEN}Count:{ASSISTANT_TOKEN}one, two,"
    _chat(client, messages)  # otherwise the assistant's turn is closed and a new one opened
    assert _text(tok_dir, server.router.prompts[-1]).endswith(f"one, two,{EOS_TOKEN}{ASSISTANT_TOKEN}")
    for extra, why in [({"continue_final_message": True, "add_generation_prompt": True}, "Cannot set both"),
                       ({"continue_final_message": True, "messages": messages[:1]}, "last message to be the assistant"),
                       ({"chat_template_kwargs": {"add_generation_prompt": True}}, "may not set add_generation_prompt"),
                       ({"chat_template": "{{ 1 }}"}, "chat_template is not accepted")]:
        with pytest.raises(openai.BadRequestError, match=why):
            _chat(client, extra.pop("messages", messages), **extra)


def test_tools_and_documents_reach_the_template_and_tokenize_renders_them_as_chat(thinking, tok_dir):
    server, http, client = thinking
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},  # (no content)
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    _chat(client, messages, tools=tools, tool_choice="none")
    r = http.post("/tokenize", json={"messages": messages, "tools": tools})
    assert r.status_code == 200 and r.json()["tokens"] == server.router.prompts[-1]
    assert _text(tok_dir, r.json()["tokens"]).startswith(f"{BOS_TOKEN}<tool:get_weather><user>hi<assistant>")
    _chat(client, messages[:1], documents=[{"title": "t", "text": "Paris is sunny"}])
    assert _text(tok_dir, server.router.prompts[-1]) == f"{BOS_TOKEN}<doc:Paris is sunny><user>hi<assistant>"
    r = http.post("/tokenize", json={"messages": messages, "tools": [{"type": "function", "function": {}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_truncation_special_tokens_echo_and_request_id(served, tok_dir):
    """vLLM's fields: truncate_prompt_tokens keeps the prompt's last tokens (a text too long for the context
    is then not refused); add_special_tokens; request_id as the response's id; chat echo."""
    server, http, client = served
    tok, text = Tokenizer.from_dir(tok_dir), "one two three four five six"
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=1, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3, "request_id": "my-id"})
    assert server.router.prompts[-1] == tok.encode(text)[-3:] and out.id == "cmpl-my-id"
    assert out.choices[0].text.startswith(tok.decode(tok.encode(text)[-3:]))  # the prompt as it was sent
    client.completions.create(model=MODEL, prompt="x " * 50_000, max_tokens=1, extra_body={"truncate_prompt_tokens": 5})
    assert len(server.router.prompts[-1]) == 5
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len"):
        client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"truncate_prompt_tokens": 300})
    client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"add_special_tokens": False})
    assert server.router.prompts[-1] == tok.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    _chat(client, messages[:1])
    plain = server.router.prompts[-1]
    _chat(client, messages[:1], add_special_tokens=True, truncate_prompt_tokens=4)
    assert server.router.prompts[-1] == [tok.bos_token_id, *plain][-4:]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra)
    assert whole.choices[0].message.content.startswith("one, two,") and whole.id.startswith("chatcmpl-")
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.choices[0].message.content
    plain = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=1, extra_body={"echo": True})
    assert not plain.choices[0].message.content.startswith("Count:")  # (a new assistant turn: nothing to echo)


def test_a_template_that_raises_is_a_400_naming_it(thinking):
    server, http, client = thinking
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [{"role": "user", "content": "boom"}])
    assert info.value.status_code == 400
    assert info.value.body["message"] == "chat template failed: no booms here"
    assert info.value.body["code"] == "chat_template_error"
    r = http.post("/tokenize", json={"messages": [{"role": "user", "content": "boom"}]})  # the same path
    assert r.status_code == 400 and r.json()["error"]["message"] == "chat template failed: no booms here"


def test_tokenize_and_detokenize(served, tok_dir):
    server, http, client = served
    tok = Tokenizer.from_dir(tok_dir)
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "the capital of France", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == tok.encode("the capital of France")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["tokens"][0] == tok.bos_token_id and body["token_strs"][0] == BOS_TOKEN
    assert "".join(body["token_strs"][1:]).replace("Ġ", " ") == "the capital of France"
    no_bos = http.post("/tokenize", json={"prompt": "the capital of France", "add_special_tokens": False}).json()
    assert no_bos["tokens"] == body["tokens"][1:] and "token_strs" not in no_bos
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    _chat(client, messages)  # the same ids as a chat completion sends
    assert chat["tokens"] == server.router.prompts[-1] and chat["count"] == len(chat["tokens"])
    extra_bos = http.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
    assert extra_bos == [tok.bos_token_id, *chat["tokens"]]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": chat["tokens"]}).json() == {
        "prompt": f"{BOS_TOKEN}S{USER_TOKEN}U{ASSISTANT_TOKEN}"}
    for path, body, status, param in [
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
        ("/detokenize", {"tokens": [3, 512]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {}, 400, "prompt"),
    ]:
        r = http.post(path, json=body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, body, r.text)
    assert "outside the vocabulary [0, 512)" in http.post("/detokenize", json={"tokens": [512]}).text


def test_model_card_version_and_the_api_key(served):
    server, http, client = served
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object) == (MODEL, "model") and card.model_extra["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body == {"message": "The model `gpt-9` does not exist.", "type": "invalid_request_error",
                               "param": "model", "code": "model_not_found"}
    assert http.get("/v1/models/org/name").json()["error"]["message"] == "The model `org/name` does not exist."
    assert http.get("/version").json() == {"version": __version__}
    bare = TestClient(server.app)  # no Authorization header
    for method, path in [("GET", "/version"), ("GET", f"/v1/models/{MODEL}"), ("POST", "/tokenize"),
                         ("POST", "/detokenize")]:
        assert bare.request(method, path).status_code == 401, path
    assert bare.get("/health").status_code == 503  # (open: no engine is healthy)
    gate = RequestGate(KEY)  # served by uvicorn, the same gate answers from the request head
    assert gate.refusal("/tokenize", []) is not None and gate.refusal("/version", []) is not None
    assert gate.refusal("/tokenize", [(b"authorization", f"Bearer {KEY}".encode())]) is None
    assert gate.refusal("/health", []) is None


def test_the_openapi_document_describes_the_new_routes(served):
    doc = served[1].get("/openapi.json").json()
    body = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                              {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    assert {"200", "400", "401", "404"} <= set(doc["paths"]["/detokenize"]["post"]["responses"])
    assert "404" in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert doc["paths"]["/version"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "required"] == ["version"]
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"} <= set(chat)
    assert "developer" in doc["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]


def test_a_bad_chat_template_option_is_refused_at_start(tok_dir):
    with pytest.raises(ValueError, match="does not compile"):
        RouterOptions(model=str(tok_dir), engines=("h:1",), chat_template="{% for %}")


def test_a_checkpoint_saved_by_transformers_chats(tok_dir, tmp_path):
    """A tokenizer written by transformers' ``save_pretrained`` keeps its template in chat_template.jinja
    only; the router chats with it, sending the ids transformers renders (template variables included)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    hf.chat_template = THINKING
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    server = _serve(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(server.app, headers={"Authorization": f"Bearer {KEY}"}) as http:
        client = openai.OpenAI(base_url=f"{http.base_url}/v1", api_key=KEY, http_client=http, max_retries=0)
        _chat(client, messages, chat_template_kwargs={"thinking": True})
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True)
    assert want.endswith("<assistant><think>")
    assert server.router.prompts == [hf(want, add_special_tokens=False)["input_ids"]]
