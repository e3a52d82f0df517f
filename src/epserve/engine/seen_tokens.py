"""The tokens each penalized request has seen, for the logits processor's penalties
(``logits_processor.py``), kept sparse: a request lists its distinct seen tokens (its prompt's and its
output's) and their output counts in pages of ``PAGE`` columns of a shared pool (``page_tokens``,
``page_counts`` [pages, PAGE]; its pages in ``page_table`` [slots, W]), extended at the output tokens
appended since its last step (the host keeps its token -> column map). A step gathers the penalized
rows' entries end to end (their total length is known on the host, so no device sync), penalizes the
logits at those tokens and scatters them back: work in the tokens seen, not in the vocabulary (a
DeepSeek-V3 vocabulary is 129280 entries a row).

Each step builds two named batches of host integers: :class:`PoolUpdate` (the cells the new outputs set
or add to, the new pages) and :class:`PenaltyBatch` (the penalized rows, their extra tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from epserve.engine.logits_tables import HostBatch, ragged

PAGE_BITS = 8
PAGE = 1 << PAGE_BITS  # seen-token columns per page of the pool
MIN_PAGES, MIN_PAGE_COLUMNS = 4, 4


@dataclass
class SeenState:
    """A penalized request's seen tokens: token -> column, the pool pages holding its columns in order,
    and how many of its outputs they count."""

    columns: dict[int, int] = field(default_factory=dict)
    pages: list[int] = field(default_factory=list)
    counted: int = 0


@dataclass
class PoolUpdate(HostBatch):
    """The pool's cells the outputs appended since the last step set (a new token: its id, count 1) or
    add to (a token seen before), and the pages they opened (slot, page-table column, page)."""

    set_cells: list = field(default_factory=list)
    set_tokens: list = field(default_factory=list)
    set_counts: list = field(default_factory=list)
    add_cells: list = field(default_factory=list)
    add_counts: list = field(default_factory=list)
    table_slots: list = field(default_factory=list)
    table_columns: list = field(default_factory=list)
    table_pages: list = field(default_factory=list)


@dataclass
class PenaltyBatch(HostBatch):
    """The penalized rows (row, slot, seen tokens); the row's extra tokens it has seen (the entry, end to
    end over the rows, and a count each) and those it has not (the penalized row's index, token, count)."""

    rows: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    lengths: list = field(default_factory=list)
    seen_at: list = field(default_factory=list)
    seen_counts: list = field(default_factory=list)
    new_rows: list = field(default_factory=list)
    new_tokens: list = field(default_factory=list)
    new_counts: list = field(default_factory=list)


class SeenTokens:
    """The pool and the page table (rows by the processor's slots)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.page_table = torch.zeros(0, MIN_PAGE_COLUMNS, dtype=torch.long, device=device)  # [slots, W]
        self.page_tokens = torch.zeros(0, PAGE, dtype=torch.long, device=device)  # [pages, PAGE]: token ids
        self.page_counts = torch.zeros(0, PAGE, device=device)  # [pages, PAGE]: their output counts
        self.free_pages: list[int] = []

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.page_table, self.page_tokens, self.page_counts

    def grow_slots(self, new: int) -> None:
        t = self.page_table
        self.page_table = torch.cat([t, t.new_zeros(new - t.shape[0], t.shape[1])])

    def track(self, slot: int, prompt_token_ids: Sequence[int]) -> SeenState:
        """A new penalized request in ``slot``: its prompt's distinct tokens, counted 0."""
        distinct = list(dict.fromkeys(prompt_token_ids))
        pages = [self._page() for _ in range(-(-len(distinct) // PAGE))]
        state = SeenState(dict(zip(distinct, range(len(distinct)))), pages)
        if state.pages:
            if len(state.pages) > self.page_table.shape[1]:
                self._widen(len(state.pages))
            index = torch.tensor(state.pages, dtype=torch.long).to(self.device)
            self.page_table[slot, : len(state.pages)] = index
            cells = torch.zeros(len(state.pages) * PAGE, dtype=torch.long)
            cells[: len(distinct)] = torch.tensor(distinct, dtype=torch.long)
            self.page_tokens.index_copy_(0, index, cells.view(-1, PAGE).to(self.device))
            self.page_counts.index_fill_(0, index, 0)
        return state

    def count_outputs(self, state: SeenState, slot: int, outputs: Sequence[int], update: PoolUpdate) -> None:
        """The outputs appended since the request's last step, into ``update`` (and its host map)."""
        columns = state.columns
        for token in outputs[state.counted :]:
            col = columns.get(token)
            if col is None:
                col = columns[token] = len(columns)
                if col == len(state.pages) * PAGE:
                    page = self._page()
                    if len(state.pages) == self.page_table.shape[1]:
                        self._widen(len(state.pages) + 1)
                    update.table_slots.append(slot)
                    update.table_columns.append(len(state.pages))
                    update.table_pages.append(page)
                    state.pages.append(page)
                update.set_cells.append(state.pages[col // PAGE] * PAGE + col % PAGE)
                update.set_tokens.append(token), update.set_counts.append(1)
            else:  # (after the cells set: a token new this step and repeated is set, then added)
                update.add_cells.append(state.pages[col // PAGE] * PAGE + col % PAGE), update.add_counts.append(1)
        state.counted = len(outputs)

    @staticmethod
    def add_row(state: SeenState, row: int, slot: int, extra: Sequence[int], seen_total: int,
                batch: PenaltyBatch) -> None:
        """A penalized row, its seen tokens starting at ``seen_total`` of the step's entries end to end,
        and the ``extra`` tokens it follows."""
        columns = state.columns
        i = len(batch.rows)
        batch.rows.append(row), batch.slots.append(slot), batch.lengths.append(len(columns))
        unseen: dict[int, int] = {}
        for token in extra:
            col = columns.get(token)
            if col is None:
                unseen[token] = unseen.get(token, 0) + 1
            else:
                batch.seen_at.append(seen_total + col), batch.seen_counts.append(1)
        for token, count in unseen.items():
            batch.new_rows.append(i), batch.new_tokens.append(token), batch.new_counts.append(count)

    def write(self, update: PoolUpdate, host: PoolUpdate) -> None:
        """``update`` (on the device) into the pool; ``host``: the same batch's lists."""
        # Flat indices into contiguous tensors throughout, with index_select, index_copy_ and index_add_:
        # a CPU runs take, put_ and advanced indexing on every thread even for a few thousand entries
        # (milliseconds each when another process holds a core); on CUDA they are all one kernel.
        if host.table_slots:
            self.page_table.view(-1).index_copy_(
                0, update.table_slots * self.page_table.shape[1] + update.table_columns, update.table_pages)
        if host.set_cells:
            self.page_tokens.view(-1).index_copy_(0, update.set_cells, update.set_tokens)
            self.page_counts.view(-1).index_copy_(0, update.set_cells, update.set_counts.to(self.page_counts.dtype))
        if host.add_cells:
            self.page_counts.view(-1).index_add_(0, update.add_cells, update.add_counts.to(self.page_counts.dtype))

    def penalize(self, flat: torch.Tensor, vocab: int, params: torch.Tensor, batch: PenaltyBatch,
                 host: PenaltyBatch, seen_total: int) -> None:
        """The penalties (``params`` [slots, 3]) on the flat logits [R * V] at each penalized row's seen and
        extra tokens: ``batch`` on the device, ``host`` its lists, ``seen_total`` the sum of its lengths."""
        entry, offset = ragged(batch.lengths, seen_total)
        slot = batch.slots.index_select(0, entry)
        pages = self.page_table.view(-1).index_select(0, slot * self.page_table.shape[1] + (offset >> PAGE_BITS))
        cells = (pages << PAGE_BITS) + (offset & (PAGE - 1))
        tokens = self.page_tokens.view(-1).index_select(0, cells)  # [N]
        counts = self.page_counts.view(-1).index_select(0, cells)  # [N]
        if host.seen_at:
            counts.index_add_(0, batch.seen_at, batch.seen_counts.to(counts.dtype))
        if host.new_rows:
            entry = torch.cat([entry, batch.new_rows])
            tokens = torch.cat([tokens, batch.new_tokens])
            counts = torch.cat([counts, batch.new_counts.to(counts.dtype)])
        c = params.index_select(0, slot if not host.new_rows else batch.slots.index_select(0, entry))  # [N, 3]
        c = c.to(flat.dtype)
        index = batch.rows.index_select(0, entry) * vocab + tokens  # distinct: a plain copy back
        x = flat.index_select(0, index)
        x = torch.where(x > 0, x / c[:, 0], x * c[:, 0])
        flat.index_copy_(0, index, x - c[:, 1] * counts - c[:, 2] * (counts > 0))

    def release(self, state: SeenState) -> None:
        self.free_pages.extend(state.pages)

    def _page(self) -> int:
        """A free page of the pool (grown when none is)."""
        if not self.free_pages:
            old = self.page_tokens.shape[0]
            new = max(2 * old, MIN_PAGES)
            self.page_tokens = torch.cat([self.page_tokens, self.page_tokens.new_zeros(new - old, PAGE)])
            self.page_counts = torch.cat([self.page_counts, self.page_counts.new_zeros(new - old, PAGE)])
            self.free_pages.extend(range(new - 1, old - 1, -1))
        return self.free_pages.pop()

    def _widen(self, needed: int) -> None:
        pad = max(needed, 2 * self.page_table.shape[1]) - self.page_table.shape[1]
        self.page_table = torch.nn.functional.pad(self.page_table, (0, pad))

    def compact(self, live: Sequence[SeenState], old_slots: torch.Tensor, slots: int, columns: int,
                pages: int) -> int:
        """The ``live`` states' pages renumbered from 0 (their slots now 0, 1, ... in order), in tables of
        ``slots`` rows and ``columns`` columns and a pool of ``pages`` pages. Returns the pages in use."""
        old_pages = [p for s in live for p in s.pages]
        page_tokens = self.page_tokens.new_zeros(pages, PAGE)
        page_counts = self.page_counts.new_zeros(pages, PAGE)
        if old_pages:
            moved = torch.tensor(old_pages, dtype=torch.long).to(self.device)
            page_tokens[: len(old_pages)] = self.page_tokens.index_select(0, moved)
            page_counts[: len(old_pages)] = self.page_counts.index_select(0, moved)
        table = [[0] * columns for _ in range(old_slots.shape[0])]
        first = 0
        for i, s in enumerate(live):
            s.pages = list(range(first, first + len(s.pages)))
            table[i][: len(s.pages)] = s.pages
            first += len(s.pages)
        page_table = self.page_table.new_zeros(slots, columns)
        if table:
            page_table[: len(table)] = torch.tensor(table, dtype=torch.long).to(self.device)
        self.page_table, self.page_tokens, self.page_counts = page_table, page_tokens, page_counts
        self.free_pages = list(range(pages - 1, first - 1, -1))
        return first
