"""Structured outputs in the engine (xgrammar): for JSON schemas of every common shape, every sampled
output validates (string formats included) and ends within max_tokens, plain, with MTP and with the
compiled decode; regex, choice, EBNF grammar and json_object; constrained and free requests in one batch
(the free ones unchanged); a constraint that does not compile fails its request naming the problem.
(How constrained requests fail, wait and reuse: test_structured_failures.py.)"""

from __future__ import annotations

import ipaddress
import json
import re
from datetime import date, datetime

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.engine.engine import RequestError
from epserve.engine.json_schema import FORMAT_PATTERNS
from epserve.engine.structured import GrammarCompiler, GrammarMasks
from epserve.messages.sampling import StructuredOutput

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")  # (a GPU image without it skips these; setup installs it everywhere else)

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                   "admin": {"type": "boolean"}},
                 "required": ["name", "admin"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array_bounds": {"type": "object", "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1,
               "maxItems": 4}}, "required": ["xs"], "additionalProperties": False},
    "enum_and_range": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "score": {"type": "number", "minimum": -1, "maximum": 1},
        "n": {"type": "integer", "minimum": 10, "maximum": 20}},
        "required": ["color", "score", "n"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 5},
                                                  "b": {"type": "string", "maxLength": 3}},
                 "required": ["a"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                                 {"type": "string", "maxLength": 4},
                                                                 {"type": "null"}]}},
               "required": ["v"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                 "at": {"type": "string", "format": "date-time"},
                                                 "ip": {"type": "string", "format": "ipv4"},
                                                 "id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
                "required": ["day", "at", "ip", "id"], "additionalProperties": False},
    "more_formats": {"type": "object", "properties": {"u": {"type": "string", "format": "uuid"},
                                                      "v6": {"type": "string", "format": "ipv6"},
                                                      "t": {"type": "string", "format": "time"}},
                     "required": ["u", "v6", "t"], "additionalProperties": False},
}

# jsonschema's checkers for draft 2020-12 (date, email, ipv4, ipv6, uuid, regex, ... here; date-time and
# time need rfc3339-validator, hostname fqdn, uri rfc3987: not installed, so checked apart below).
# (``jsonschema.FormatChecker()`` would check "time" by draft 3's rule, HH:MM:SS without an offset.)
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def check_hostname(value: str) -> None:
    """RFC 1123: dot-separated labels of letters, digits and inner hyphens, 63 characters each at most."""
    if len(value) > 253 or not all(_LABEL.fullmatch(label) for label in value.split(".")):
        raise ValueError(f"{value!r} is not a hostname")


STRICT_FORMATS = {  # RFC 3339 date-time and time, RFC 1123 hostname: by the standard library
    "date": date.fromisoformat,
    "date-time": datetime.fromisoformat,
    "time": lambda v: datetime.fromisoformat("1970-01-01T" + v),
    "ipv4": ipaddress.IPv4Address,
    "hostname": check_hostname,
}


def no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def assert_valid(text: str, schema: dict) -> None:
    """``text`` is JSON (no NaN or Infinity) valid under ``schema``, its string formats checked."""
    value = json.loads(text, parse_constant=no_constant)
    jsonschema.validate(value, schema, format_checker=FORMATS)
    for name, sub in schema.get("properties", {}).items():
        if sub.get("format") in STRICT_FORMATS and name in value:
            STRICT_FORMATS[sub["format"]](value[name])


@pytest.fixture(scope="module")
def compiled_llm(tiny_ckpt):
    """``compile=True``: the decode forward one compiled graph per batch bucket (``aot_eager``: the same
    fullgraph trace, no codegen), two buckets."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")
        return LLM(tiny_ckpt, dtype="float32", num_blocks=64, max_num_seqs=2, compile=True)


def constrained(kind: str, spec: str = "", **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 120)
    return SamplingParams(structured=StructuredOutput(kind, spec), **kw)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize(("mode", "seeds"), [("plain", 6), ("mtp", 3), ("compiled", 2)])
def test_every_output_validates_against_its_schema(request, mode, seeds, name) -> None:
    """Plain, with MTP drafts (verified against the grammar) and with the compiled decode."""
    engine = request.getfixturevalue({"plain": "llm", "mtp": "mtp_llm", "compiled": "compiled_llm"}[mode])
    schema = SCHEMAS[name]
    params = [constrained("json_schema", json.dumps(schema), temperature=1.0, seed=s, max_tokens=160)
              for s in range(seeds)]
    for out in engine.generate(["Answer in JSON:"] * len(params), params):
        assert out.finish_reason == "stop", out.text  # ended by the grammar (EOS where it can end)
        assert_valid(out.text, schema)


def walk(grammar, vocab_size: int, eos: int, rng: torch.Generator, max_steps: int = 300) -> list[int] | None:
    """A random path through ``grammar``: allowed tokens drawn uniformly, EOS (where allowed) half the
    time; the tokens, or None past ``max_steps``."""
    matcher, bitmask, out = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab_size), []
    ids = torch.arange(vocab_size)
    for _ in range(max_steps):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = (bitmask[0, ids // 32] >> (ids % 32)) & 1 == 1
        can_end, allowed[eos] = bool(allowed[eos]), False
        others = allowed.nonzero().flatten()
        if not len(others) or (can_end and torch.rand(1, generator=rng).item() < 0.5):
            return out
        token = int(others[torch.randint(len(others), (1,), generator=rng)])
        assert matcher.accept_token(token)
        out.append(token)
    return None


def test_string_formats_admit_only_valid_values(llm) -> None:
    """Every path through the format grammars is a valid value (xgrammar's own date, time, date-time,
    ipv4 and hostname rules admit 2023-11-31, second 60, octet 010, 64-character labels: replaced by
    exact patterns); the patterns' edges (leap years, month ends) checked one by one."""
    grammars, tokenizer = llm.engine.constraints, llm.tokenizer
    vocab, eos, rng = llm.config.model.vocab_size, llm.config.model.eos_token_ids[0], torch.Generator().manual_seed(0)
    for fmt in ("date", "time", "date-time", "ipv4", "ipv6", "uuid", "email", "hostname"):
        schema = {"type": "string", "format": fmt}
        grammar = grammars.compile(StructuredOutput("json_schema", json.dumps(schema)))
        for _ in range(30):
            path = walk(grammar, vocab, eos, rng)
            if path is not None:
                value = json.loads(tokenizer.decode(path))
                jsonschema.validate(value, schema, format_checker=FORMATS)
                if fmt in STRICT_FORMATS:
                    STRICT_FORMATS[fmt](value)
    date_grammar = grammars.compile(StructuredOutput("json_schema", '{"type": "string", "format": "date"}'))
    for day, valid in [("2024-02-29", True), ("2000-02-29", True), ("0004-02-29", True), ("2023-02-29", False),
                       ("1900-02-29", False), ("2023-11-30", True), ("2023-11-31", False), ("2023-12-31", True),
                       ("2023-04-31", False), ("0000-01-01", False), ("0001-01-01", True), ("2023-13-01", False)]:
        assert xgr.GrammarMatcher(date_grammar).accept_string(json.dumps(day)) == valid, day
    for fmt, value, valid in [("time", "23:59:60Z", False), ("time", "23:59:59.5+01:00", True),
                              ("ipv4", "10.0.0.255", True), ("ipv4", "010.0.0.1", False), ("ipv4", "256.0.0.1", False),
                              ("hostname", "a-b.example.org", True), ("hostname", "-a.org", False),
                              ("hostname", "a" * 64, False), ("date-time", "2024-02-29T00:00:00Z", True)]:
        assert (re.fullmatch(FORMAT_PATTERNS[fmt][1:-1], value) is not None) == valid, (fmt, value)
        grammar = grammars.compile(StructuredOutput("json_schema", json.dumps({"type": "string", "format": fmt})))
        assert xgr.GrammarMatcher(grammar).accept_string(json.dumps(value)) == valid, (fmt, value)


def test_regex_choice_grammar_and_json_object(llm) -> None:
    outs = llm.generate(["x"] * 5, [
        constrained("regex", r"[0-9]{3}-[a-z]{2}", temperature=0.0),
        constrained("regex", r"(ab|cd)+!", temperature=1.0, seed=1, max_tokens=30),
        constrained("choice", json.dumps(["yes", "no", "maybe not"]), temperature=1.0, seed=2),
        constrained("grammar", 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] digits', temperature=1.0,
                    seed=3, max_tokens=12),
        constrained("json_object", temperature=1.0, seed=4),
    ])
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].text)
    assert outs[1].finish_reason == "length" or re.fullmatch(r"(ab|cd)+!", outs[1].text)
    assert outs[2].text in ("yes", "no", "maybe not")
    assert outs[3].finish_reason == "length" or re.fullmatch(r"\([0-9]+\)", outs[3].text)
    assert outs[4].finish_reason == "length" or isinstance(json.loads(outs[4].text), dict)


def test_a_grammar_that_cannot_finish_in_time_stops_at_length(llm) -> None:
    out = llm.generate(["x"], constrained("regex", "a{50}", temperature=0.0, max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_a_complete_grammar_allows_only_eos(llm) -> None:
    """A request that ignores EOS goes on after its grammar completes: with EOS alone."""
    eos = llm.config.model.eos_token_ids[0]
    out = llm.generate(["x"], constrained("choice", json.dumps(["yes", "no"]), temperature=1.0, seed=5,
                                          ignore_eos=True, max_tokens=8))[0]
    text_ids = [t for t in out.token_ids if t != eos]
    assert llm.tokenizer.decode(text_ids) in ("yes", "no")
    assert out.token_ids[len(text_ids):] == [eos] * (8 - len(text_ids))
    masks = GrammarMasks(64, (31, 63))  # the top bit of an int32 word, twice
    masks._matchers["r"] = type("Done", (), {"is_terminated": lambda self: True})()
    logits = torch.zeros(1, 64)
    masks.apply(logits, ["r"])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31, 63]


def test_constrained_and_free_requests_share_a_batch(llm) -> None:
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = llm.generate(["The quick brown fox"], free)[0]
    outs = llm.generate(["Answer:", "The quick brown fox", "Answer:"],
                        [constrained("choice", json.dumps(["A", "B"]), temperature=0.0), free,
                         constrained("json_schema", json.dumps(SCHEMAS["optional"]), temperature=0.0)])
    assert outs[0].text in ("A", "B") and json.loads(outs[2].text)["a"] in range(6)
    assert outs[1].token_ids == alone.token_ids
    assert [lp.logprob for lp in outs[1].logprobs] == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-5)


def test_constraints_that_do_not_compile_name_the_problem(llm) -> None:
    for kind, spec, hint in [("json_schema", '{"type": "objectx"}', "objectx"), ("json_schema", "{not json", "json"),
                             ("regex", "(", "parenthesis"), ("grammar", "root ::= undefined_rule", "undefined")]:
        with pytest.raises(RequestError, match=f"(?i){hint}"):
            llm.generate(["x"], constrained(kind, spec))
    assert llm.generate(["x"], SamplingParams(max_tokens=2)) [0].token_ids  # the engine still serves


def test_mtp_drafts_are_verified_against_the_grammar(counter_ckpt, device) -> None:
    """Greedy constrained outputs with MTP equal plain decoding's; sampled ones are reproducible and valid
    (a draft the grammar refuses is rejected, its tentative matcher steps rolled back)."""
    engine = dict(dtype="float32", num_blocks=256, block_size=8, device=device)
    schema = SCHEMAS["enum_and_range"]
    prompts = [[5, 6, 7, 8], [30, 31], [12, 13, 14, 15]]
    greedy = [constrained("json_schema", json.dumps(schema), temperature=0.0),
              constrained("regex", "[a-z]{3,8}( [a-z]{2,6}){4}", temperature=0.0, max_tokens=60),
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    plain = LLM(counter_ckpt, num_speculative_tokens=0, **engine).generate(prompts, greedy)
    mtp = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **engine)
    outs = mtp.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    jsonschema.validate(json.loads(outs[0].text), schema)
    stats = mtp.speculative_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    sampled = [constrained("json_schema", json.dumps(schema), temperature=1.0, seed=s) for s in range(4)]
    a, b = mtp.generate(prompts[:1] * 4, sampled), mtp.generate(prompts[:1] * 4, sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for out in a:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_a_constraint_after_the_reasoning(tiny_ckpt) -> None:
    """The router's wrapping (``router/tools.after_reasoning``): any text up to ``</think>``, then the
    constraint, compiled by the engine's compiler."""
    import xgrammar as xgr

    from epserve.router.tools import after_reasoning

    llm_config = LLM(tiny_ckpt, dtype="float32", num_blocks=16).config.model
    compiler = GrammarCompiler(tiny_ckpt, llm_config.vocab_size, llm_config.eos_token_ids)
    for constraint, answer, wrong in [
        (StructuredOutput("regex", "[a-z]{2}-[0-9]{2}"), "ab-12", "ab-1x"),
        (StructuredOutput("json_schema", json.dumps(SCHEMAS["optional"])), '{"a":3}', '{"a":9}'),
        (StructuredOutput("choice", json.dumps(["yes", "no"])), "no", "nah"),
    ]:
        grammar = compiler.compile(after_reasoning(constraint, "</think>"))
        good = xgr.GrammarMatcher(grammar)
        assert good.accept_string("Hmm, {not json} and <b>tags</b>.</think>") and good.accept_string(answer)
        assert good.accept_token(llm_config.eos_token_ids[0]) and good.is_terminated()
        bad = xgr.GrammarMatcher(grammar)
        assert bad.accept_string("Thinking.</think>") and not bad.accept_string(wrong)


def test_preempted_constrained_requests_keep_their_grammar(tiny_ckpt, device) -> None:
    """A cache too small for the batch preempts (recomputes) requests mid-output: the matchers are not
    touched by it, so the outputs equal those of a roomy cache, and follow their schema."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}, "minItems": 30,
                                                  "maxItems": 40}},
              "required": ["xs"], "additionalProperties": False}
    params = [constrained("json_schema", json.dumps(schema), temperature=1.0, seed=s, max_tokens=120) for s in range(6)]
    prompts = [[5 + i] * 20 for i in range(6)]
    roomy = LLM(tiny_ckpt, dtype="float32", num_blocks=128, block_size=8, device=device).generate(prompts, params)
    tight = LLM(tiny_ckpt, dtype="float32", num_blocks=24, block_size=8, device=device)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out in outs:
        assert out.finish_reason == "length" or jsonschema.validate(json.loads(out.text), schema) is None


def test_constrained_decode_steps_run_captured(tiny_ckpt, compiled_llm) -> None:
    """With ``compile=True`` the decode forward is one compiled graph per batch bucket and the mask is
    applied to its logits outside it: the outputs equal eager decoding's, and follow the grammar."""
    params = [constrained("json_schema", json.dumps(SCHEMAS["enum_and_range"]), temperature=0.0),
              constrained("regex", "[a-z]{2,5}-[0-9]{2}", temperature=1.0, seed=3)]
    eager = LLM(tiny_ckpt, dtype="float32", num_blocks=64, max_num_seqs=2).generate(["x", "y"], params)
    llm = compiled_llm
    assert llm.engine.runner.decode_graphs is not None
    outs = llm.generate(["x", "y"], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    jsonschema.validate(json.loads(outs[0].text), SCHEMAS["enum_and_range"])
    assert re.fullmatch("[a-z]{2,5}-[0-9]{2}", outs[1].text)


def test_an_aborted_constrained_request_frees_its_matcher_and_blocks(llm) -> None:
    engine = llm.engine
    constraint = StructuredOutput("regex", "[a-z]{200}")
    engine.constraints.add("cut", engine.constraints.compile(constraint))
    engine.add_request("cut", [5, 6, 7], SamplingParams(max_tokens=150, structured=constraint))
    for _ in range(4):
        engine.step()
    assert engine.constraints.constrains("cut")
    assert engine.abort_request("cut")
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.constraints.constrains("cut")
    kv = engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
