"""vLLM's tokenizer endpoints of the router: ``/tokenize`` (a text, or a conversation through the chat
template as chat completions render it), ``/detokenize`` and ``/tokenizer_info`` (the tokenizer's special
tokens, chat template and context, which lm-evaluation-harness's ``local-completions`` reads when it is
given no ``tokenizer``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from epserve.router.errors import APIError, bad_request
from epserve.router.response_body import dumps
from epserve.router.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

if TYPE_CHECKING:
    from epserve.router.instances import Router
    from epserve.tokenizer import Tokenizer

INLINE_TOKENIZE_CHARS = 8 << 10  # longer texts are tokenized on a worker thread
INLINE_TOKENS = 8 << 10  # more token ids are decoded, or written in an answer, on a worker thread
_T = TypeVar("_T")


class TokenizerEndpoints:
    """The tokenizer endpoints of :class:`~epserve.router.app.OpenAIServer`, which gives what they use."""

    router: Router
    tokenizer: Tokenizer | None

    if TYPE_CHECKING:  # OpenAIServer's
        async def _parse(self, raw: Request, model: type[_T]) -> _T: ...
        async def _offload(self, heavy: bool, fn: Callable[..., _T], *args: Any) -> _T: ...
        async def _encode_chat(self, tokenizer: Tokenizer, req: Any, max_model_len: int | None,
                               add_special_tokens: bool = False) -> list[int]: ...
        def _need_tokenizer(self, what: str) -> Tokenizer: ...
        def _limits(self) -> tuple[int, int]: ...

    async def tokenize(self, raw: Request) -> Response:
        """``POST /tokenize``: a text (``prompt``) or a conversation (``messages``, through the chat
        template as chat completions are) to token ids. A long text's answer (its tokens, their strings,
        the JSON text) is built on the worker thread, as a long conversation's tokens and answer are."""
        req = await self._parse(raw, TokenizeCompletionRequest)  # (a body with messages: TokenizeChatRequest)
        tokenizer = self._need_tokenizer("/tokenize and /detokenize")
        max_model_len, _ = self._limits()

        def answer(tokens: list[int] | None) -> bytes:  # (None: the text's, tokenized here)
            if tokens is None:
                tokens = tokenizer.encode(req.prompt, req.add_special_tokens)
            body: dict[str, Any] = {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
            if req.return_token_strs:
                body["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
            return dumps(body)

        if isinstance(req, TokenizeChatRequest):
            tokens = await self._encode_chat(tokenizer, req, None, req.add_special_tokens)
            return _json(await self._offload(len(tokens) > INLINE_TOKENS, answer, tokens))
        # (a character is at most 4 tokens, its UTF-8 bytes: a short text's answer is small)
        return _json(await self._offload(len(req.prompt) > INLINE_TOKENIZE_CHARS, answer, None))

    async def detokenize(self, raw: Request) -> Response:
        """``POST /detokenize``: token ids to their text (special tokens included, as vLLM's); 400 for an
        id outside the tokenizer's vocabulary. Many ids are decoded (and the answer written) on the worker
        thread."""
        req = await self._parse(raw, DetokenizeRequest)
        tokenizer = self._need_tokenizer("/tokenize and /detokenize")

        def answer() -> bytes:
            vocab = tokenizer.vocab_size
            bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab})", "tokens")
            return dumps({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

        return _json(await self._offload(len(req.tokens) > INLINE_TOKENS, answer))

    async def tokenizer_info(self) -> JSONResponse:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's configuration as transformers reads it (its special
        tokens, chat template; ``model_max_length``: the served context once an engine has answered)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise APIError("this model directory has no tokenizer (send token ids)", 404, "invalid_request_error",
                           "not_found")
        info: dict[str, Any] = {k: v for k, v in tokenizer.config.items() if _plain(v)}
        info.update(tokenizer_class=info.get("tokenizer_class") or "PreTrainedTokenizerFast",
                    bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token, pad_token=tokenizer.pad_token,
                    add_bos_token=tokenizer.add_bos_token, chat_template=tokenizer.chat_template,
                    vocab_size=tokenizer.vocab_size)
        served = self.router.info
        if served is not None:
            info["model_max_length"] = served.max_model_len
        return JSONResponse(info)


def _json(body: bytes) -> Response:
    """An answer already written as JSON (``response_body.dumps``: the bytes JSONResponse would write)."""
    return Response(body, media_type="application/json")


def _plain(value: Any) -> bool:
    """A configuration value that is JSON as it stands (the added-token table's objects are left out)."""
    return isinstance(value, (str, int, float, bool)) or value is None
