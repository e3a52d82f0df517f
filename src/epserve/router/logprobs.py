"""Logprobs in the OpenAI response formats (completions and chat)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

# Logprobs are JSON numbers, and JSON has no -inf: clamp to this (vLLM and OpenAI do the same).
MIN_LOGPROB = -9999.0

class _Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


LogprobEntry = Any  # (logprob, [(token_id, logprob), ...]) or an object with .logprob and .top


def _unpack(entry: LogprobEntry) -> tuple[float | None, Sequence[tuple[int, float]]]:
    if entry is None:
        return None, ()
    if hasattr(entry, "logprob"):
        return entry.logprob, getattr(entry, "top", ())
    lp, top = entry
    return lp, top or ()


def _clamp(lp: float | None) -> float | None:
    if lp is None:
        return None
    lp = float(lp)
    return MIN_LOGPROB if math.isnan(lp) or lp < MIN_LOGPROB else lp


def completion_logprobs(
    tokenizer: _Tokenizer,
    token_ids: Sequence[int],
    logprobs: Sequence[LogprobEntry],
    text_offset: int,
    skip_special_tokens: bool = True,
    as_ids: bool = False,
) -> dict[str, list[Any]]:
    """The ``choices[i].logprobs`` object of ``/v1/completions``.

    ``text_offset[i]`` is where token ``i``'s text starts in the completion text (decoded with
    ``skip_special_tokens``), counting from ``text_offset``; a token that ends inside a multi-byte
    character shares the offset of the character it belongs to. Token strings are decoded one by
    one with special tokens kept; ``top_logprobs[i]`` maps the ``k`` top token strings to their
    logprobs (of two ids with the same string, the higher logprob is kept). ``as_ids``: tokens written
    ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``).
    """
    from epserve.router.detokenize import IncrementalDetokenizer

    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for tid, entry in zip(token_ids, logprobs):
        offsets.append(text_offset + len(detok.text))
        detok.add([tid])
        tokens.append(_token(tokenizer, tid, as_ids))
        lp, top = _unpack(entry)
        token_logprobs.append(_clamp(lp))
        if entry is None:
            top_logprobs.append(None)
            continue
        tops: dict[str, float] = {}
        for top_id, top_lp in top:
            s = _token(tokenizer, top_id, as_ids)
            value = _clamp(top_lp)
            if s not in tops or value > tops[s]:
                tops[s] = value
        top_logprobs.append(tops)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _token(tokenizer: _Tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as logprobs name it: its text, special tokens kept (``as_id``: ``token_id:<id>``)."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_token(tokenizer: _Tokenizer, token_id: int, logprob: float | None, as_id: bool = False) -> dict[str, Any]:
    s = _token(tokenizer, token_id, as_id)
    return {"token": s, "logprob": _clamp(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(
    tokenizer: _Tokenizer, token_ids: Sequence[int], logprobs: Sequence[LogprobEntry], as_ids: bool = False
) -> list[dict[str, Any]]:
    """The ``choices[i].logprobs.content`` list of ``/v1/chat/completions``:
    ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]``."""
    out = []
    for tid, entry in zip(token_ids, logprobs):
        lp, top = _unpack(entry)
        item = _chat_token(tokenizer, tid, lp, as_ids)
        item["top_logprobs"] = [_chat_token(tokenizer, t, t_lp, as_ids) for t, t_lp in top]
        out.append(item)
    return out


def prompt_logprobs(tokenizer: _Tokenizer | None, prompt_ids: Sequence[int],
                    entries: Sequence[LogprobEntry] | None) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
    ``{id: {"logprob", "rank", "decoded_token"}}`` for it and the top ones (``rank`` 1 is the most
    likely; the prompt token's own rank is given when it is among the top)."""
    out: list[dict[str, Any] | None] = []
    for token, entry in zip(prompt_ids, entries or ()):
        if entry is None:
            out.append(None)
            continue
        lp, top = _unpack(entry)
        ranks = {t: r for r, (t, _) in enumerate(top, start=1)}
        row = {str(t): _logprob_object(tokenizer, t, v, r) for r, (t, v) in enumerate(top, start=1)}
        row[str(token)] = _logprob_object(tokenizer, token, lp, ranks.get(token))
        out.append(row)
    return out


def _logprob_object(tokenizer: _Tokenizer | None, token: int, logprob: float | None,
                    rank: int | None) -> dict[str, Any]:
    decoded = tokenizer.decode([token], skip_special_tokens=False) if tokenizer is not None else None
    return {"logprob": _clamp(logprob), "rank": rank, "decoded_token": decoded}
