"""vLLM's output flags served, in process over a scripted engine that gives logprobs: ``--return-tokens-as-token-ids``
(logprobs' tokens as ``token_id:N`` in completions and chat, streamed and not, unless a request says otherwise),
``--response-role`` (the chat response's role) and ``--max-logprobs`` (more asked for is a 400 naming the field).
(``test_vllm_flags`` parses them.)"""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from epserve.cli import build_parser
from epserve.launcher.args import router_options
from epserve.messages.engine import GeneratedTokens
from epserve.messages.sampling import TokenLogprobs
from epserve.router.server import RouterOptions
from tests.router_toys import ScriptedRouter, build_over, scripted_tokenizer

MODEL = "tiny"
OUTPUT = "hi there"


class LogprobsEngine(ScriptedRouter):
    """Each token with logprob -0.5, its top ones: itself and the next ids down by 0.5 each."""

    prompts: list[list[int]] = []
    params: list = []

    async def generate(self, request_id, token_ids, params):
        n = len(self.tokens)
        for i, t in enumerate(self.tokens, start=1):
            top = tuple((t + k, -0.5 * (k + 1)) for k in range(params.logprobs or 0))
            lps = (TokenLogprobs(t, -0.5, top),) if params.logprobs is not None else ()
            yield GeneratedTokens(request_id, (t,), lps, len(token_ids), 0, i, self.finish_reason if i == n else None)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    tok_dir, tok = scripted_tokenizer(tmp_path_factory)
    LogprobsEngine.tokens = tok.encode(OUTPUT, add_special_tokens=False)
    assert len(LogprobsEngine.tokens) > 1
    return tok_dir, tok


def _http(tok_dir, flags: list[str]) -> TestClient:
    """The router ``epserve router`` builds from these flags, over the scripted engine."""
    args = build_parser().parse_args(["router", "--engine", "127.0.0.1:1", "--served-model-name", MODEL, *flags])
    options = dataclasses.replace(router_options(args, ("127.0.0.1:1",)), model=str(tok_dir),
                                  chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return TestClient(build_over(LogprobsEngine, options).app)


def _events(response) -> list[dict]:
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": MODEL, "prompt": "x"}


def test_return_tokens_as_token_ids_is_every_request_s_default(tok) -> None:
    tok_dir, tokenizer = tok
    ids = LogprobsEngine.tokens
    named = [f"token_id:{t}" for t in ids]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    with _http(tok_dir, ["--return-tokens-as-token-ids"]) as http, _http(tok_dir, []) as plain:
        body = http.post("/v1/completions", json={**COMPLETION, "logprobs": 2}).json()
        lp = body["choices"][0]["logprobs"]
        assert lp["tokens"] == named and body["choices"][0]["text"] == OUTPUT
        assert [list(top) for top in lp["top_logprobs"]] == [[f"token_id:{t}", f"token_id:{t + 1}"] for t in ids]
        chunks = _events(http.post("/v1/completions", json={**COMPLETION, "logprobs": 1, "stream": True}))
        assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == named
        body = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}).json()
        content = body["choices"][0]["logprobs"]["content"]
        assert [c["token"] for c in content] == named and body["choices"][0]["message"]["content"] == OUTPUT
        assert [[t["token"] for t in c["top_logprobs"]] for c in content] == [
            [f"token_id:{t}", f"token_id:{t + 1}"] for t in ids]
        assert content[0]["bytes"] == list(named[0].encode())
        chunks = _events(http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "stream": True}))
        assert [c["token"] for e in chunks if e["choices"][0]["logprobs"]
                for c in e["choices"][0]["logprobs"]["content"]] == named
        # a request's own return_tokens_as_token_ids wins, either way
        own = {**CHAT, "logprobs": True, "return_tokens_as_token_ids": False}
        assert [c["token"] for c in http.post("/v1/chat/completions", json=own).json()["choices"][0]["logprobs"][
            "content"]] == texts
        lp = plain.post("/v1/completions", json={**COMPLETION, "logprobs": 0}).json()["choices"][0]["logprobs"]
        assert lp["tokens"] == texts
        own = {**COMPLETION, "logprobs": 0, "return_tokens_as_token_ids": True}
        assert plain.post("/v1/completions", json=own).json()["choices"][0]["logprobs"]["tokens"] == named


def test_response_role_is_the_chat_response_s_role(tok) -> None:
    tok_dir, _ = tok
    with _http(tok_dir, ["--response-role", "model"]) as http, _http(tok_dir, []) as plain:
        assert http.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"] == {
            "role": "model", "content": OUTPUT}
        chunks = _events(http.post("/v1/chat/completions", json={**CHAT, "stream": True}))
        assert chunks[0]["choices"][0]["delta"] == {"role": "model", "content": ""}
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == OUTPUT
        assert plain.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["role"] == "assistant"
        first = _events(plain.post("/v1/chat/completions", json={**CHAT, "stream": True}))[0]
        assert first["choices"][0]["delta"]["role"] == "assistant"


def test_max_logprobs_refuses_more_by_the_field_s_name(tok) -> None:
    tok_dir, _ = tok
    with _http(tok_dir, ["--max-logprobs", "2"]) as http, _http(tok_dir, []) as plain:
        for path, body, field in [
            ("/v1/completions", {**COMPLETION, "logprobs": 3}, "logprobs"),
            ("/v1/completions", {**COMPLETION, "prompt_logprobs": 3}, "prompt_logprobs"),
            ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
            ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 5}, "prompt_logprobs"),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == field and f"{field} {body[field]} is more than" in error["message"]
            assert "--max-logprobs 2" in error["message"]
            assert plain.post(path, json=body).status_code == 200  # vLLM's default: 20
        r = http.post("/v1/completions", json={**COMPLETION, "logprobs": 2})
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
        r = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200
        r = plain.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 21})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_router_options_carry_the_flags() -> None:
    assert RouterOptions(model=None, engines=()).output == RouterOptions(model=None, engines=(), max_logprobs=20).output
    with pytest.raises(ValueError, match="--max-logprobs 21"):
        RouterOptions(model=None, engines=(), max_logprobs=21)
