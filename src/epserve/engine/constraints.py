"""Structured outputs as the engine and its step loop see them: the one seam to ``engine/structured.py``'s
compiler and matchers. The loop compiles a request's constraint off the loop (:meth:`Constraints.submit`,
stopped by :meth:`cancel` when the request goes away), then adds its grammar (:meth:`add`) or fails the
request; the engine checks that constraints can compile at all (:attr:`available`), hands a decode
instance's arrived first token to its grammar, aborts the requests whose constraint failed them
(:meth:`take_failures`) and releases finished ones; the sampling pipeline (``engine/sampling.py``) masks
each step's rows by their grammars and has the tokens it keeps accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from epserve.engine.grammars import CompileLimits
from epserve.engine.request import Request
from epserve.engine.structured import GrammarCompiler, GrammarMasks
from epserve.messages.sampling import StructuredOutput


def min_tokens_rows(requests: Sequence[Request], extras: Sequence[Sequence[int]] | None = None) -> set[int]:
    """The rows whose stop tokens and EOS ``min_tokens`` masks (``LogitsProcessor``'s rule: row ``r``
    follows ``requests[r]``'s outputs, then ``extras[r]``): there a grammar that can only end ends anyway
    (``GrammarMasks``)."""
    out = set()
    for r, request in enumerate(requests):
        params = request.sampling_params
        if params.min_tokens and not params.ignore_eos:
            if request.num_output_tokens + (len(extras[r]) if extras is not None else 0) < params.min_tokens:
                out.add(r)
    return out


class Constraints:
    """One engine's structured outputs: its compiler (every rank holds one; leaders use it) and the
    leader's matchers, one per constrained request."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 limits: CompileLimits | None = None) -> None:
        self.compiler = GrammarCompiler(model_path, vocab_size, eos_token_ids, limits=limits)
        self.masks = GrammarMasks(vocab_size, eos_token_ids)

    # ---- the step loop's and the engine's side ---------------------------------------------------
    @property
    def available(self) -> bool:
        """Whether constraints can compile (the checkpoint has its tokenizer)."""
        return self.compiler.available

    def submit(self, constraint: StructuredOutput) -> Future:
        """The compiled grammar, later, from the grammar worker (ValueError naming what does not compile
        or which bound of the compiler's it exceeds)."""
        return self.compiler.submit(constraint)

    def cancel(self, future: Future) -> None:
        """Stop a submitted compile (its request went away)."""
        self.compiler.cancel(future)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar now, on the caller's thread."""
        return self.compiler.compile(constraint)

    def add(self, request_id: str, grammar: Any) -> None:
        """The request's matcher, before it is queued: its every sampled row is masked from now on."""
        self.masks.add(request_id, grammar)

    def release(self, request_id: str) -> None:
        self.masks.release(request_id)

    def constrains(self, request_id: str) -> bool:
        return self.masks.constrains(request_id)

    @property
    def num_matchers(self) -> int:
        return self.masks.num_matchers

    def accept(self, request_id: str, tokens: Sequence[int]) -> bool:
        """The tokens the request keeps, in order (a step's, or a decode instance's arrived first token);
        False, with its failure recorded, where its grammar refuses one or its row had no token left."""
        return self.masks.accept(request_id, tokens)  # type: ignore[arg-type]

    def take_failures(self) -> dict[str, str]:
        """The requests whose constraint failed them since the last call, and why (the engine aborts them)."""
        return self.masks.take_failures()

    # ---- the sampling pipeline's side -----------------------------------------------------------
    def mask_groups(self, logits: torch.Tensor, raw: torch.Tensor, in_place: bool,
                    groups: Sequence[tuple[str, int, tuple[int, ...]]], requests: Sequence[Request],
                    extras: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[str]]:
        """A step's rows masked by their grammars: ``groups`` ``(request, first row, drafts)``, row
        ``first + j`` after the request's first ``j`` drafts; ``requests[r]``/``extras[r]`` what row ``r``
        follows. Returns the masked logits (a copy of ``raw`` when they were ``raw`` itself and ``raw``
        must stay as it is: not ``in_place``) and the constrained requests, whose kept tokens
        :meth:`accept` takes after the draw."""
        constrained = [rid for rid, _, _ in groups if self.masks.constrains(rid)]
        if constrained:
            if logits is raw and not in_place:
                logits = raw.clone()
            self.masks.apply_groups(logits, list(groups), min_tokens_rows(requests, extras))
        return logits, constrained

    def mask_drafts(self, logits: torch.Tensor, rows: Sequence[tuple[str, int, tuple[int, ...]]],
                    requests: Sequence[Request], extras: Sequence[Sequence[int]]) -> None:
        """MTP draft rows masked in place: ``(request, row, the drafts before it)`` (``GrammarMasks.apply_after``)."""
        self.masks.apply_after(logits, list(rows), min_tokens_rows(requests, extras))
