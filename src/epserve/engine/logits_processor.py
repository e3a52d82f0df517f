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
is written into the slot's rows of device tables then, once: its ``logit_bias`` entries and single-token
bad words (always added), then its stop tokens (added below ``min_tokens`` only) in ``_entry_*``
[slots, E], and its three penalties in ``_params`` [slots, 3]. A step's host work is one pass over
the processed rows (a dict lookup, the row's slot and entry count, its new output and extra tokens),
handed to the device as one tensor of integers; the rest is gathered by slot, with flat indices
(``take``/``put_``): no Python loop over bias entries or stop tokens. Only bad words of two or more
tokens are matched on the host, for the requests that have them.

The penalties touch only the tokens a request has seen (its prompt's and its output's), so they are kept
sparse: a request with penalties lists its distinct seen tokens and their output counts in pages of
``PAGE`` columns of a shared pool (``_page_tokens``, ``_page_counts`` [pages, PAGE]; its pages in
``_page_table`` [slots, W]), extended at the output tokens appended since its last step (the host keeps
its token -> column map). A step gathers the penalized rows' entries end to end (their total length is
known on the host, so no device sync), penalizes the logits at those tokens and scatters them back:
work in the tokens seen, not in the vocabulary (a DeepSeek-V3 vocabulary is 129280 entries a row).
Rows without processing are untouched.

Memory bound: the pool holds each live penalized request's distinct seen tokens rounded up to a page
(at most ``vocab_size``, whatever the context length), and every table is at most four times what the
live requests need (slots, the widest entry list, the widest page list, the pages in use), with small
minimums: the tables double when full, and a release that leaves one more than four times too large
compacts all of them to twice the need (live slots and pages renumbered). So one 128k-token request
costs its own pages only while it lives, not a 128k-wide row for every slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from epserve.engine.request import Request

PAGE_BITS = 8
PAGE = 1 << PAGE_BITS  # seen-token columns per page of the pool
_MIN_SLOTS, _MIN_ENTRIES, _MIN_PAGES, _MIN_PAGE_COLUMNS = 4, 8, 4, 4
_NEG_INF = float("-inf")


@dataclass
class _State:
    """A tracked request: its slot, how many of its slot's entries a step adds, what the host matches."""

    slot: int
    num_always: int  # logit_bias and single-token bad words: always added
    num_stops: int  # then its stop tokens: added while the outputs are below min_tokens
    min_tokens: int
    words: tuple[tuple[int, ...], ...]  # bad words of two tokens or more
    penalized: bool
    columns: dict[int, int] = field(default_factory=dict)  # seen token -> its column
    pages: list[int] = field(default_factory=list)  # the pool pages holding its columns, in order
    counted: int = 0  # outputs counted in its pages


def _ragged(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``lengths`` [n] entries laid end to end (``total`` of them, known on the host): each
    entry's row and its offset in the row, [total] each. (A cumulative sum of row starts, not
    ``repeat_interleave``, which a CPU runs on every thread for a few thousand entries.)"""
    ends = lengths.cumsum(0)
    marks = torch.zeros(total + 1, dtype=torch.long, device=lengths.device)
    marks.index_add_(0, ends[:-1], torch.ones_like(ends[:-1]))  # a row starts at each end before the last
    rows = marks[:total].cumsum(0)
    return rows, torch.arange(total, device=lengths.device) - (ends - lengths).index_select(0, rows)


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        long = dict(dtype=torch.long, device=device)
        self._params = torch.zeros(0, 3, device=device)  # [slots, 3]: repetition, frequency, presence
        self._entry_tokens = torch.zeros(0, _MIN_ENTRIES, **long)  # [slots, E]
        self._entry_values = torch.zeros(0, _MIN_ENTRIES, device=device)  # [slots, E]: bias or -inf
        self._page_table = torch.zeros(0, _MIN_PAGE_COLUMNS, **long)  # [slots, W]: pool pages
        self._page_tokens = torch.zeros(0, PAGE, **long)  # [pages, PAGE]: seen token ids
        self._page_counts = torch.zeros(0, PAGE, device=device)  # [pages, PAGE]: their output counts
        self._states: dict[str, _State] = {}
        self._free_slots: list[int] = []
        self._free_pages: list[int] = []

    @property
    def num_tracked(self) -> int:
        """Requests holding a slot (those that process their logits, until released)."""
        return len(self._states)

    @property
    def memory_bytes(self) -> int:
        """Device bytes of every table (see the module docstring's bound)."""
        tables = (self._params, self._entry_tokens, self._entry_values, self._page_table, self._page_tokens,
                  self._page_counts)
        return sum(t.numel() * t.element_size() for t in tables)

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is None:
            return
        self._free_slots.append(state.slot)
        self._free_pages.extend(state.pages)
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
        # Host integers, sent as one tensor: entries (row, slot, count), matched bad words (row, token),
        # penalized rows (row, slot, seen count), their extra tokens (seen: entry, count; unseen: penalized
        # row, token, count), the new outputs (pool cells set: cell, token, count; added: cell, count)
        # and new pages (slot, page-table column, page).
        e_row: list[int] = []
        e_slot: list[int] = []
        e_len: list[int] = []
        w_row: list[int] = []
        w_tok: list[int] = []
        p_row: list[int] = []
        p_slot: list[int] = []
        p_len: list[int] = []
        x_at: list[int] = []
        x_cnt: list[int] = []
        n_row: list[int] = []
        n_tok: list[int] = []
        n_cnt: list[int] = []
        set_at: list[int] = []
        set_tok: list[int] = []
        set_cnt: list[int] = []
        add_at: list[int] = []
        add_cnt: list[int] = []
        pt_slot: list[int] = []
        pt_col: list[int] = []
        pt_page: list[int] = []
        seen_total = 0
        for r, state in zip(rows, states):
            request = requests[r]
            extra = extras[r] if extras is not None else ()
            outputs = request.output_token_ids
            n = state.num_always + (state.num_stops if len(outputs) + len(extra) < state.min_tokens else 0)
            if n:
                e_row.append(r), e_slot.append(state.slot), e_len.append(n)
            for word in state.words:  # its last token, where the output ends with the rest of it
                k = len(word) - 1
                if tuple((*outputs[-k:], *extra)[-k:]) == word[:-1]:
                    w_row.append(r), w_tok.append(word[-1])
            if not state.penalized:
                continue
            columns = state.columns
            if state.counted < len(outputs):  # outputs appended since its last step
                for token in outputs[state.counted :]:
                    col = columns.get(token)
                    if col is None:
                        col = columns[token] = len(columns)
                        if col == len(state.pages) * PAGE:
                            page = self._page()
                            if len(state.pages) == self._page_table.shape[1]:
                                self._widen_page_table(len(state.pages) + 1)
                            pt_slot.append(state.slot), pt_col.append(len(state.pages)), pt_page.append(page)
                            state.pages.append(page)
                        set_at.append(state.pages[col // PAGE] * PAGE + col % PAGE)
                        set_tok.append(token), set_cnt.append(1)
                    else:  # (after the cells set: a token new this step and repeated is set, then added)
                        add_at.append(state.pages[col // PAGE] * PAGE + col % PAGE), add_cnt.append(1)
                state.counted = len(outputs)
            i = len(p_row)
            p_row.append(r), p_slot.append(state.slot), p_len.append(len(columns))
            unseen: dict[int, int] = {}
            for token in extra:
                col = columns.get(token)
                if col is None:
                    unseen[token] = unseen.get(token, 0) + 1
                else:
                    x_at.append(seen_total + col), x_cnt.append(1)
            for token, count in unseen.items():
                n_row.append(i), n_tok.append(token), n_cnt.append(count)
            seen_total += len(columns)
        parts = (e_row, e_slot, e_len, w_row, w_tok, p_row, p_slot, p_len, x_at, x_cnt, n_row, n_tok, n_cnt,
                 set_at, set_tok, set_cnt, add_at, add_cnt, pt_slot, pt_col, pt_page)
        ints = [v for part in parts for v in part]
        host = torch.tensor(ints, dtype=torch.long, device=self.device).split([len(p) for p in parts])
        (e_row_t, e_slot_t, e_len_t, w_row_t, w_tok_t, p_row_t, p_slot_t, p_len_t, x_at_t, x_cnt_t, n_row_t,
         n_tok_t, n_cnt_t, set_at_t, set_tok_t, set_cnt_t, add_at_t, add_cnt_t, pt_slot_t, pt_col_t, pt_page_t) = host
        # Flat indices into contiguous tensors throughout, with index_select, index_copy_ and index_add_:
        # a CPU runs take, put_ and advanced indexing on every thread even for a few thousand entries
        # (milliseconds each when another process holds a core); on CUDA they are all one kernel.
        if pt_slot:
            self._page_table.view(-1).index_copy_(0, pt_slot_t * self._page_table.shape[1] + pt_col_t, pt_page_t)
        if set_at:
            self._page_tokens.view(-1).index_copy_(0, set_at_t, set_tok_t)
            self._page_counts.view(-1).index_copy_(0, set_at_t, set_cnt_t.to(self._page_counts.dtype))
        if add_at:
            self._page_counts.view(-1).index_add_(0, add_at_t, add_cnt_t.to(self._page_counts.dtype))
        vocab = logits.shape[1]
        flat = logits.view(-1)  # [R * V]
        # bad words, min_tokens and logit_bias: one scatter-add (-inf absorbs the bias where both meet)
        if e_row or w_row:
            entry, offset = _ragged(e_len_t, sum(e_len))
            cells = e_slot_t.index_select(0, entry) * self._entry_tokens.shape[1] + offset  # [A]
            index = e_row_t.index_select(0, entry) * vocab + self._entry_tokens.view(-1).index_select(0, cells)
            values = self._entry_values.view(-1).index_select(0, cells)
            if w_row:
                index = torch.cat([index, w_row_t * vocab + w_tok_t])
                values = torch.cat([values, torch.full((len(w_row),), _NEG_INF, device=self.device)])
            flat.index_add_(0, index, values.to(logits.dtype))
        # the penalties, on the biased logits at each penalized row's seen and extra tokens
        if p_row:
            entry, offset = _ragged(p_len_t, seen_total)
            slot = p_slot_t.index_select(0, entry)
            pages = self._page_table.view(-1).index_select(0, slot * self._page_table.shape[1] + (offset >> PAGE_BITS))
            cells = (pages << PAGE_BITS) + (offset & (PAGE - 1))
            tokens = self._page_tokens.view(-1).index_select(0, cells)  # [N]
            counts = self._page_counts.view(-1).index_select(0, cells)  # [N]
            if x_at:
                counts.index_add_(0, x_at_t, x_cnt_t.to(counts.dtype))
            if n_row:
                entry = torch.cat([entry, n_row_t])
                tokens = torch.cat([tokens, n_tok_t])
                counts = torch.cat([counts, n_cnt_t.to(counts.dtype)])
            c = self._params.index_select(0, slot if not n_row else p_slot_t.index_select(0, entry))  # [N, 3]
            c = c.to(logits.dtype)
            index = p_row_t.index_select(0, entry) * vocab + tokens  # distinct: a plain copy back
            x = flat.index_select(0, index)
            x = torch.where(x > 0, x / c[:, 0], x * c[:, 0])
            flat.index_copy_(0, index, x - c[:, 1] * counts - c[:, 2] * (counts > 0))
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
                always[word[0]] = _NEG_INF
        stops: list[int] = []
        if params.min_tokens:
            eos = () if params.ignore_eos else request.eos_token_ids
            stops = [t for t in dict.fromkeys((*params.stop_token_ids, *eos))
                     if t < self.vocab_size and always.get(t) != _NEG_INF]
        state = _State(slot, len(always), len(stops), params.min_tokens,
                       tuple(w for w in params.bad_words if len(w) > 1), params.has_penalties)
        n = len(always) + len(stops)
        if n:
            if n > self._entry_tokens.shape[1]:
                self._widen_entries(n)
            self._entry_tokens[slot, :n] = torch.tensor([*always, *stops], dtype=torch.long).to(self.device)
            self._entry_values[slot, :n] = torch.tensor([*always.values(), *[_NEG_INF] * len(stops)]).to(self.device)
        if state.penalized:
            p = params
            self._params[slot] = torch.tensor([p.repetition_penalty, p.frequency_penalty, p.presence_penalty],
                                              device=self.device)
            distinct = list(dict.fromkeys(request.prompt_token_ids))
            state.columns = dict(zip(distinct, range(len(distinct))))
            state.pages = [self._page() for _ in range(-(-len(distinct) // PAGE))]
            if state.pages:
                if len(state.pages) > self._page_table.shape[1]:
                    self._widen_page_table(len(state.pages))
                pages = torch.tensor(state.pages, dtype=torch.long).to(self.device)
                self._page_table[slot, : len(state.pages)] = pages
                cells = torch.zeros(len(state.pages) * PAGE, dtype=torch.long)
                cells[: len(distinct)] = torch.tensor(distinct, dtype=torch.long)
                self._page_tokens.index_copy_(0, pages, cells.view(-1, PAGE).to(self.device))
                self._page_counts.index_fill_(0, pages, 0)
        self._states[request.request_id] = state
        return state

    def _page(self) -> int:
        """A free page of the pool (grown when none is)."""
        if not self._free_pages:
            old = self._page_tokens.shape[0]
            new = max(2 * old, _MIN_PAGES)
            self._page_tokens = torch.cat([self._page_tokens, self._page_tokens.new_zeros(new - old, PAGE)])
            self._page_counts = torch.cat([self._page_counts, self._page_counts.new_zeros(new - old, PAGE)])
            self._free_pages.extend(range(new - 1, old - 1, -1))
        return self._free_pages.pop()

    def _grow_slots(self) -> int:
        old = self._params.shape[0]
        new = max(2 * old, _MIN_SLOTS)
        self._params, self._entry_tokens, self._entry_values, self._page_table = (
            torch.cat([t, t.new_zeros(new - old, t.shape[1])])
            for t in (self._params, self._entry_tokens, self._entry_values, self._page_table))
        self._free_slots.extend(range(new - 1, old, -1))
        return old

    def _widen_entries(self, needed: int) -> None:
        pad = max(needed, 2 * self._entry_tokens.shape[1]) - self._entry_tokens.shape[1]
        self._entry_tokens = torch.nn.functional.pad(self._entry_tokens, (0, pad))
        self._entry_values = torch.nn.functional.pad(self._entry_values, (0, pad))

    def _widen_page_table(self, needed: int) -> None:
        pad = max(needed, 2 * self._page_table.shape[1]) - self._page_table.shape[1]
        self._page_table = torch.nn.functional.pad(self._page_table, (0, pad))

    def _fit(self) -> None:
        """Compact every table to twice what the live requests need when one is over four times that."""
        live = list(self._states.values())
        need = (len(live), max((s.num_always + s.num_stops for s in live), default=0),
                max((len(s.pages) for s in live), default=0), sum(len(s.pages) for s in live))
        have = (self._params.shape[0], self._entry_tokens.shape[1], self._page_table.shape[1],
                self._page_tokens.shape[0])
        floor = (_MIN_SLOTS, _MIN_ENTRIES, _MIN_PAGE_COLUMNS, _MIN_PAGES)
        if all(h <= 4 * max(n, f) for h, n, f in zip(have, need, floor)):
            return
        slots_n, entries_n, columns_n, pages_n = (max(2 * n, f) for n, f in zip(need, floor))
        device = self.device
        old_slots = torch.tensor([s.slot for s in live], dtype=torch.long).to(device)
        old_pages = [p for s in live for p in s.pages]
        keep = len(live)
        params = self._params.new_zeros(slots_n, 3)
        params[:keep] = self._params.index_select(0, old_slots)
        entry_tokens = self._entry_tokens.new_zeros(slots_n, entries_n)
        entry_values = self._entry_values.new_zeros(slots_n, entries_n)
        width = min(entries_n, self._entry_tokens.shape[1])
        entry_tokens[:keep, :width] = self._entry_tokens.index_select(0, old_slots)[:, :width]
        entry_values[:keep, :width] = self._entry_values.index_select(0, old_slots)[:, :width]
        page_tokens = self._page_tokens.new_zeros(pages_n, PAGE)
        page_counts = self._page_counts.new_zeros(pages_n, PAGE)
        if old_pages:
            moved = torch.tensor(old_pages, dtype=torch.long).to(device)
            page_tokens[: len(old_pages)] = self._page_tokens.index_select(0, moved)
            page_counts[: len(old_pages)] = self._page_counts.index_select(0, moved)
        table = [[0] * columns_n for _ in live]
        first = 0
        for i, s in enumerate(live):
            s.slot = i
            s.pages = list(range(first, first + len(s.pages)))
            table[i][: len(s.pages)] = s.pages
            first += len(s.pages)
        page_table = self._page_table.new_zeros(slots_n, columns_n)
        if live:
            page_table[:keep] = torch.tensor(table, dtype=torch.long).to(device)
        self._params, self._entry_tokens, self._entry_values = params, entry_tokens, entry_values
        self._page_table, self._page_tokens, self._page_counts = page_table, page_tokens, page_counts
        self._free_slots = list(range(slots_n - 1, keep - 1, -1))
        self._free_pages = list(range(pages_n - 1, first - 1, -1))
