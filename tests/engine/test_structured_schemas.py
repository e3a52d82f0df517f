"""Constraints refused before they compile, naming why: a JSON schema using a keyword xgrammar would
silently ignore (the keyword and its JSON pointer; what is enforced instead is accepted), and what is
larger than a compile may take (a spec's size, JSON nested too deeply, regular-expression groups nested
too deeply: a JSON-schema pattern of 30,000 nested groups overflowed xgrammar's stack and killed the
rank) is refused before xgrammar sees it. (How constrained requests fail, and the grammar worker's own
limits: test_structured_failures.py; the engines: conftest.py.)"""

from __future__ import annotations

import json
import re

import pytest
from test_structured import constrained

from epserve.engine.engine import RequestError
from epserve.engine.grammars import CompileLimits, check_bounds, json_depth, regex_depth
from epserve.messages.sampling import StructuredOutput

xgr = pytest.importorskip("xgrammar")

DEEP = 30_000  # nested groups: xgrammar's JSON-schema converter overflows its 8 MiB stack on these
NESTED = json.dumps({"type": "string", "pattern": "(" * DEEP + "a" + ")" * DEEP})  # about 60 KB


def nested(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


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


# ---- bounds, before compiling --------------------------------------------------------------------
def test_what_is_too_large_or_too_deep_is_refused_before_compiling() -> None:
    limits, small = CompileLimits(), CompileLimits(max_spec_bytes=4096)
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": "[a-z]"}, {"type": "json_schema", "json_schema": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": nested(129)}}}}]}}
    refused = [
        ("json_schema", NESTED, f"the pattern at # nests its groups {DEEP} levels deep; at most 128"),
        ("regex", nested(200), "the regex nests its groups 200 levels deep"),
        ("structural_tag", json.dumps(tag), "the pattern at #/format/elements/1/json_schema/properties/a nests "
                                            "its groups 129"),
        ("json_schema", json.dumps({"type": "object", "patternProperties": {nested(300): {}}}),
         "the pattern at #/patternProperties nests its groups 300"),
        ("json_schema", "[" * 129 + "]" * 129, "nests 129 levels deep; at most 128"),
        ("choice", json.dumps(["x" * 5000]), "is 5004 bytes; a constraint may have at most 4096"),
    ]
    for kind, spec, message in refused:
        with pytest.raises(ValueError) as e:
            check_bounds(kind, spec, small if kind == "choice" else limits)
        assert message in str(e.value), (kind, str(e.value))
    # escaped and bracketed parentheses are no groups; brackets inside JSON strings nest nothing
    assert regex_depth("\\(" * 500 + "[(]" * 500 + nested(128)) == 128
    assert json_depth(json.dumps({"a": "[[[[{{{{" * 100, "b": [[1]]})) == 3
    check_bounds("json_schema", json.dumps({"type": "string", "pattern": nested(128)}), limits)
    check_bounds("regex", nested(128), limits)
