"""The fields OpenAI or vLLM define that this server does not implement: each refused by name (a 400
``unsupported_parameter`` saying why) unless it holds the value that means "off"."""

from __future__ import annotations

from typing import Any

from epserve.router.errors import bad_request
from epserve.router.protocol import AnyRequest

# Fields defined by OpenAI or vLLM that this server does not implement: the values that mean "off" (any
# other is a 400 naming the field), and why.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenAI's
    "suffix": ((None, ""), "no fill-in-the-middle"),
    "functions": ((None, []), "use tools"),
    "function_call": ((None, "none", "auto"), "use tool_choice"),
    "audio": ((None,), "text only"),
    "modalities": ((None, ["text"]), "text only"),
    "prediction": ((None,), "no predicted outputs"),
    "web_search_options": ((None,), "no web search"),
    "reasoning_effort": ((None,), "DeepSeek's thinking mode is chat_template_kwargs {\"thinking\": true}"),
    "verbosity": ((None,), "not implemented"),
    "store": ((None, False), "nothing is stored"),
    # vLLM's
    "allowed_token_ids": ((None,), "not implemented (logit_bias or a structured output instead)"),
    "use_beam_search": ((False,), "no beam search"),
    "length_penalty": ((1.0,), "it applies to beam search, which is not implemented"),
    "structural_tag": ((None,), "structured outputs: response_format, structured_outputs or guided_*"),
    "guided_decoding_backend": ((None, "auto", "xgrammar"), "structured outputs run on xgrammar only"),
    "guided_whitespace_pattern": ((None,), "not implemented"),
    "priority": ((0,), "no priority scheduling: requests are served first come, first served"),
    "logits_processors": ((None, []), "no custom logits processors"),
    "return_token_ids": ((False,), "not implemented (logprobs carry the token ids)"),
    "cache_salt": ((None,), "the prefix cache is shared by every request"),
    "kv_transfer_params": ((None,), "the engines pair prefill and decode themselves"),
    "vllm_xargs": ((None,), "not implemented"),
    "mm_processor_kwargs": ((None, {}), "text only"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
}
# Chat fields OpenAI and vLLM added since, refused the same way (kept apart: UNSUPPORTED's test lists its own).
UNSUPPORTED_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "moderation": ((None,), "no moderation"),
    "prompt_cache_options": ((None, {}), "the prefix cache is automatic: prompts sharing a prefix reuse its KV "
                             "blocks, with no options"),
    "prompt_cache_retention": ((None, "in_memory"), "cached prefixes stay in memory while there is room "
                               "(in_memory); none is kept for 24h"),
    "media_io_kwargs": ((None, {}), "text only"),
}


def check_unsupported(req: AnyRequest) -> None:
    for name, (off, why) in (*UNSUPPORTED.items(), *UNSUPPORTED_CHAT.items()):
        if name in type(req).model_fields and not any(_same(getattr(req, name), v) for v in off):
            raise bad_request(f"{name} is not supported by this server ({why})", name, "unsupported_parameter")


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
