"""JSON schemas as structured outputs enforce them: what xgrammar 0.2.9 would silently ignore is refused,
naming the keyword and its JSON pointer (``prepare_schema``), and the string formats its converter gets
wrong are replaced by exact patterns (``FORMAT_PATTERNS``). Plain Python, no xgrammar: the compiler
(``engine/structured.py``) hands xgrammar the prepared schema.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# ---- JSON schemas: what xgrammar enforces, and the string formats it gets wrong -----------------
# Probed on xgrammar 0.2.9 (tests/engine/test_structured.py holds each case): these keywords are
# silently ignored by its converter, so a schema that uses them is refused (the client would get
# outputs that do not validate), naming the keyword and where it sits.

_IGNORED = {
    "not": "not enforced",
    "if": "conditional schemas are not enforced", "then": "conditional schemas are not enforced",
    "else": "conditional schemas are not enforced",
    "dependentSchemas": "not enforced", "dependentRequired": "not enforced", "dependencies": "not enforced",
    "contains": "not enforced", "minContains": "not enforced", "maxContains": "not enforced",
}
# Keywords that only annotate (or hold definitions): allowed beside anything.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
    "$schema", "$id", "$anchor", "$defs", "definitions", "discriminator", "contentEncoding",
    "contentMediaType", "contentSchema",
})
# Where subschemas sit: maps of them, single ones, lists of them.
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUB_ONE = ("additionalProperties", "unevaluatedProperties", "items", "propertyNames", "unevaluatedItems")
_SUB_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
# The string formats xgrammar constrains; the standard ones it leaves unconstrained (any string), refused
# rather than ignored. Formats outside the standard ones are annotations (JSON Schema's rule) and
# constrain nothing.
_XGRAMMAR_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
                               "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                               "relative-json-pointer"})
_UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})

# Formats whose xgrammar rule admits invalid values (days past the month's end such as 2023-11-31 or
# 2023-02-30, second 60, IPv4 octets with leading zeros such as 010, hostname labels over 63
# characters), replaced by exact patterns: every value they admit is valid (RFC 3339 dates from year
# 0001 with leap years, times with up to three fraction digits, RFC 1123 hostnames of up to three
# labels). The patterns avoid what xgrammar 0.2.9 matches wrongly inside a JSON string: a group made
# optional or repeated around ``+`` or ``{m,n}`` (``([.][0-9]+)?`` also admits ``2``), hence the
# spelled-out repetitions.
_YEAR = "(000[1-9]|00[1-9][0-9]|0[1-9][0-9][0-9]|[1-9][0-9][0-9][0-9])"
_LEAP_YEAR = "([0-9][0-9](0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         f"|02-(0[1-9]|1[0-9]|2[0-8]))|{_LEAP_YEAR}-02-29)")
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9][0-9]?[0-9]?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"
_LABEL = "[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": f"^{_OCTET}[.]{_OCTET}[.]{_OCTET}[.]{_OCTET}$",
    "hostname": f"^{_LABEL}([.]{_LABEL})?([.]{_LABEL})?$",
}


class UnsupportedSchema(ValueError):
    """A JSON schema that uses what the grammar would not enforce."""

    def __init__(self, keyword: str, path: str, why: str) -> None:
        super().__init__(f"{keyword!r} at {path} is not supported ({why})")


def prepare_schema(schema: Any) -> Any:
    """``schema`` as xgrammar gets it: the string formats it gets wrong replaced by exact patterns, an
    ``enum``/``const`` narrowed to the values of its ``type``; UnsupportedSchema for a keyword it would
    ignore (its JSON pointer in the message, e.g. ``#/properties/a``)."""
    return _prepare(schema, "#", schema)


def _pointer(path: str, *keys: object) -> str:
    return "/".join([path, *(str(k).replace("~", "~0").replace("/", "~1") for k in keys)])


def _prepare(node: Any, path: str, root: Any) -> Any:
    if not isinstance(node, dict):
        return node  # (true/false, or what xgrammar's converter refuses itself)
    for key, why in _IGNORED.items():
        if key in node:
            raise UnsupportedSchema(key, path, why)
    if node.get("uniqueItems") is True:
        raise UnsupportedSchema("uniqueItems", path, "not enforced")
    if "allOf" in node and (not isinstance(node["allOf"], list) or len(node["allOf"]) > 1):
        raise UnsupportedSchema("allOf", path, "only an allOf of one schema is enforced")
    if "multipleOf" in node and not (node.get("type") == "integer" and isinstance(node["multipleOf"], int)):
        raise UnsupportedSchema("multipleOf", path, "enforced only for type integer with an integer multipleOf")
    fmt = node.get("format")
    if isinstance(fmt, str) and node.get("type") == "string":
        if fmt in _UNENFORCED_FORMATS:
            raise UnsupportedSchema("format", path, f"format {fmt!r} is not enforced")
        rest = {k: v for k, v in node.items() if k != "format"}
        if fmt in _XGRAMMAR_FORMATS:
            beside = next((k for k in ("pattern", "minLength", "maxLength") if k in node), None)
            if beside is not None:
                raise UnsupportedSchema(beside, path, f"not enforced together with format {fmt!r}")
            if fmt in FORMAT_PATTERNS:
                node = {**rest, "pattern": FORMAT_PATTERNS[fmt]}
        else:
            node = rest  # (an annotation)
    if "pattern" in node:
        beside = next((k for k in ("minLength", "maxLength") if k in node), None)
        if beside is not None:
            raise UnsupportedSchema(beside, path, "not enforced together with pattern")
    for key in ("anyOf", "oneOf", "allOf", "$ref"):  # xgrammar applies these alone: siblings are dropped
        if key in node:
            beside = sorted(set(node) - _ANNOTATIONS - {key})
            if beside:
                raise UnsupportedSchema(beside[0], path, f"not enforced beside {key}: move it into its schemas")
    if "enum" in node or "const" in node:
        node = _narrow_values(node, path)
    if isinstance(node.get("required"), list):
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in node["required"] if name not in props]
        if missing:
            raise UnsupportedSchema("required", path, f"{missing[0]!r} is not among its properties")
    if isinstance(node.get("oneOf"), list) and not _disjoint(node["oneOf"], root):
        raise UnsupportedSchema("oneOf", path, "its schemas may overlap and xgrammar enforces it as anyOf: "
                                "use anyOf, or tell them apart by type or by a required property's const")
    out = dict(node)
    for key in _SUB_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _prepare(sub, _pointer(path, key, name), root) for name, sub in node[key].items()}
    for key in _SUB_ONE:
        if key in node:
            out[key] = _prepare(node[key], _pointer(path, key), root)
    for key in _SUB_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_prepare(sub, _pointer(path, key, i), root) for i, sub in enumerate(node[key])]
    return out


_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _narrow_values(node: dict, path: str) -> dict:
    """An ``enum``/``const`` with its ``type`` (xgrammar ignores the type beside them): the values of that
    type only; any other validation keyword beside them is refused."""
    key = "const" if "const" in node else "enum"
    beside = sorted(set(node) - _ANNOTATIONS - {key, "type"})
    if beside:
        raise UnsupportedSchema(beside[0], path, f"not enforced beside {key}")
    types = node.get("type")
    if types is None:
        return node
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not all(t in _TYPES for t in types):
        return node  # (xgrammar refuses an unknown type itself)
    values = [node["const"]] if key == "const" else node[key] if isinstance(node[key], list) else None
    if values is None:
        return node
    kept = [v for v in values if any(_TYPES[t](v) for t in types)]
    if not kept:
        raise UnsupportedSchema(key, path, f"no value of it has type {node['type']}")
    rest = {k: v for k, v in node.items() if k not in (key, "type")}
    return {**rest, "enum": kept}


def _resolve(node: Any, root: Any) -> Any:
    """``node`` with local ``$ref``s followed (``#/$defs/X``)."""
    for _ in range(32):
        ref = node.get("$ref") if isinstance(node, dict) else None
        if not isinstance(ref, str) or not ref.startswith("#"):
            return node
        target = root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            target = target.get(part) if isinstance(target, dict) else None
        node = target
    return node


def _values(node: Any) -> set[str] | None:
    """The values ``node`` admits, as canonical JSON, if it lists them (``const``/``enum``)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return {json.dumps(node["const"], sort_keys=True)}
    if isinstance(node.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in node["enum"]}
    return None


def _apart(sets: list[set[str] | None]) -> bool:
    """No value in two of ``sets`` (each listed)."""
    if any(s is None for s in sets):
        return False
    return sum(map(len, sets)) == len(set().union(*sets))  # type: ignore[arg-type]


def _disjoint(branches: list, root: Any) -> bool:
    """Whether no value can match two of ``branches`` (so xgrammar's anyOf is oneOf exactly): they have
    different types (integer and number overlap), list disjoint values, or require a property whose
    listed values tell them apart (a discriminator)."""
    schemas = [_resolve(b, root) for b in branches]
    if not all(isinstance(s, dict) for s in schemas):
        return False
    types = [s.get("type") for s in schemas]
    if (all(isinstance(t, str) for t in types) and len(set(types)) == len(types)
            and not {"integer", "number"} <= set(types)):
        return True
    if _apart([_values(s) for s in schemas]):
        return True
    required = [set(s.get("required", ())) if isinstance(s.get("required"), list) else set() for s in schemas]
    for name in sorted(set.intersection(*required)) if required else ():
        props = [s.get("properties") if isinstance(s.get("properties"), dict) else {} for s in schemas]
        if _apart([_values(_resolve(p.get(name), root)) for p in props]):
            return True
    return False


def prepare_tag(node: Any) -> Any:
    """A structural tag with each of its JSON schemas prepared (``prepare_schema``)."""
    if isinstance(node, list):
        return [prepare_tag(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        return {**node, "json_schema": prepare_schema(node["json_schema"])}
    return {k: prepare_tag(v) for k, v in node.items()}
