"""Structured outputs with xgrammar: a request's constraint (``StructuredOutput``) compiled into a
grammar, one matcher per constrained request on the leader that samples, and each step's token bitmask
applied to the constrained rows' logits before sampling.

Compiling happens off the step loop (``GrammarCompiler.submit``, on its own thread; xgrammar caches
compiled grammars by their text), so a request waits for its grammar without holding others back: the
loop queues it once it compiled (``engine/loop.py``), and a constraint that does not compile fails its
request as invalid, naming the problem. The matcher allows EOS only where the grammar can end, and
advances on every token the request keeps; it lives until the request finishes (a preemption recomputes
the KV, not the tokens, so the matcher stays right). With MTP, verification row ``j`` is masked by the
grammar after the first ``j`` drafts (accepted tentatively, then rolled back): a draft the grammar
refuses has probability 0 there and is rejected, so the output is exactly plain decoding's; the MTP
draft rows are masked likewise (``apply_after``), so the drafts follow the grammar too.

xgrammar (and through it transformers) is imported on first use: engines that never see a constraint
do not pay for it.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from epserve.messages.sampling import StructuredOutput

logger = logging.getLogger(__name__)


def _choice_grammar(spec: str) -> str:
    """One of the strings of the JSON list ``spec``, as an EBNF grammar of literals."""
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar's rule for the characters of a length-bounded JSON string admits control characters, which
# JSON forbids unescaped (its unbounded string rule excludes them): the same class, without them.
_ANY_SPACE = "[ \\n\\r\\t]*"
_LOOSE_CHARS, _JSON_CHARS = '[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\\\r\\n]'


def _json_schema_grammar(spec: str) -> str:
    """The EBNF grammar of JSON schema ``spec`` (compact separators, OpenAI ``strict`` semantics: no
    properties or items beyond the schema's), its strings free of control characters."""
    import xgrammar as xgr

    return _tidy(str(xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)))


def _tidy(ebnf: str) -> str:
    """``ebnf`` with JSON's strings free of control characters and no optional whitespace between its
    tokens (a grammar that admits any run of it lets a model pad until ``max_tokens``)."""
    return ebnf.replace(_LOOSE_CHARS, _JSON_CHARS).replace(_ANY_SPACE, '""')


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and vocabulary, on a thread of its own."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._compiler: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epserve-grammar")

    @property
    def available(self) -> bool:
        return (self.model_path / "tokenizer.json").is_file()

    def submit(self, constraint: StructuredOutput) -> Future:
        """The compiled grammar, later (the future raises ValueError naming what does not compile)."""
        return self._pool.submit(self.compile, constraint)

    def compile(self, constraint: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == "json_object":  # any JSON object (OpenAI's json_object: an object, not any value)
                kind, spec = "json_schema", '{"type": "object"}'
            if kind == "json_schema":
                json.loads(spec)  # (a clearer message than the converter's for text that is not JSON)
                return compiler.compile_grammar(_json_schema_grammar(spec))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec))
            if kind == "structural_tag":
                import xgrammar as xgr

                return compiler.compile_grammar(_tidy(str(xgr.Grammar.from_structural_tag(spec))))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as e:  # xgrammar's errors are RuntimeErrors with a C++ location
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"the {kind} constraint does not compile: {message.split(': ', 1)[-1]}") from None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.model_path / "tokenizer.json"))
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=list(self.eos_token_ids))
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            logger.info("structured outputs: xgrammar compiler ready (%s vocabulary, %d entries)",
                        info.vocab_type.name.lower(), self.vocab_size)
        return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarMasks:
    """The leader's matchers, one per constrained request, and the per-step bitmask."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None

    def add(self, request_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        # (-1: unbounded rollback, for the drafts a verification tries tentatively)
        self._matchers[request_id] = xgr.GrammarMatcher(grammar, max_rollback_tokens=-1)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def constrains(self, request_id: str) -> bool:
        return request_id in self._matchers

    def apply(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """Mask, in place, what each constrained row's grammar does not allow next (rows of other
        requests untouched): the bitmask is filled on the host, applied on the logits' device."""
        self.apply_groups(logits, [(rid, r, ()) for r, rid in enumerate(request_ids)])

    def apply_groups(self, logits: torch.Tensor, groups: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """The same for a verification's rows: ``(request, first row, drafts)``, rows ``first + j`` follow
        the request's first ``j`` drafts. Each row's mask is its grammar after those drafts (accepted
        tentatively, then rolled back); rows after a draft the grammar refuses are left as they are (that
        draft has probability 0 under its masked row, so verification stops there)."""
        groups = [g for g in groups if g[0] in self._matchers]
        if not groups:
            return
        bitmask = self._buffer(logits.shape[0])
        rows = []
        for rid, first, drafts in groups:
            matcher, tried = self._matchers[rid], 0
            for j in range(len(drafts) + 1):
                self._fill(matcher, bitmask, first + j)
                rows.append(first + j)
                if j == len(drafts) or matcher.is_terminated() or not matcher.accept_token(drafts[j]):
                    break
                tried += 1
            if tried:
                matcher.rollback(tried)
        self._mask(logits, bitmask, rows)

    def apply_after(self, logits: torch.Tensor, rows: list[tuple[str, int, tuple[int, ...]]]) -> None:
        """Mask row ``row`` by the request's grammar after ``tokens`` it does not hold yet (an MTP draft row:
        the drafts before it), accepted tentatively and rolled back; a row whose tokens the grammar
        refuses is left as it is."""
        rows = [r for r in rows if r[0] in self._matchers]
        if not rows:
            return
        bitmask = self._buffer(logits.shape[0])
        masked = []
        for rid, row, tokens in rows:
            matcher, tried = self._matchers[rid], 0
            for token in tokens:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                tried += 1
            if tried == len(tokens):
                self._fill(matcher, bitmask, row)
                masked.append(row)
            if tried:
                matcher.rollback(tried)
        if masked:
            self._mask(logits, bitmask, masked)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The host bitmask for ``num_rows`` rows (grown as needed, kept between steps)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]

    @staticmethod
    def _mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """The filled ``rows`` of ``bitmask`` applied to the logits, on their device."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)

    def _fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        if matcher.is_terminated():  # complete (a request that ignores EOS goes on): EOS only
            bitmask[row] = 0
            for t in self.eos_token_ids:
                bit = 1 << (t % 32)
                bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # (an int32 word)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, request_id: str, tokens: list[int]) -> None:
        """The tokens the request keeps, in order (a matcher that refuses one is a bug: it was masked)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for token in tokens:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(token):
                raise RuntimeError(f"request {request_id!r}: token {token} breaks its grammar")
