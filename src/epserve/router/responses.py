"""OpenAI's Responses API (``POST /v1/responses``) on the chat completion path.

A request (:class:`ResponsesRequest`) becomes a chat completion request (:func:`chat_request`):
``instructions`` the first (system) message, ``input`` a text or a list of items (messages with text
parts, ``function_call`` items as the assistant's calls, ``function_call_output`` items as the tools'
answers), ``max_output_tokens`` its ``max_tokens``, its flat function tools the chat form. It is then
checked, rendered by the chat template, generated and parsed for tool calls as a chat completion is;
:func:`response_body` shapes the finished choice as a Response (a ``reasoning`` item, a ``message``
item, a ``function_call`` item per call), and ``responses_stream`` its streamed events.

Responses are not stored: ``previous_response_id`` (and ``conversation``) are refused with a 400 that
says to send the whole conversation as ``input``; ``store`` is accepted and nothing is kept. An error
found by the chat checks names the Responses field it came from (``max_output_tokens``, ``input``)."""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from epserve.router.errors import APIError, bad_request
from epserve.router.request_model import RequestModel

if TYPE_CHECKING:
    from epserve.router.generation import Generation

logger = logging.getLogger(__name__)

# Chat fields' errors as the Responses fields they came from.
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "logprobs": "top_logprobs",
           "response_format": "text.format"}
_ROLES = {"developer": "system"}  # (the chat templates know system, user, assistant, tool)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool | None = None  # accepted: nothing is stored
    text: Any = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Defined by OpenAI and accepted: they change nothing here (tags and hints for OpenAI's own service).
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: str | None = None  # "disabled" (a prompt past the context is a 400); "auto" refused
    # Defined by OpenAI, not implemented: a value other than "off" is refused (``_UNSUPPORTED``).
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    include: Any = None
    reasoning: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    stream_options: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None


_NOT_STORED = "responses are not stored here: send the whole conversation as input (its earlier turns as items)"
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "previous_response_id": ((None,), _NOT_STORED),
    "conversation": ((None,), _NOT_STORED),
    "background": ((None, False), "responses run in the foreground (stream them to see progress)"),
    "include": ((None, []), "no extra output data"),
    "reasoning": ((None,), "DeepSeek's thinking mode is its chat template's; see --reasoning-parser"),
    "prompt": ((None,), "no stored prompt templates: send instructions and input"),
    "max_tool_calls": ((None,), "not implemented"),
    "truncation": ((None, "disabled"), "a conversation past the context is refused, not truncated"),
    "stream_options": ((None, {}), "not implemented for responses"),
    "prompt_cache_retention": ((None, "in_memory"), "cached prefixes stay in memory while there is room"),
    "prompt_cache_options": ((None, {}), "the prefix cache is automatic, with no options"),
    "moderation": ((None,), "no moderation"),
}


def check_responses_request(req: ResponsesRequest) -> None:
    """400 naming the field for what the chat path cannot express (the rest it checks itself)."""
    for name, (off, why) in _UNSUPPORTED.items():
        value = getattr(req, name)
        if not any(type(value) is type(v) and value == v for v in off):
            code = "unsupported_parameter"
            raise bad_request(f"{name} is not supported by this server ({why})", name, code)
    if isinstance(req.input, list) and not req.input:
        raise bad_request("input must hold at least one item", "input")


def chat_request(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request body the Responses request stands for."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, f"input[{i}]")
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "metadata", "service_tier",
                 "prompt_cache_key", "safety_identifier"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.top_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    if req.tools:
        body["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None:
        body["response_format"] = _response_format(req.text)
    return body


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """One input item as chat messages: consecutive function calls join one assistant message."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object (a message or a function call item)", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{where}.role must be user, assistant, system or developer, got {role!r}", "input")
        messages.append({"role": _ROLES.get(role, role), "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
            last["tool_calls"].append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
    else:
        raise bad_request(f"{where}.type {kind!r} is not supported: input items are messages, function_call and "
                          "function_call_output", "input", "unsupported_value")


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.content[{j}] is {kind!r}: only text parts (input_text, output_text) are "
                              "supported", "input", "unsupported_value")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    return value


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """A Responses function tool (flat: name, parameters, strict) in the chat form (under ``function``)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"{where}: only function tools are supported, got type {kind!r}", where, "unsupported_value")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # none, auto, required (anything else: the chat check's 400)


def _response_format(text: Any) -> Any:
    """``text.format`` as chat's ``response_format`` (json_schema's fields sit flat in it)."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": schema}
    return fmt


def chat_error(err: APIError) -> APIError:
    """A chat check's error with the Responses field it came from as ``param``."""
    param, message = err.param, err.message
    if param is not None:
        head, _, rest = param.partition("[")
        if head in _PARAMS:
            param = _PARAMS[head] + (f"[{rest}" if rest else "")
            message = message.replace(head, _PARAMS[head], 1) if message.startswith(head) else message
        elif head == "tools":
            param = param.replace(".function", "")
            message = message.replace(err.param, param)  # type: ignore[arg-type]
    return APIError(message, err.status, err.type, err.code, param)


# ---- the response ---------------------------------------------------------------------------------
def new_ids() -> tuple[str, float]:
    """A response's id and creation time."""
    return f"resp_{uuid.uuid4().hex}", time.time()


def response_head(req: ResponsesRequest, response_id: str, created: float, model: str, status: str) -> dict[str, Any]:
    """The Response object's fields other than its output and usage."""
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "truncation": "disabled", "user": req.user, "output": [], "usage": None}


def usage(run: Generation) -> dict[str, Any]:
    chat = run.usage()
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def finished(head: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    """``head`` completed, or incomplete when the output ran into ``max_output_tokens`` (or the context)."""
    if finish_reason == "length":
        return {**head, "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    return {**head, "status": "completed", "completed_at": time.time()}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": "completed"}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def response_body(req: ResponsesRequest, run: Generation, response_id: str, created: float) -> dict[str, Any]:
    """The finished generation (one choice) as a Response."""
    choice = run.choices[0]
    output: list[dict[str, Any]] = []
    reasoning = "".join(choice.reasoning)
    if reasoning:
        output.append(reasoning_item(item_id("rs"), reasoning))
    text = "".join(choice.text)
    if text or not choice.tool_calls:
        output.append(message_item(item_id("msg"), text))
    for call in choice.tool_calls:
        output.append(call_item(item_id("fc"), call.id, call.name, call.arguments))
    head = response_head(req, response_id, created, run.ctx.model_name, "completed")
    return {**finished(head, choice.finish_reason), "output": output, "usage": usage(run)}
