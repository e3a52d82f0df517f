"""Logits processing before sampling: ``bad_words``, ``min_tokens``, ``logit_bias``, then the
repetition, frequency and presence penalties, in vLLM v1's order and with its definitions
(``SamplingParams``), batched on the logits' device.

Each row of a step's logits belongs to a request and may sit past tokens the request does not hold yet:
a verification row ``j`` follows the request's first ``j`` drafts, an MTP draft row follows this step's
sampled tokens and the drafts before it. Those ``extra`` tokens count as output, so the target and the
draft distributions are processed exactly as plain decoding would process the same position, and
rejection sampling stays exact.

Order (vLLM's sampler): the bad words' last tokens and, below ``min_tokens``, the stop tokens and EOS go
to -inf, ``logit_bias`` is added, and the penalties then act on those biased logits: a seen token's
logit is divided by ``repetition_penalty`` when positive and multiplied by it otherwise, then
``frequency_penalty`` times its output count and ``presence_penalty`` (when counted) are subtracted.

A request that processes its logits gets a slot when first seen; what it does not change step to step
is written into the slot's rows of device tables then, once (``logits_tables.RequestTables``: its
``logit_bias`` entries and single-token bad words, always added, then its stop tokens, added below
``min_tokens`` only, and its three penalties). The penalties touch only the tokens a request has seen,
kept sparse in a paged pool (``seen_tokens.SeenTokens``). A step's host work is one pass over the
processed rows (a dict lookup, the row's slot and entry count, its new output and extra tokens) that
fills three small named batches (``EntryBatch``, ``PoolUpdate``, ``PenaltyBatch``), handed to the device
together as one tensor of integers; the rest is gathered by slot, with flat indices: no Python loop over
bias entries or stop tokens. Only bad words of two or more tokens are matched on the host, for the
requests that have them. Rows without processing are untouched.

Memory bound: the pool holds each live penalized request's distinct seen tokens rounded up to a page
(at most ``vocab_size``, whatever the context length), and every table is at most four times what the
live requests need (slots, the widest entry list, the widest page list, the pages in use), with small
minimums: the tables double when full, and a release that leaves one more than four times too large
compacts all of them to twice the need (live slots and pages renumbered). So one 128k-token request
costs its own pages only while it lives, not a 128k-wide row for every slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from epserve.engine.logits_tables import NEG_INF, EntryBatch, RequestTables, send
from epserve.engine.request import Request
from epserve.engine.seen_tokens import (
    MIN_PAGE_COLUMNS,
    MIN_PAGES,
    PAGE,
    PenaltyBatch,
    PoolUpdate,
    SeenState,
    SeenTokens,
)

__all__ = ["PAGE", "LogitsProcessor"]

_MIN_SLOTS, _MIN_ENTRIES = 4, 8


@dataclass
class _State:
    """A tracked request: its slot, how many of its slot's entries a step adds, what the host matches."""

    slot: int
    num_always: int  # logit_bias and single-token bad words: always added
    num_stops: int  # then its stop tokens: added while the outputs are below min_tokens
    min_tokens: int
    words: tuple[tuple[int, ...], ...]  # bad words of two tokens or more
    penalized: bool
    seen: SeenState  # (empty unless penalized)


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.tables = RequestTables(device)
        self.seen = SeenTokens(device)
        self._states: dict[str, _State] = {}
        self._free_slots: list[int] = []

    @property
    def num_tracked(self) -> int:
        """Requests holding a slot (those that process their logits, until released)."""
        return len(self._states)

    @property
    def memory_bytes(self) -> int:
        """Device bytes of every table (see the module docstring's bound)."""
        return sum(t.numel() * t.element_size() for t in (*self.tables.tensors(), *self.seen.tensors()))

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            return
        self._free_slots.append(state.slot)
        self.seen.release(state.seen)
        self._fit()

    def apply(self, logits: torch.Tensor, requests: Sequence[Request],
              extras: Sequence[Sequence[int]] | None = None, in_place: bool = False) -> torch.Tensor:
        """``logits`` [R, V] (fp32): row ``r`` is ``requests[r]``'s next token after its outputs and then
        ``extras[r]`` (tokens not appended yet). Returns the processed logits: ``logits`` itself when no
        row asks for processing or ``in_place`` (the caller needs no unprocessed copy), else a new tensor."""
        rows: list[int] = []
        states: list[_State] = []
        for r, request in enumerate(requests):
            state = self._states.get(request.request_id)
            if state is None:
                if not request.sampling_params.processes_logits:
                    continue
                state = self._track(request)
            rows.append(r)
            states.append(state)
        if not rows:
            return logits
        out = logits
        if not in_place or not logits.is_contiguous():
            logits = logits.clone(memory_format=torch.contiguous_format)
        entries, update, penalties = EntryBatch(), PoolUpdate(), PenaltyBatch()
        seen_total = num_entries = 0
        for r, state in zip(rows, states):
            request = requests[r]
            extra = extras[r] if extras is not None else ()
            outputs = request.output_token_ids
            n = state.num_always + (state.num_stops if len(outputs) + len(extra) < state.min_tokens else 0)
            if n:
                entries.rows.append(r), entries.slots.append(state.slot), entries.counts.append(n)
                num_entries += n
            for word in state.words:  # its last token, where the output ends with the rest of it
                k = len(word) - 1
                if tuple((*outputs[-k:], *extra)[-k:]) == word[:-1]:
                    entries.word_rows.append(r), entries.word_tokens.append(word[-1])
            if not state.penalized:
                continue
            if state.seen.counted < len(outputs):  # outputs appended since its last step
                self.seen.count_outputs(state.seen, state.slot, outputs, update)
            self.seen.add_row(state.seen, r, state.slot, extra, seen_total, penalties)
            seen_total += len(state.seen.columns)
        entries_t, update_t, penalties_t = send([entries, update, penalties], self.device)  # one transfer
        self.seen.write(update_t, update)
        vocab = logits.shape[1]
        flat = logits.view(-1)  # [R * V]
        if entries.rows or entries.word_rows:  # bad words, min_tokens and logit_bias
            self.tables.add_entries(flat, vocab, entries_t, num_entries, len(entries.word_rows))
        if penalties.rows:  # the penalties, on the biased logits at each penalized row's seen and extra tokens
            self.seen.penalize(flat, vocab, self.tables.params, penalties_t, penalties, seen_total)
        if in_place and logits is not out:
            out.copy_(logits)
            return out
        return logits

    def _track(self, request: Request) -> _State:
        """A slot for a request seen for the first time, its constant rows written (and its prompt's
        distinct tokens, when it has penalties)."""
        params = request.sampling_params
        slot = self._free_slots.pop() if self._free_slots else self._grow_slots()
        always = dict(params.logit_bias)
        for word in params.bad_words:
            if len(word) == 1:
                always[word[0]] = NEG_INF
        stops: list[int] = []
        if params.min_tokens:
            eos = () if params.ignore_eos else request.eos_token_ids
            stops = [t for t in dict.fromkeys((*params.stop_token_ids, *eos))
                     if t < self.vocab_size and always.get(t) != NEG_INF]
        p = params
        penalized = p.has_penalties
        self.tables.write(slot, [*always, *stops], [*always.values(), *[NEG_INF] * len(stops)],
                          (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) if penalized else None)
        seen = self.seen.track(slot, request.prompt_token_ids) if penalized else SeenState()
        state = _State(slot, len(always), len(stops), params.min_tokens,
                       tuple(w for w in params.bad_words if len(w) > 1), penalized, seen)
        self._states[request.request_id] = state
        return state

    def _grow_slots(self) -> int:
        old = self.tables.num_slots
        new = max(2 * old, _MIN_SLOTS)
        self.tables.grow(new)
        self.seen.grow_slots(new)
        self._free_slots.extend(range(new - 1, old, -1))
        return old

    def _fit(self) -> None:
        """Compact every table to twice what the live requests need when one is over four times that."""
        live = list(self._states.values())
        need = (len(live), max((s.num_always + s.num_stops for s in live), default=0),
                max((len(s.seen.pages) for s in live), default=0), sum(len(s.seen.pages) for s in live))
        have = (self.tables.num_slots, self.tables.width, self.seen.page_table.shape[1],
                self.seen.page_tokens.shape[0])
        floor = (_MIN_SLOTS, _MIN_ENTRIES, MIN_PAGE_COLUMNS, MIN_PAGES)
        if all(h <= 4 * max(n, f) for h, n, f in zip(have, need, floor)):
            return
        slots_n, entries_n, columns_n, pages_n = (max(2 * n, f) for n, f in zip(need, floor))
        old_slots = torch.tensor([s.slot for s in live], dtype=torch.long).to(self.device)
        self.tables.compact(old_slots, slots_n, entries_n)
        self.seen.compact([s.seen for s in live], old_slots, slots_n, columns_n, pages_n)
        for i, s in enumerate(live):
            s.slot = i
        self._free_slots = list(range(slots_n - 1, len(live) - 1, -1))
