"""OpenAI-compatible request models of ``/v1/completions`` and ``/v1/chat/completions`` (their base, strict
parsing and the JSON schemas, in ``request_model``; their checks and their mapping onto the engine in
``checks``, errors in ``errors``, logprobs formatting in ``logprobs``).

Fields OpenAI or vLLM define that this server does not implement are declared, so that ``checks`` can
refuse them unless they hold the value that means "off"; fields they define that change nothing here
(tags and hints for OpenAI's own service) are declared and accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    ConfigDict,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from epserve.router.request_model import RequestModel, union_error

_STRICT = ConfigDict(strict=True)
_PROMPT_LISTS: dict[type, TypeAdapter] = {  # a prompt list's form, by its first item's type
    int: TypeAdapter(list[int], config=_STRICT),
    str: TypeAdapter(list[str], config=_STRICT),
    list: TypeAdapter(list[list[int]], config=_STRICT),
}


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage so far in every chunk
    include_obfuscation: bool = False  # OpenAI's: random padding in every chunk (hides the text's length)


class ContentPart(RequestModel):
    """One part of a chat message's content; only ``{"type": "text", "text": ...}`` is supported."""

    type: str
    text: str | None = None


class ToolCallFunction(RequestModel):
    name: str
    arguments: str


class MessageToolCall(RequestModel):
    """A call an assistant message made (OpenAI's ``tool_calls`` entries)."""

    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(RequestModel):
    role: str
    content: str | list[ContentPart] | None  # an assistant's may be left out: null (OpenAI's, beside tool_calls)
    name: str | None = None  # the participant's name: passed to the template, as vLLM does
    tool_calls: list[MessageToolCall] | None = None  # an assistant's (its content may then be null)
    tool_call_id: str | None = None  # a tool's answer to that call

    @model_validator(mode="before")
    @classmethod
    def _assistant_content_optional(cls, data: Any) -> Any:
        """An assistant message may leave ``content`` out (OpenAI's API: beside ``tool_calls``): null."""
        if isinstance(data, dict) and "content" not in data and data.get("role") == "assistant":
            data = {**data, "content": None}
        return data

    @field_validator("content", mode="wrap")
    @classmethod
    def _content_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list) or value is None:
            return handler(value)  # errors inside the list keep their locations
        return union_error(value, handler, "a string or a list of content parts")

    def text(self) -> str | None:
        """The content as one string (text parts joined with newlines); None when null."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _SamplingFields(RequestModel):
    """Fields that completions and chat completions share."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM)
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's form) -> bias
    min_tokens: int = 0  # extension (vLLM)
    prompt_logprobs: int | None = None  # extension (vLLM)
    bad_words: list[str] | None = None  # extension (vLLM): words never completed
    ignore_eos: bool = False  # extension
    include_stop_str_in_output: bool = False  # extension (vLLM): stop strings and stop tokens' text kept
    skip_special_tokens: bool = True  # extension (vLLM)
    spaces_between_special_tokens: bool = True  # extension (vLLM): no effect with a fast tokenizer (vLLM's too)
    truncate_prompt_tokens: int | None = None  # extension (vLLM): the prompt's last k tokens (-1: max_model_len)
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs' tokens as "token_id:<id>"
    request_id: str | None = None  # extension (vLLM): the response's id (after "cmpl-" / "chatcmpl-")
    user: str | None = None
    # Structured outputs (``tools.structured_output``): OpenAI's, and vLLM's older and newer forms.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    # Defined by vLLM, not implemented: a value other than "off" is refused (``unsupported.UNSUPPORTED``).
    allowed_token_ids: Any = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    structural_tag: Any = None
    guided_decoding_backend: Any = None  # None, "auto" or "xgrammar" (the one here) are accepted
    guided_whitespace_pattern: Any = None
    priority: int = 0
    logits_processors: Any = None
    return_token_ids: bool = False
    cache_salt: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None
    mm_processor_kwargs: Any = None

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, list):
            return handler(value)
        return union_error(value, handler, "a string, a list of strings or null")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # 0..20
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt tokens' too)
    best_of: int | None = None  # only equal to n: the n choices are the n best of n
    add_special_tokens: bool = True  # extension (vLLM): a text prompt starts with bos
    suffix: Any = None  # not supported
    top_logprobs: Any = None  # chat's field: refused here by name (completions take logprobs: N)
    prompt_embeds: Any = None  # vLLM's, not supported

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_type(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        expected = "a string, a list of strings, a list of token ids or a list of token id lists"
        # A list is validated as the one form its first item allows: trying the union's members in turn
        # would build an error for every item of each member that fails (half a second for 1M token ids).
        adapter = _PROMPT_LISTS.get(type(value[0])) if isinstance(value, list) and value else None
        if adapter is None:
            return union_error(value, handler, expected)
        try:
            return adapter.validate_python(value)
        except ValidationError:
            raise PydanticCustomError("type_error", "Input should be {expected}", {"expected": expected}) from None


class ChatFields(RequestModel):
    """A conversation and how the chat template renders it (chat completions, ``/tokenize``)."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True  # extension (vLLM)
    continue_final_message: bool = False  # extension (vLLM): the last (assistant) message is left open
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM): more variables for the template
    chat_template: str | None = None  # vLLM's per-request template: refused (the server's applies)
    tools: Any = None  # the functions, for templates that describe them (DeepSeek-V3.1's)

    def message_dicts(self) -> list[dict[str, Any]]:
        """``[{"role", "content", ...}]`` for the tokenizer's chat template, text parts joined (a
        message's ``name``, an assistant's ``tool_calls``, a tool's ``tool_call_id`` kept)."""
        return [m.template_dict() for m in self.messages]

    def template_variables(self) -> dict[str, Any]:
        """The template's variables beyond the conversation: ``tools`` (and a chat request's
        ``documents``) when given, under the request's ``chat_template_kwargs``."""
        variables = {k: v for k in ("tools", "documents") if (v := getattr(self, k, None))}
        return {**variables, **(self.chat_template_kwargs or {})}

    def template_options(self) -> dict[str, Any]:
        """Keywords of ``Tokenizer.encode_chat``: continuing the final message adds no generation prompt."""
        return {"add_generation_prompt": self.generation_prompt(),
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.template_variables() or None}

    def generation_prompt(self) -> bool:
        """Whether the template adds the assistant's generation prompt (not when continuing its message)."""
        return self.add_generation_prompt and not self.continue_final_message


class ChatCompletionRequest(_SamplingFields, ChatFields):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # wins over max_tokens when both are given
    logprobs: bool = False
    top_logprobs: int | None = None  # 0..20, needs logprobs=true
    tool_choice: Any = None  # (``tools``: ChatFields)
    add_special_tokens: bool = False  # extension (vLLM): the tokenizer's special tokens on top of the template's
    echo: bool = False  # extension (vLLM): the final message's content first, when it is the assistant's
    documents: Any = None  # extension (vLLM): a template variable (retrieval-augmented templates)
    include_reasoning: bool = True  # extension (vLLM): with a reasoning parser, false drops reasoning_content
    # Defined by OpenAI, not implemented: a value other than "off" is refused (``unsupported.UNSUPPORTED``).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None  # "in_memory" is how the prefix cache keeps prompts: accepted
    media_io_kwargs: Any = None  # vLLM's
    best_of: int | None = None  # only equal to n (as completions')
    parallel_tool_calls: bool | None = None  # false: at most one call (``router/tools``)
    # Defined by OpenAI and accepted: they change nothing here (tags and hints for OpenAI's own service).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def echoed(self) -> str:
        """What ``echo`` puts before the output: the final message's text, when the output continues that
        role's turn (the assistant's, or any without a generation prompt), as vLLM's chat echo."""
        last = self.messages[-1]
        return (last.text() or "") if self.echo and (last.role == "assistant" or not self.generation_prompt()) else ""


AnyRequest = CompletionRequest | ChatCompletionRequest
