"""The OpenAPI document describes ``/v1/responses``, ``/tokenizer_info`` and ``/ping``, and what the router
answers there (in process, over a scripted engine) is what it says. (``test_serve_hardening`` fuzzes the whole
document against a real server.)"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from epserve.router.server import RouterOptions
from tests.router_toys import ScriptedRouter, build_over, scripted_tokenizer

jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny"


class Engine(ScriptedRouter):
    prompts: list[list[int]] = []
    params: list = []
    serving = True  # (an instance is healthy)


class Down(Engine):
    serving = False  # (none is)


def _client(tok_dir, router=Engine) -> TestClient:
    options = RouterOptions(model=str(tok_dir), engines=("127.0.0.1:1",), served_model_name=MODEL)
    return TestClient(build_over(router, options).app)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    tok_dir, tok = scripted_tokenizer(tmp_path_factory)
    Engine.tokens = tok.encode("ok then", add_special_tokens=False)
    with _client(tok_dir) as http:
        yield tok_dir, http, http.get("/openapi.json").json()


def _schema(doc: dict, path: str, method: str, status: str, media: str = "application/json") -> dict:
    """The answer's schema, resolvable against the document's components."""
    schema = doc["paths"][path][method]["responses"][status]["content"][media]["schema"]
    return {**schema, "components": doc["components"]}


def _valid(schema: dict, body) -> None:  # noqa: ANN001
    jsonschema.validate(body, schema)  # (its $refs: the components carried in it)


def test_the_responses_route_is_described_and_answers_as_described(served):
    _, http, doc = served
    op = doc["paths"]["/v1/responses"]["post"]
    body = op["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    assert {"200", "400", "401", "404", "413", "503"} <= set(op["responses"])
    assert {"text/event-stream", "application/json"} == set(op["responses"]["200"]["content"])
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "max_output_tokens", "tools", "previous_response_id"} <= set(props)
    for body, status in [({"input": "hi"}, "completed"), ({"input": "hi", "max_output_tokens": 1}, "incomplete")]:
        Engine.finish_reason = "length" if status == "incomplete" else "stop"
        r = http.post("/v1/responses", json={"model": MODEL, **body})
        assert r.status_code == 200 and r.json()["status"] == status
        _valid(_schema(doc, "/v1/responses", "post", "200"), r.json())
    Engine.finish_reason = "stop"
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "resp_1"})
    assert r.status_code == 400
    _valid(_schema(doc, "/v1/responses", "post", "400"), r.json())
    r = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream") and events[-1]["type"] == "response.completed"


def test_tokenizer_info_and_ping_are_described_and_answer_as_described(served):
    tok_dir, http, doc = served
    r = http.get("/tokenizer_info")
    assert r.status_code == 200
    _valid(_schema(doc, "/tokenizer_info", "get", "200"), r.json())
    assert set(doc["paths"]["/tokenizer_info"]["get"]["responses"]) == {"200", "404"}
    ping = doc["paths"]["/ping"]["get"]["responses"]
    assert set(ping) == {"200", "503"} and all("content" not in answer for answer in ping.values())
    assert "/ping" in doc["paths"] and "post" not in doc["paths"]["/ping"]  # (POST too, as vLLM's; undescribed)
    r = http.get("/ping")
    assert r.status_code == 200 and r.content == b""
    with _client(tok_dir, Down) as down:
        r = down.get("/ping")
        assert r.status_code == 503 and r.content == b""
