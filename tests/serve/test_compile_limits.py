"""A real ``epserve serve`` given what a structured-output compile must not take: a JSON schema whose
``pattern`` nests 30,000 groups (60 KB; it overflowed xgrammar's stack and killed the rank, which the
router then retried on every restarted group until the command exited) is a 400 naming the bound, by
whichever field it arrives, and the same router and rank serve on; tools beyond OpenAI's limits (more
than 128, a name outside ``^[a-zA-Z0-9_-]{1,64}$``) are a 400 naming the field. (The bounds, the grammar
worker's crashes, time and memory limits and cancelling: tests/engine/test_structured_failures.py;
constraints compiled in a serving rank's worker: the serve tests of structured outputs and forced tool
calls, e.g. test_openai_surface.py.)"""

from __future__ import annotations

import json

import httpx
import pytest

from epserve.parallel.launch import free_port
from tests.serve_harness import Proc, alive, wait_http_ok

DEEP = 30_000
NESTED = {"type": "string", "pattern": "(" * DEEP + "a" + ")" * DEEP}


@pytest.fixture(scope="module")
def server(make_ckpt, tmp_path_factory):
    ckpt = make_ckpt("tiny", dtype="float32")
    port = free_port()
    log = tmp_path_factory.mktemp("compile-limits") / "serve.log"
    proc = Proc(["serve", str(ckpt), "--port", str(port), "--dtype", "float32", "--num-blocks", "32",
                 "--max-model-len", "256"], log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc)
        yield proc, url
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def test_a_deeply_nested_pattern_is_a_400_and_the_rank_serves_on(server):
    proc, url = server
    ranks = proc.ranks(1)
    prompt = {"prompt": "Answer:", "max_tokens": 4}
    bodies = [{**prompt, "guided_json": NESTED}, {**prompt, "structured_outputs": {"json": NESTED}},
              {**prompt, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": NESTED}}}]
    assert len(json.dumps(NESTED)) > 60_000
    for body in bodies:
        r = post(url, "/v1/completions", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert f"nests its groups {DEEP} levels deep; at most 128 are allowed" in error["message"]
    r = post(url, "/v1/completions", prompt)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
    assert proc.proc.poll() is None and proc.ranks(1) == ranks and all(map(alive, ranks))


def test_tools_beyond_openai_limits_are_a_400_naming_the_field(server):
    _, url = server

    def tool(name: str) -> dict:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(url, "/v1/chat/completions", {**chat, "tools": [tool(f"f{i}") for i in range(129)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "tools has 129 entries; at most 128" in r.json()["error"]["message"]
    for bad in ("get.weather", "<｜tool▁sep｜>x", "a" * 65, "city name"):
        r = post(url, "/v1/chat/completions", {**chat, "tools": [tool("ok"), tool(bad)], "tool_choice": "none"})
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == "tools[1].function.name", r.text
    r = post(url, "/v1/chat/completions", {**chat, "tools": [tool(f"f-{i}_X") for i in range(128)],
                                           "tool_choice": "none"})
    assert r.status_code == 200, r.text
