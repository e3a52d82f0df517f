"""What a parsed OpenAI request may hold, and what it asks the engine.

``check_request`` checks value ranges (also what the engine's gRPC fields can hold: ``top_k`` int32,
``top_p`` float32, token ids and counts uint32, ``seed`` int64), bounds what would make the router's
work large (``logit_bias`` entries, a schema's nesting) and refuses the fields this server does not
implement (``unsupported``); ``resolve_max_tokens`` fits the completion into the model's context, and
``to_sampling_params`` maps a request onto the engine's ``SamplingParams`` (the checkpoint's generation
defaults filling what it leaves unset). Every problem is raised as an ``APIError`` whose ``body()`` is
the OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

from epserve.chat_template import RESERVED_TEMPLATE_VARIABLES
from epserve.messages.sampling import (
    MAX_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    SamplingParams,
    StructuredOutput,
)
from epserve.router.errors import bad_request, context_length_exceeded
from epserve.router.generation_defaults import GenerationDefaults
from epserve.router.json_body import MAX_JSON_DEPTH
from epserve.router.protocol import AnyRequest, ChatCompletionRequest, ChatFields, CompletionRequest
from epserve.router.request_model import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
    UINT32_MAX,
)
from epserve.router.tools import check_tools, structured_output
from epserve.router.unsupported import check_unsupported


def _check_range(value: float, lo: float, hi: float, param: str, lo_open: bool = False) -> None:
    ok = (lo < value if lo_open else lo <= value) and value <= hi  # NaN fails both
    if not ok:
        lo_bracket = "(" if lo_open else "["
        raise bad_request(f"{param} must be in {lo_bracket}{lo:g}, {hi:g}], got {value!r}", param)


def check_request(req: AnyRequest) -> None:
    """Raise ``APIError(400)`` for values out of range and options this server does not support."""
    _check_range(req.n, 1, MAX_N, "n")
    _check_range(req.temperature, 0, MAX_TEMPERATURE, "temperature")
    _check_range(req.top_p, 0, 1, "top_p", lo_open=True)
    if struct.unpack("f", struct.pack("f", req.top_p))[0] == 0:  # the engine's field is a float32
        raise bad_request(f"top_p must be in (0, 1], got {req.top_p!r} (0 as a 32-bit float)", "top_p")
    if not -1 <= req.top_k <= INT32_MAX:
        raise bad_request(
            f"top_k must be -1 or 0 (disabled) or a positive integer up to {INT32_MAX}, got {req.top_k}", "top_k"
        )
    _check_range(req.min_p, 0, 1, "min_p")
    if req.seed is not None and not INT64_MIN <= req.seed <= INT64_MAX:
        raise bad_request(f"seed must be a 64-bit signed integer, in [{INT64_MIN}, {INT64_MAX}]", "seed")
    for name in ("presence_penalty", "frequency_penalty"):
        _check_range(getattr(req, name), -MAX_PENALTY, MAX_PENALTY, name)
    _check_range(req.repetition_penalty, 0, MAX_REPETITION_PENALTY, "repetition_penalty", lo_open=True)
    logit_bias(req)  # its keys and values
    if not 0 <= req.min_tokens <= UINT32_MAX:
        raise bad_request(f"min_tokens must be in [0, {UINT32_MAX}], got {req.min_tokens}", "min_tokens")
    if req.prompt_logprobs is not None:
        _check_range(req.prompt_logprobs, 0, MAX_LOGPROBS, "prompt_logprobs")
    words = req.bad_words or []
    if len(words) > MAX_BAD_WORDS or any(not w.strip() or len(w) > MAX_BAD_WORD_CHARS for w in words):
        raise bad_request(f"bad_words may hold at most {MAX_BAD_WORDS} words, each with a non-space character and "
                          f"at most {MAX_BAD_WORD_CHARS} characters", "bad_words")
    if req.truncate_prompt_tokens is not None and not (req.truncate_prompt_tokens == -1
                                                       or 1 <= req.truncate_prompt_tokens <= UINT32_MAX):
        raise bad_request(f"truncate_prompt_tokens must be -1 (the model's context) or in [1, {UINT32_MAX}], got "
                          f"{req.truncate_prompt_tokens}", "truncate_prompt_tokens")
    if req.request_id is not None and not 0 < len(req.request_id) <= MAX_REQUEST_ID_CHARS:
        raise bad_request(f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters", "request_id")
    check_unsupported(req)
    _check_schema_texts(req)
    structured_output(req)  # its form
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    if req.stop_token_ids and any(not 0 <= t <= UINT32_MAX for t in req.stop_token_ids):
        raise bad_request(f"stop_token_ids must be token ids in [0, {UINT32_MAX}]", "stop_token_ids")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, CompletionRequest):
        _check_completion(req)
    else:
        _check_chat(req)


def _check_max_tokens(value: int | None, param: str, least: int = 1) -> None:
    if value is not None and not least <= value <= UINT32_MAX:
        raise bad_request(f"{param} must be in [{least}, {UINT32_MAX}], got {value}", param)


MAX_BAD_WORDS, MAX_BAD_WORD_CHARS = 256, 256  # (tokenized on the event loop: bounded)

MAX_REQUEST_ID_CHARS = 256


def logit_bias(req: AnyRequest) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: keys are token ids written as strings (OpenAI's form);
    at most ``MAX_LOGIT_BIAS`` of them."""
    if len(req.logit_bias or ()) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(req.logit_bias)}",
                          "logit_bias")
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) > UINT32_MAX:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:32]!r}", "logit_bias")
        _check_range(bias, -MAX_BIAS, MAX_BIAS, f"logit_bias[{key!r}]")
        pairs.append((int(key), float(bias)))
    if len({t for t, _ in pairs}) != len(pairs):
        raise bad_request("logit_bias names a token id twice", "logit_bias")
    return tuple(pairs)


def _check_schema_texts(req: AnyRequest) -> None:
    """A JSON schema given as JSON text (``guided_json``, ``structured_outputs.json``) nests no deeper
    than a request body may (``MAX_JSON_DEPTH``): ``json`` recurses, and the grammar compiler after it."""
    outputs = req.structured_outputs if isinstance(req.structured_outputs, dict) else {}
    for name, text in (("guided_json", req.guided_json), ("structured_outputs.json", outputs.get("json"))):
        if not isinstance(text, str):
            continue
        try:
            todo: list[tuple[Any, int]] = [(json.loads(text), 1)]
        except RecursionError:
            todo = [(None, MAX_JSON_DEPTH + 1)]
        except ValueError:
            continue  # (structured_output says it is not JSON)
        while todo:
            node, depth = todo.pop()
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"{name} nests JSON more than {MAX_JSON_DEPTH} levels deep", name)
            if isinstance(node, (dict, list)):
                todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                            if isinstance(child, (dict, list)))


def _check_completion(req: CompletionRequest) -> None:
    _check_max_tokens(req.max_tokens, "max_tokens", least=0)  # 0: the prompt only (with echo, its logprobs)
    if req.logprobs is not None:
        _check_range(req.logprobs, 0, MAX_LOGPROBS, "logprobs")
    _check_best_of(req)
    if req.top_logprobs is not None:
        raise bad_request("top_logprobs is chat completions' field: completions take logprobs (a count: that many "
                          "most likely tokens at each position)", "top_logprobs", "unsupported_parameter")
    prompt = req.prompt
    if isinstance(prompt, str) or not prompt:
        prompts: list[Any] = [prompt]
    elif isinstance(prompt[0], int):
        prompts = [prompt]  # one prompt given as token ids
    else:
        prompts = list(prompt)
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if len(p) == 0:
            raise bad_request(f"{where} must not be empty", "prompt")
        if not isinstance(p, str) and any(t < 0 for t in p):
            raise bad_request(f"{where} holds a negative token id", "prompt")


def _check_chat(req: ChatCompletionRequest) -> None:
    _check_max_tokens(req.max_tokens, "max_tokens")
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        _check_range(req.top_logprobs, 0, MAX_LOGPROBS, "top_logprobs")
    check_tools(req.tools, req.tool_choice)
    _check_strict_tools(req)
    _check_best_of(req)
    if req.documents is not None and not (isinstance(req.documents, list)
                                          and all(isinstance(d, dict) for d in req.documents)):
        raise bad_request("documents must be a list of objects (the chat template's documents)", "documents")
    check_chat_fields(req)


def _check_best_of(req: AnyRequest) -> None:
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) when given: this server returns every choice it "
                          f"generates, got best_of={req.best_of}", "best_of", "unsupported_value")


def _check_strict_tools(req: ChatCompletionRequest) -> None:
    """``strict`` holds for a forced call (its grammar is the schema); under ``tool_choice`` auto nothing
    constrains the model's arguments, so ``strict: true`` there is refused rather than left unenforced."""
    if req.tool_choice not in (None, "auto") or not isinstance(req.tools, list):
        return
    for i, tool in enumerate(req.tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("strict") is True:
            raise bad_request(f"tools[{i}].function.strict: under tool_choice auto the arguments the model writes "
                              "are not constrained; strict schemas hold for forced calls (tool_choice required or "
                              "a named function): force the call or drop strict", f"tools[{i}].function.strict",
                              "unsupported_value")


def check_chat_fields(req: ChatFields) -> None:
    """The conversation's checks (chat completions, ``/tokenize``): content parts, template options."""
    if not req.messages:
        raise bad_request("messages must hold at least one message", "messages")
    for i, m in enumerate(req.messages):
        if m.content is None or isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise bad_request(
                    f"{where}.type is {part.type!r}: only text content is supported",
                    f"{where}.type",
                    "unsupported_value",
                )
            if part.text is None:
                raise bad_request(f"{where} has type 'text' but no text", f"{where}.text")
    if req.chat_template is not None:
        raise bad_request("chat_template is not accepted in a request: the server's chat template applies "
                          "(start it with --chat-template to choose another)", "chat_template", "unsupported_value")
    if req.continue_final_message:
        if req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
            raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise bad_request(f"continue_final_message needs the last message to be the assistant's, not the "
                              f"{req.messages[-1].role}'s", "continue_final_message")
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(req.chat_template_kwargs or ()))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the request's own field does",
                          "chat_template_kwargs")


def resolve_max_tokens(req: AnyRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """How many tokens to generate: as requested (completions default 16; chat ``max_completion_tokens``
    over ``max_tokens``), else whatever room the context leaves. Raises ``context_length_exceeded``.
    ``req`` has passed ``check_request`` (which refuses a requested count below 1, or below 0 for
    completions: 0 asks for the prompt alone)."""
    if isinstance(req, ChatCompletionRequest):
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prompt_param = "messages"
    else:
        requested, param, prompt_param = req.max_tokens, "max_tokens", "prompt"
    if num_prompt_tokens >= max_model_len:
        raise context_length_exceeded(max_model_len, num_prompt_tokens, requested, prompt_param)
    if requested is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise context_length_exceeded(max_model_len, num_prompt_tokens, requested, param)
    return requested


def _wrap_int64(x: int) -> int:
    return (x - INT64_MIN) % 2**64 + INT64_MIN


def to_sampling_params(req: AnyRequest, max_tokens: int, index: int = 0,
                       defaults: GenerationDefaults | None = None,
                       bad_words: tuple[tuple[int, ...], ...] = (),
                       structured: StructuredOutput | None = None,
                       bias: tuple[tuple[int, float], ...] | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for choice ``index`` of ``req`` (its seed is ``seed + index``);
    ``defaults`` (the checkpoint's ``generation_config.json``) fill the sampling fields it did not set;
    ``bad_words``: the request's, tokenized (``bad_words_token_ids``); ``structured``: a constraint the
    server adds (a forced tool call), instead of the request's own; ``bias``: ``logit_bias(req)``, when the
    caller has it (one request's choices share it)."""
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest) and index:  # a chat's body shows the first choice's only
        prompt_logprobs = None
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)  # echo shows the prompt tokens' logprobs
    sampling = {"temperature": float(req.temperature), "top_k": req.top_k, "top_p": float(req.top_p),
                "min_p": float(req.min_p), "repetition_penalty": float(req.repetition_penalty)}
    stop_ids = tuple(req.stop_token_ids or ())
    if defaults is not None:
        sampling = defaults.fill(req.model_fields_set, sampling)
        if not req.ignore_eos:  # the file's EOS ids stop generation like the model's own
            stop_ids += tuple(t for t in defaults.eos_token_ids if t not in stop_ids)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            **sampling,
            seed=None if req.seed is None else _wrap_int64(req.seed + index),
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=float(req.presence_penalty),
            frequency_penalty=float(req.frequency_penalty),
            logit_bias=logit_bias(req) if bias is None else bias,
            min_tokens=req.min_tokens,
            prompt_logprobs=prompt_logprobs,
            bad_words=bad_words,
            structured=structured or structured_output(req),
        )
    except ValueError as e:
        raise bad_request(str(e)) from None


def stop_strings(req: AnyRequest) -> list[str]:
    """``stop`` as a list: ``[]``, ``[s]`` or the given list."""
    if req.stop is None:
        return []
    if isinstance(req.stop, str):
        return [req.stop]
    return list(req.stop)


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token id sequences, as vLLM tokenizes them: each word as written (leading spaces
    dropped) and with one leading space, when that is a different token sequence of the same length
    (the word's spelling after another word)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return tuple(out)


def truncated_length(req: AnyRequest, max_model_len: int) -> int:
    """How many of a prompt's last tokens ``truncate_prompt_tokens`` keeps (-1: the model's context); a
    400 past the context, as vLLM's."""
    keep = req.truncate_prompt_tokens
    if keep is None or keep == -1:
        return max_model_len
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({max_model_len})",
                          "truncate_prompt_tokens")
    return keep


def choices_cost(req: AnyRequest, prompts: list[list[int]]) -> int:
    """What building a request's choices costs (``app.OpenAIServer._generation``), roughly in the units of
    ``response_body.LARGE_COST``: its prompts' tokens scanned, and each choice's engine parameters checked."""
    tools = len(req.tools) * 64 if isinstance(getattr(req, "tools", None), list) else 0
    per_choice = 1 + len(req.logit_bias or ()) + sum(map(len, req.bad_words or ()))
    return sum(map(len, prompts)) + len(prompts) * req.n * per_choice + tools
