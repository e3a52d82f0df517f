"""The request body as a JSON object, refusing what would upset the parsers after it: nesting deeper
than ``MAX_JSON_DEPTH`` (``json`` and pydantic recurse) and lone UTF-16 surrogates (``"\\ud800"`` is
valid JSON but not text: no tokenizer takes it and no JSON encoder writes it back)."""

from __future__ import annotations

import json
import re
from typing import Any

from epserve.router.errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # OpenAI request bodies nest a handful of levels (tool schemas a few more)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how a surrogate gets into JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTAINERS = frozenset((dict, list))


def load_json_body(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 for anything else, for nesting deeper than
    ``MAX_JSON_DEPTH`` and for lone UTF-16 surrogates (``"\\ud800"``: not text, in any string or key)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise _too_deep("") from None
    except ValueError as e:  # bad JSON or UTF-8, an integer of more than 4300 digits
        raise APIError(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object", code="invalid_json")
    check_strings = _SURROGATE_ESCAPE.search(body) is not None  # (raw UTF-8 cannot hold a surrogate)
    todo: list[tuple[dict | list, str, int]] = [(data, "", 1)]
    while todo:
        node, where, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(where)
        if isinstance(node, list) and not check_strings and not _CONTAINERS.intersection(map(type, node)):
            continue  # a list of scalars (token ids): nothing to look at, at C speed
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            if check_strings and (_has_surrogate(key) or _has_surrogate(value)):
                path = _path(where, key).encode("utf-8", "backslashreplace").decode()
                raise bad_request(f"{path} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
                                  path, "invalid_unicode")
            if isinstance(value, (dict, list)):
                todo.append((value, _path(where, key), depth + 1))
    return data


def _has_surrogate(x: Any) -> bool:
    return isinstance(x, str) and _SURROGATE.search(x) is not None


def _path(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def _too_deep(where: str) -> APIError:
    field = re.match(r"[^.\[]*", where).group() or None  # type: ignore[union-attr]
    return bad_request(f"The request body nests JSON more than {MAX_JSON_DEPTH} levels deep", field, "invalid_json")
