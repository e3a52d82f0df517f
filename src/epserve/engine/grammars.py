"""What a structured-output constraint compiles to, and the bounds checked before xgrammar sees it.

``compile_constraint`` turns a ``StructuredOutput`` into xgrammar's compiled grammar with a compiler
made by ``load_compiler`` (a JSON schema through ``engine/json_schema.py``, a ``choice`` as literals, a
structural tag with DeepSeek's markers as their added tokens). It runs in the grammar worker's compile
processes (``engine/grammar_worker.py``) for a serving engine, and on the caller's thread offline.

``check_bounds`` refuses, cheaply and before any parsing that recurses, what is larger than a compile
may take (``CompileLimits``): a spec over ``max_spec_bytes``, JSON nested deeper than ``max_nesting``,
a regular expression (a ``regex`` constraint, a schema's ``pattern`` or ``patternProperties``, a
structural tag's regex) whose groups nest deeper than ``max_nesting`` (xgrammar's converters recurse
once per level and overflow the C++ stack at some tens of thousands).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epserve.engine.json_schema import UnsupportedSchema, prepare_schema, prepare_tag


@dataclass(frozen=True)
class CompileLimits:
    """What one constraint's compile may take: its spec's size and nesting (checked before compiling),
    and, where it compiles in the grammar worker, its time and memory (beyond the worker's own) and how
    many compile at once."""

    max_spec_bytes: int = 8 << 20
    max_nesting: int = 128
    time_limit_s: float = 30.0
    memory_limit_mib: int = 4096
    parallel: int = 2


def check_bounds(kind: str, spec: str, limits: CompileLimits) -> None:
    """ValueError naming the bound ``kind``/``spec`` exceeds (see the module's docstring)."""
    size = len(spec.encode())
    if size > limits.max_spec_bytes:
        raise ValueError(f"the {kind} constraint is {size} bytes; a constraint may have at most "
                         f"{limits.max_spec_bytes}")
    if kind == "regex":
        _check_regex(spec, limits.max_nesting, "the regex")
    elif kind in ("json_schema", "structural_tag", "choice"):
        depth = json_depth(spec)
        if depth > limits.max_nesting:
            raise ValueError(f"the {kind} constraint nests {depth} levels deep; at most {limits.max_nesting} "
                             "are allowed")
        if kind != "choice":
            try:
                tree = json.loads(spec)
            except ValueError:
                return  # (the compile names it)
            for where, pattern in _regexes(tree):
                _check_regex(pattern, limits.max_nesting, f"the pattern at {where}")


def json_depth(text: str) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest (scanned, not parsed: no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def regex_depth(pattern: str) -> int:
    """How deeply the groups of regular expression ``pattern`` nest (escapes and character classes
    skipped)."""
    depth = deepest = 0
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch == ")":
            depth = max(depth - 1, 0)
        i += 1
    return deepest


def _check_regex(pattern: str, most: int, what: str) -> None:
    depth = regex_depth(pattern)
    if depth > most:
        raise ValueError(f"{what} nests its groups {depth} levels deep; at most {most} are allowed")


def _regexes(node: Any) -> list[tuple[str, str]]:
    """The regular expressions in a JSON schema or a structural tag, with where they sit: every
    ``pattern`` string (a schema's, a tag's ``regex``) and ``patternProperties`` key. A plain walk over
    the whole document (its depth is bounded before)."""
    found: list[tuple[str, str]] = []
    stack = [(node, "#")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, list):
            stack.extend((v, f"{where}/{i}") for i, v in enumerate(item))
            continue
        if not isinstance(item, dict):
            continue
        pattern = item.get("pattern")
        if isinstance(pattern, str):
            found.append((where, pattern))
        if isinstance(item.get("patternProperties"), dict):
            found.extend((f"{where}/patternProperties", key) for key in item["patternProperties"])
        stack.extend((v, f"{where}/{k}") for k, v in item.items())
    return found


# ---- compiling -----------------------------------------------------------------------------------
def _choice_grammar(spec: str) -> str:
    """One of the strings of the JSON list ``spec``, as an EBNF grammar of literals. Characters beyond
    ASCII are written as themselves (UTF-8): xgrammar reads an escaped surrogate pair, JSON's spelling
    of a character past U+FFFF, as two characters, whose bytes (CESU-8) are not UTF-8."""
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _resolve_tokens(node: Any, added: dict[str, int], vocab_size: int) -> Any:
    """A structural tag with each ``{"type": "token", "token": TEXT}`` made the id of the added token
    spelled ``TEXT`` (DeepSeek's tool-call markers: the model writes each as one token), or, where the
    vocabulary has no such token below ``vocab_size``, the string ``TEXT`` (spelled by any tokens)."""
    if isinstance(node, list):
        return [_resolve_tokens(n, added, vocab_size) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "token" and isinstance(node.get("token"), str):
        token_id = added.get(node["token"])
        if token_id is not None and token_id < vocab_size:
            return {"type": "token", "token": token_id}
        return {"type": "const_string", "value": node["token"]}
    return {k: _resolve_tokens(v, added, vocab_size) for k, v in node.items()}


# xgrammar's rule for the characters of a length-bounded JSON string admits control characters, which
# JSON forbids unescaped (its unbounded string rule excludes them): the same class, without them.
_ANY_SPACE = "[ \\n\\r\\t]*"
_LOOSE_CHARS, _JSON_CHARS = '[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _json_schema_grammar(spec: str) -> str:
    """The EBNF grammar of JSON schema ``spec`` (compact separators, OpenAI ``strict`` semantics: no
    properties or items beyond the schema's), its strings free of control characters; UnsupportedSchema
    for what it would not enforce (``prepare_schema``)."""
    import xgrammar as xgr

    schema = json.dumps(prepare_schema(json.loads(spec)))
    return _tidy(str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)))


def _tidy(ebnf: str) -> str:
    """``ebnf`` with JSON's strings free of control characters and no optional whitespace between its
    tokens (a grammar that admits any run of it lets a model pad until ``max_tokens``)."""
    return ebnf.replace(_LOOSE_CHARS, _JSON_CHARS).replace(_ANY_SPACE, '""')


def load_compiler(model_path: str | Path, vocab_size: int,
                  eos_token_ids: tuple[int, ...]) -> tuple[Any, dict[str, int], Any]:
    """xgrammar's compiler for the checkpoint's tokenizer and ``vocab_size``, the tokenizer's added tokens
    (their text: their id), and xgrammar's tokenizer info the compiler holds."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
    # (no cache of xgrammar's own, unbounded by default: the engine's, bounded, is kept instead)
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), dict(tokenizer.get_added_vocab()), info


def constraint_grammar(added: dict[str, int], vocab_size: int, kind: str, spec: str) -> str:
    """The EBNF grammar of constraint ``kind``/``spec`` as xgrammar's compiler reads it (``added``: the
    tokenizer's added tokens, for a structural tag's markers); ValueError naming what does not convert or
    would not be enforced."""
    import xgrammar as xgr

    with _named_errors(kind):
        if kind == "json_object":  # any JSON object (OpenAI's json_object: an object, not any value)
            kind, spec = "json_schema", '{"type": "object"}'
        if kind == "json_schema":
            json.loads(spec)  # (a clearer message than the converter's for text that is not JSON)
            return _json_schema_grammar(spec)
        if kind == "regex":
            return str(xgr.Grammar.from_regex(spec))
        if kind == "choice":
            return _choice_grammar(spec)
        if kind == "structural_tag":
            tag = json.dumps(_resolve_tokens(prepare_tag(json.loads(spec)), added, vocab_size))
            return _tidy(str(xgr.Grammar.from_structural_tag(tag)))
        return spec


def compile_grammar(compiler: Any, kind: str, ebnf: str) -> Any:
    """EBNF grammar ``ebnf`` (of a ``kind`` constraint) compiled; ValueError naming what does not compile."""
    with _named_errors(kind):
        return compiler.compile_grammar(ebnf)


def compile_constraint(compiler: Any, added: dict[str, int], vocab_size: int, kind: str, spec: str) -> Any:
    """The compiled grammar of constraint ``kind``/``spec``; ValueError naming what does not compile or
    would not be enforced."""
    return compile_grammar(compiler, "json_schema" if kind == "json_object" else kind,
                           constraint_grammar(added, vocab_size, kind, spec))


@contextmanager
def _named_errors(kind: str) -> Iterator[None]:
    """xgrammar's and the converters' errors as ValueErrors naming the ``kind`` constraint."""
    try:
        yield
    except UnsupportedSchema as e:
        raise ValueError(f"the {kind} constraint asks what the grammar would not enforce: {e}") from None
    except RecursionError:
        raise ValueError(f"the {kind} constraint nests too deeply") from None
    except (RuntimeError, ValueError) as e:  # xgrammar's errors are RuntimeErrors with a C++ location
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"the {kind} constraint does not compile: {message.split(': ', 1)[-1]}") from None
