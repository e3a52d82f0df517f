"""How constrained requests fail, wait and reuse in the engine: a JSON schema using a keyword xgrammar
would ignore fails its request naming the keyword and where; constraints that leave no token (against
min_tokens, bad_words) or a token the grammar refuses fail their request alone, never the step; grammars
compile off the step loop (a slow one holds nobody back, an abort frees it, a second identical one is
cached); a constrained request reuses the prefix cache. (What constrained outputs are:
test_structured.py, whose helpers these share; the engines: conftest.py.)"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
from test_structured import SCHEMAS, assert_valid, constrained

from epserve import LLM, SamplingParams
from epserve.config import LoopOptions
from epserve.engine.engine import RequestError
from epserve.engine.loop import EngineLoop
from epserve.engine.structured import GrammarMasks
from epserve.messages.engine import AbortRequest, AddRequest, GeneratedTokens, RequestFailed
from epserve.messages.sampling import StructuredOutput

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")


# ---- JSON-schema keywords xgrammar would ignore: refused, naming the keyword and where ---------------
OBJ = {"type": "object", "additionalProperties": False}
REFUSED = [  # (schema, keyword, JSON pointer); each probed: xgrammar 0.2.9 compiles it and does not enforce it
    ({**OBJ, "properties": {"a": {"type": "integer", "not": {"const": 3}}}, "required": ["a"]}, "not",
     "#/properties/a"),
    ({"allOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]}, "allOf", "#"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#"),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf", "#"),
    ({**OBJ, "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}}, "if", "#"),
    ({**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "#"),
    ({**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "#"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains", "#"),
    ({"$defs": {"n": {"type": "array", "items": {"type": "integer"}, "maxItems": 3, "uniqueItems": True}},
      "$ref": "#/$defs/n"}, "uniqueItems", "#/$defs/n"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", "#"),
    ({"type": "string", "format": "date", "pattern": "^2024-"}, "pattern", "#"),
    ({"type": "string", "format": "idn-email"}, "format", "#"),
    ({"type": "integer", "anyOf": [{"maximum": 3}, {"minimum": 7}]}, "type", "#"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3}, "maximum", "#"),
    ({"oneOf": [{"type": "integer", "maximum": 5}, {"type": "integer", "minimum": 3}]}, "oneOf", "#"),
    ({"enum": ["abc", "de"], "maxLength": 2}, "maxLength", "#"),
    ({"type": "object", "required": ["zz"], "additionalProperties": {"type": "integer"}}, "required", "#"),
    ({**OBJ, "properties": {"xs": {"type": "array", "prefixItems": [{"const": 1, "minimum": 2}]}}},
     "minimum", "#/properties/xs/prefixItems/0"),
]
ACCEPTED = [  # (schema, a valid value, a value the grammar must refuse)
    ({"type": "integer", "minimum": 0, "maximum": 99, "multipleOf": 7}, 63, 64),
    ({"enum": [1, "x", 2.5], "type": "integer"}, 1, "x"),  # the type narrows the enum (xgrammar ignores it)
    ({"const": "cat", "type": "string", "title": "Pet"}, "cat", "dog"),
    ({"allOf": [{"type": "integer", "maximum": 3}], "description": "d"}, 3, 4),
    ({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, "ab", "abc"),
    ({"$defs": {"Cat": {**OBJ, "properties": {"k": {"const": "cat"}, "n": {"type": "integer"}},
                        "required": ["k", "n"]},
                "Dog": {**OBJ, "properties": {"k": {"const": "dog"}, "n": {"type": "integer"}},
                        "required": ["k", "n"]}},
      "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}], "discriminator": {"propertyName": "k"}},
     {"k": "dog", "n": 2}, {"k": "cow", "n": 2}),  # pydantic's discriminated union
    ({"type": "string", "format": "not-a-standard-format", "maxLength": 2}, "ab", "abc"),  # (an annotation)
]


def test_schema_keywords_the_grammar_would_ignore_are_refused(llm) -> None:
    grammars = llm.engine.constraints
    for schema, keyword, path in REFUSED:
        with pytest.raises(ValueError, match=rf"'{re.escape(keyword)}' at {re.escape(path)} is not supported"):
            grammars.compile(StructuredOutput("json_schema", json.dumps(schema)))
    with pytest.raises(ValueError, match="'not' at #/properties/a"):  # inside a tool call's arguments too
        grammars.compile(StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": REFUSED[0][0]},
            "end": "</call>"}})))
    with pytest.raises(RequestError, match="'uniqueItems' at #/\\$defs/n is not supported"):  # the request's error
        llm.generate(["x"], constrained("json_schema", json.dumps(REFUSED[9][0])))
    for schema, good, bad in ACCEPTED:
        grammar = grammars.compile(StructuredOutput("json_schema", json.dumps(schema)))
        assert xgr.GrammarMatcher(grammar).accept_string(json.dumps(good)), schema
        assert not xgr.GrammarMatcher(grammar).accept_string(json.dumps(bad) + " "), schema


# ---- a request's constraints that leave no token, or a token its grammar refuses: it fails alone ------
class Collect:
    """A step loop's frontend keeping what it delivers per request; ``finished[rid]`` is set at the
    request's end (its last tokens, or its failure)."""

    def __init__(self, ids: list[str]) -> None:
        self.outputs: dict[str, list] = {rid: [] for rid in ids}
        self.finished = {rid: threading.Event() for rid in ids}

    def deliver(self, outputs: list) -> None:
        for out in outputs:
            self.outputs[out.request_id].append(out)
            if isinstance(out, RequestFailed) or (isinstance(out, GeneratedTokens) and out.finish_reason):
                self.finished[out.request_id].set()

    def set_draining(self) -> None:
        pass

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] if isinstance(out, GeneratedTokens) for t in out.token_ids]

    def end(self, rid: str) -> GeneratedTokens | RequestFailed:
        assert self.finished[rid].is_set(), rid
        return self.outputs[rid][-1]


def add(llm: LLM, rid: str, prompt: str, params: SamplingParams) -> AddRequest:
    return llm.engine.check_request(AddRequest(rid, tuple(llm.tokenizer.encode(prompt)), params))


def run_loop(llm: LLM, requests: dict[str, tuple[str, SamplingParams]]) -> Collect:
    """The requests through the engine's step loop in this process (offline: until idle)."""
    loop, front = EngineLoop(llm.engine), Collect(list(requests))
    for rid, (prompt, params) in requests.items():
        loop.submit(add(llm, rid, prompt, params), ring=False)
    loop.run(front, until_idle=True)
    return front


def assert_clean(llm: LLM) -> None:
    """The engine holds nothing of finished or failed requests."""
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.constraints.num_matchers == 0
    kv = engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def allowed_tokens(llm: LLM, constraint: StructuredOutput, after: str = "") -> list[int]:
    """The tokens ``constraint``'s grammar allows first (after the text ``after``)."""
    matcher = xgr.GrammarMatcher(llm.engine.constraints.compile(constraint))
    assert matcher.accept_string(after) or not after
    vocab = llm.config.model.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return [t for t in range(vocab) if int(bitmask[0, t // 32]) >> (t % 32) & 1]


FREE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINES = ["llm", "mtp_llm"]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_grammar_ends_a_request_before_its_min_tokens(request, engine) -> None:
    """Where the grammar can only end, min_tokens does not take EOS away (the grammar wins: the output
    ends shorter); where it can go on, min_tokens holds."""
    llm = request.getfixturevalue(engine)
    alone = llm.generate(["The quick brown fox"], FREE)[0]
    outs = llm.generate(["Answer:", "The quick brown fox", "Answer:"], [
        constrained("choice", json.dumps(["yes", "no"]), temperature=1.0, seed=7, min_tokens=6),
        FREE,
        constrained("regex", "[a-z]+", temperature=1.0, seed=8, min_tokens=6, max_tokens=30)])
    assert outs[0].finish_reason == "stop" and outs[0].text in ("yes", "no") and len(outs[0].token_ids) < 6
    assert outs[1].token_ids == alone.token_ids
    assert re.fullmatch("[a-z]+", outs[2].text) and len(outs[2].token_ids) >= 6
    assert_clean(llm)


@pytest.mark.parametrize("engine", ENGINES)
def test_constraints_that_leave_no_token_fail_their_request_alone(request, engine) -> None:
    """bad_words that cover every token the grammar allows, at the first token or after one: that request
    fails with the reason (an error its client sees), the free one in its batch finishes as if alone."""
    llm = request.getfixturevalue(engine)
    alone = llm.generate(["The quick brown fox"], FREE)[0]
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    regex = StructuredOutput("regex", "x[0-9]{2}")
    first = allowed_tokens(llm, regex)
    (x,) = [t for t in first if llm.tokenizer.decode([t]) == "x"]
    banned_later = [[t] for t in first if t != x] + [[t] for t in allowed_tokens(llm, regex, "x")]
    front = run_loop(llm, {
        "at_once": ("Answer:", SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured=choice,
                                              bad_words=[[t] for t in allowed_tokens(llm, choice)])),
        "free": ("The quick brown fox", FREE),
        "after_one": ("Answer:", SamplingParams(max_tokens=20, temperature=0.0, structured=regex,
                                                bad_words=banned_later)),
    })
    for rid, tokens in [("at_once", []), ("after_one", [x])]:
        end = front.end(rid)
        assert isinstance(end, RequestFailed) and end.reason == "invalid" and "no token allowed" in end.message
        assert front.tokens(rid) == tokens  # (what it had streamed before)
    assert front.tokens("free") == alone.token_ids and front.end("free").finish_reason == "length"
    assert_clean(llm)
    with pytest.raises(RequestError, match="no token allowed"):  # offline: the call says why
        llm.generate(["Answer:"], SamplingParams(max_tokens=5, structured=choice,
                                                 bad_words=[[t] for t in allowed_tokens(llm, choice)]))
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].token_ids  # the engine still serves


def test_a_token_its_grammar_refuses_fails_its_request_alone(llm, monkeypatch) -> None:
    """Were the mask ever wrong (here: not applied at all), the matcher's refusal fails that request, not
    the step."""
    alone = llm.generate(["The quick brown fox"], FREE)[0]
    first = llm.generate(["Answer:"], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    choice = next(c for c in (StructuredOutput("choice", json.dumps([s])) for s in ("qz", "zq", "kk"))
                  if first not in allowed_tokens(llm, c))
    monkeypatch.setattr(GrammarMasks, "_mask", lambda self, logits, bitmask, rows, held: torch.zeros(
        len(rows), dtype=torch.bool, device=logits.device))
    front = run_loop(llm, {"wrong": ("Answer:", SamplingParams(max_tokens=8, temperature=0.0, structured=choice)),
                           "free": ("The quick brown fox", FREE)})
    end = front.end("wrong")
    assert isinstance(end, RequestFailed) and f"token {first} breaks the structured-output grammar" in end.message
    assert front.tokens("wrong") == [] and front.tokens("free") == alone.token_ids
    assert_clean(llm)


# ---- compiling off the step loop ---------------------------------------------------------------------
class Serving:
    """The engine's step loop serving on a thread of its own (as under the gRPC service), stopped at
    the end; the compiler's ``compile`` held at ``gate`` (``entered`` set once it waits there)."""

    def __init__(self, llm: LLM, ids: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.llm, self.gate, self.entered = llm, threading.Event(), threading.Event()
        grammars = llm.engine.constraints.compiler  # (the compiler thread calls its compile)
        compile_ = grammars.compile

        def held(constraint: StructuredOutput):
            self.entered.set()
            assert self.gate.wait(60)
            return compile_(constraint)

        monkeypatch.setattr(grammars, "compile", held)
        self.loop, self.front = EngineLoop(llm.engine, LoopOptions(stats_every=0)), Collect(ids)
        self.thread = threading.Thread(target=self.loop.run, args=(self.front,), daemon=True)

    def __enter__(self) -> Serving:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.loop.request_stop()
        self.thread.join(60)
        assert not self.thread.is_alive()

    def submit(self, rid: str, prompt: str, params: SamplingParams) -> None:
        self.loop.submit(add(self.llm, rid, prompt, params))

    def wait(self, rid: str) -> GeneratedTokens | RequestFailed:
        assert self.front.finished[rid].wait(60), rid
        return self.front.end(rid)


def unique_schema(tag: str) -> str:
    """A small schema no other test compiles (so the compiler's cache has not seen it)."""
    return json.dumps({"type": "object", "properties": {tag: {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": [tag], "additionalProperties": False})


def test_a_slow_compile_holds_no_request_back(llm, monkeypatch) -> None:
    with Serving(llm, ["slow", "free"], monkeypatch) as serving:
        serving.submit("slow", "Answer:", constrained("json_schema", unique_schema("slow"), temperature=0.0))
        assert serving.entered.wait(60)  # compiling, and held there
        serving.submit("free", "The quick brown fox", FREE)
        assert serving.wait("free").finish_reason == "length"
        assert not serving.front.finished["slow"].is_set() and "slow" in serving.loop.compiling
        serving.gate.set()
        end = serving.wait("slow")
    assert end.finish_reason == "stop"
    assert json.loads(llm.tokenizer.decode(serving.front.tokens("slow")))["slow"] in range(10)
    assert_clean(llm)


def test_an_abort_while_compiling_frees_the_request(llm, monkeypatch) -> None:
    with Serving(llm, ["cut", "free", "after"], monkeypatch) as serving:
        loop, submit = serving.loop, serving.loop.submit
        compiled = threading.Event()

        def noting(message, ring=True):  # the compiler's callback queues GrammarCompiled through this
            submit(message, ring)
            if type(message).__name__ == "GrammarCompiled":
                compiled.set()

        monkeypatch.setattr(loop, "submit", noting)
        serving.submit("cut", "Answer:", constrained("json_schema", unique_schema("cut"), temperature=0.0))
        assert serving.entered.wait(60)
        loop.submit(AbortRequest("cut"))
        serving.submit("free", "The quick brown fox", FREE)
        serving.wait("free")  # (queued after the abort: the loop took the abort first)
        assert "cut" not in loop.compiling
        serving.gate.set()
        assert compiled.wait(60)
        serving.submit("after", "The quick brown fox", FREE)
        assert serving.wait("after").finish_reason == "length"  # (the loop took GrammarCompiled before it)
        assert serving.front.outputs["cut"] == [] and not loop.compiling and "cut" not in loop.requests
    assert not llm.engine.constraints.constrains("cut")
    assert_clean(llm)


def test_an_identical_constraint_compiles_once(llm) -> None:
    grammars = llm.engine.constraints.compiler
    before = grammars.num_compiled
    same = constrained("json_schema", unique_schema("cached"), temperature=0.0)
    outs = llm.generate(["x", "y"], [same, same])
    assert grammars.num_compiled == before + 1 and all(o.finish_reason == "stop" for o in outs)
    llm.generate(["z"], same)
    assert grammars.num_compiled == before + 1
    llm.generate(["z"], constrained("json_schema", unique_schema("other"), temperature=0.0))
    assert grammars.num_compiled == before + 2


def test_a_constrained_request_reuses_the_prefix_cache(llm) -> None:
    prompt = list(range(300, 340))  # two full blocks of 16 tokens, then 8
    params = constrained("json_schema", json.dumps(SCHEMAS["enum_and_range"]), temperature=0.0)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.token_ids == first.token_ids and first.finish_reason == "stop"
    assert_valid(second.text, SCHEMAS["enum_and_range"])
