"""vLLM's ``/tokenize`` and ``/detokenize`` request models and their checks (the endpoints: ``app``).

``POST /tokenize`` takes a text (``TokenizeCompletionRequest``: ``prompt``, bos first unless
``add_special_tokens`` is false) or a conversation (``TokenizeChatRequest``: ``messages`` rendered by
the chat template exactly as chat completions render them, with the same options, ``tools`` too) and answers
``{"count", "max_model_len", "tokens"}`` (and ``"token_strs"`` with ``return_token_strs``).
``POST /detokenize`` takes ``tokens`` and answers ``{"prompt"}``, special tokens included.
"""

from __future__ import annotations

from typing import Any

from epserve.router.checks import check_chat_fields
from epserve.router.errors import bad_request
from epserve.router.protocol import ChatFields, RequestModel
from epserve.router.tools import check_tools


class TokenizeCompletionRequest(RequestModel):
    """``POST /tokenize`` of a text (vLLM's request)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # bos first, as a completion's prompt gets it
    return_token_strs: bool = False  # also each token as the vocabulary spells it


class TokenizeChatRequest(ChatFields):
    """``POST /tokenize`` of a conversation (vLLM's request): rendered as chat completions render it."""

    model: str | None = None
    add_special_tokens: bool = False  # the tokenizer's special tokens on top of what the template adds
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    """``POST /detokenize`` (vLLM's request)."""

    model: str | None = None
    tokens: list[int]


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest
REQUEST_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)  # for the OpenAPI document


def tokenize_request_model(data: Any) -> type[TokenizeCompletionRequest] | type[TokenizeChatRequest]:
    """Which ``/tokenize`` request a JSON body is: one with ``messages`` is a conversation."""
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


def check_tokenize_request(req: TokenizeRequest | DetokenizeRequest) -> None:
    """``check_request`` for ``/tokenize`` and ``/detokenize``: the conversation's checks, a prompt that
    is not empty (token ids are checked against the vocabulary by the endpoint)."""
    if isinstance(req, TokenizeChatRequest):
        check_tools(req.tools, None)
        check_chat_fields(req)
    elif isinstance(req, TokenizeCompletionRequest) and not req.prompt:
        raise bad_request("prompt must not be empty", "prompt")
