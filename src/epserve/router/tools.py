"""A request's output constraint: its own structured output (``structured_output``: OpenAI's
``response_format``, vLLM's ``structured_outputs`` and ``guided_*``), or a forced tool call, resolved
for chat in ``chat_constraint``; and tools in chat completions: ``tools`` and ``tool_choice`` checked,
what the server does with them (``ToolMode``: the parser that reads calls out of the output, and for
``required`` or a named function the constraint that forces a well-formed call), as vLLM does with
``--tool-call-parser`` and ``--enable-auto-tool-choice``.

``auto`` lets the model choose; the output is parsed for calls in the checkpoint's format
(``tool_calls``). ``required`` and a named function constrain the output to one call block, in that
format, whose arguments follow the function's parameter schema (an xgrammar structural tag, compiled by
the engine), so the arguments always parse; DeepSeek's markers in it are tokens, the single added tokens
the model writes (``literal``). ``none`` (and no tools) leaves the output alone; the tools
still reach the chat template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from epserve.messages.sampling import StructuredOutput
from epserve.router.errors import bad_request
from epserve.router.protocol import AnyRequest, ChatCompletionRequest
from epserve.router.reasoning import THINK_END
from epserve.router.tool_calls import MARKERS, TOOL_CALL_PARSERS


@dataclass(frozen=True)
class ToolMode:
    """What a request's tools make the server do: parse calls with ``parser``; force one with
    ``constraint``."""

    parser: str | None = None
    constraint: StructuredOutput | None = None


MAX_TOOLS = 128  # OpenAI's limit on a request's tools
# OpenAI's rule for a function's name (DeepSeek's markers, or anything else a forced call's format would
# read as its own, cannot appear in one)
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    """The functions of ``tools`` by name, their form checked: ``[{"type": "function", "function":
    {"name", "description"?, "parameters"?, "strict"?}}]``, at most ``MAX_TOOLS``, each name matching
    ``TOOL_NAME``."""
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", "tools")
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(name, str) \
                or not name or name in out:
            raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}} with a name of "
                              "its own", "tools")
        if not TOOL_NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and - "
                              f"(^[a-zA-Z0-9_-]{{1,64}}$), not {name[:80]!r}", f"tools[{i}].function.name")
        parameters = function.get("parameters", {"type": "object"})  # type: ignore[union-attr]
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[name] = parameters
    return out


def check_tools(tools: Any, tool_choice: Any) -> None:
    """The form of ``tools`` and ``tool_choice`` (what the server can do with them: ``tool_mode``)."""
    functions = _functions(tools) if tools is not None else {}
    _chosen(tool_choice, functions)


def _chosen(tool_choice: Any, functions: dict[str, dict[str, Any]]) -> str:
    """``none``, ``auto``, ``required`` or the named function's name."""
    if tool_choice is None:
        return "auto" if functions else "none"
    if tool_choice in ("none", "auto", "required"):
        if tool_choice == "required" and not functions:
            raise bad_request("tool_choice required needs tools", "tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":  # type: ignore[union-attr]
        raise bad_request("tool_choice must be none, auto, required or {type: function, function: {name}}",
                          "tool_choice")
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return "\0" + name  # (a name, not a mode)


MAX_FORCED_CALLS = 4  # tool_choice required with parallel_tool_calls: a block of 1 to this many calls


def tool_mode(tools: Any, tool_choice: Any, parser: str | None, auto_enabled: bool,
              parallel: bool = True) -> ToolMode:
    """What the server does with a request's tools, given ``--tool-call-parser`` (``parser``) and
    ``--enable-auto-tool-choice``; a 400 for what it cannot do. ``parallel``: ``parallel_tool_calls``
    (``required`` may then make several calls)."""
    functions = _functions(tools) if tools is not None else {}
    chosen = _chosen(tool_choice, functions)
    if chosen == "none" or not functions:
        return ToolMode()
    if parser is None:
        raise bad_request("tool calls need the server started with --tool-call-parser (deepseek_v3 or "
                          "deepseek_v31)", "tools")
    if chosen == "auto":
        if not auto_enabled:
            raise bad_request('"auto" tool choice requires the server started with --enable-auto-tool-choice '
                              "and --tool-call-parser", "tool_choice")
        return ToolMode(parser)
    names = list(functions) if chosen == "required" else [chosen[1:]]
    most = MAX_FORCED_CALLS if chosen == "required" and parallel else 1
    return ToolMode(parser, StructuredOutput("structural_tag",
                                             json.dumps(forced_call(parser, names, functions, most))))


_MARKER_SPLIT = re.compile("(" + "|".join(map(re.escape, MARKERS)) + ")")


def literal(text: str) -> list[dict[str, Any]]:
    """``text`` as structural-tag elements: each of DeepSeek's markers a token (the engine makes it the
    vocabulary's single added token for it, as the model writes it, not a spelling of its bytes), the
    text between them strings."""
    return [{"type": "token", "token": part} if part in MARKERS else {"type": "const_string", "value": part}
            for part in _MARKER_SPLIT.split(text) if part]


def forced_call(parser: str, names: list[str], functions: dict[str, dict[str, Any]], most: int = 1) -> dict[str, Any]:
    """An xgrammar structural tag for one call block in ``parser``'s format: 1 to ``most`` calls, each of
    one of ``names``, its arguments following the function's parameter schema; the markers as tokens
    (``literal``)."""
    layout = TOOL_CALL_PARSERS[parser]()
    calls = [{"type": "sequence", "elements": [*literal(layout.call_prefix(name)),
                                               {"type": "json_schema", "json_schema": functions[name]},
                                               *literal(layout.call_suffix())]}
             for name in names]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    separator = literal(layout.call_separator)
    blocks = []
    for n in range(1, most + 1):
        body = [call] + [e for _ in range(n - 1) for e in (*separator, call)]
        blocks.append({"type": "sequence", "elements": [*literal(layout.block_begin), *body,
                                                        *literal(layout.block_end)]})
    return {"type": "structural_tag", "format": blocks[0] if most == 1 else {"type": "or", "elements": blocks}}


def after_reasoning(constraint: StructuredOutput, think_end: str) -> StructuredOutput:
    """``constraint`` applied to the answer only: any text up to ``think_end`` (the reasoning), then the
    constraint (an xgrammar structural tag)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "structural_tag":
        answer = json.loads(spec)["format"]
    elif kind in ("json_schema", "json_object"):
        answer = {"type": "json_schema", "json_schema": json.loads(spec) if spec else {"type": "object"}}
    elif kind == "regex":
        answer = {"type": "regex", "pattern": spec}
    elif kind == "choice":  # (strings, not an EBNF grammar: no escaping to get wrong)
        answer = {"type": "or", "elements": [{"type": "const_string", "value": c} for c in json.loads(spec)]}
    else:
        answer = {"type": "grammar", "grammar": spec}
    thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": think_end}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [thinking, answer]}}
    return StructuredOutput("structural_tag", json.dumps(tag))


def structured_output(req: AnyRequest) -> StructuredOutput | None:
    """The request's output constraint, from whichever of OpenAI's ``response_format`` and vLLM's
    ``structured_outputs`` / ``guided_*`` fields it uses (at most one); None when unconstrained. Only
    the form is checked here: whether a schema, regex or grammar compiles, the engine says (a 400)."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format json_schema needs json_schema.schema, a JSON schema object",
                                  "response_format")
            found.append(("response_format", StructuredOutput("json_schema", json.dumps(schema))))
        elif kind != "text":
            raise bad_request("response_format.type must be text, json_object or json_schema", "response_format")
    vllm = {f"guided_{k}": getattr(req, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
    if req.structured_outputs is not None:
        if not isinstance(req.structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        for key, value in req.structured_outputs.items():
            if key not in ("json", "regex", "choice", "grammar", "json_object"):
                raise bad_request(f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                                  "json_object)", "structured_outputs")
            if key == "json_object":
                if value is True:
                    found.append(("structured_outputs", StructuredOutput("json_object")))
            elif value is not None:
                vllm[f"structured_outputs.{key}"] = value
    for name, value in vllm.items():
        if value is None:
            continue
        kind = name.rpartition("_")[2].rpartition(".")[2]
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError:
                    raise bad_request(f"{name} is not valid JSON", name) from None
            if not isinstance(value, dict):
                raise bad_request(f"{name} must be a JSON schema object", name)
            found.append((name, StructuredOutput("json_schema", json.dumps(value))))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise bad_request(f"{name} must be a non-empty list of non-empty strings", name)
            found.append((name, StructuredOutput("choice", json.dumps(value))))
        else:
            if not isinstance(value, str) or not value:
                raise bad_request(f"{name} must be a non-empty string", name)
            found.append((name, StructuredOutput(kind, value)))
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not {' and '.join(n for n, _ in found)}", found[1][0])
    return found[0][1] if found else None


def chat_constraint(req: AnyRequest, tool_call_parser: str | None, auto_tools: bool,
                    in_reasoning: bool) -> tuple[ToolMode, StructuredOutput | None]:
    """What a request's tools make the server do (``tools.tool_mode``) and the constraint its output
    follows: a forced tool call's or the request's own structured output (not both: a 400), applied
    after the reasoning when the output starts inside it (``in_reasoning``)."""
    if not isinstance(req, ChatCompletionRequest):
        return ToolMode(), structured_output(req)
    mode = tool_mode(req.tools, req.tool_choice, tool_call_parser, auto_tools, req.parallel_tool_calls is not False)
    constraint = structured_output(req)
    if mode.constraint is not None and constraint is not None:
        raise bad_request("a forced tool call (tool_choice required or a named function) is a constraint of its "
                          "own: drop response_format or the structured-output fields", "tool_choice")
    constraint = mode.constraint or constraint
    if constraint is not None and in_reasoning:  # the answer is constrained, not the reasoning before it
        constraint = after_reasoning(constraint, THINK_END)
    return mode, constraint
