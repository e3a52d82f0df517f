"""The logits processor's constant per-request tables (``logits_processor.py``): what a request's
``logit_bias``, ``bad_words``, ``min_tokens`` and penalties ask, written into its slot's rows once, when
it is first seen, and each step's :class:`EntryBatch` of the rows that add them.

``entry_tokens``/``entry_values`` [slots, E]: a slot's ``logit_bias`` entries and single-token bad words
(-inf) first, always added, then its stop tokens and EOS (-inf), added while its outputs are below
``min_tokens``; ``params`` [slots, 3]: its repetition, frequency and presence penalties.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

_MIN_ENTRIES = 8
NEG_INF = float("-inf")


@dataclass
class HostBatch:
    """Host integers of one step, named lists; :func:`send` hands every batch of a step to the device as
    one tensor and gives each back with the same names holding tensors."""

    def lists(self) -> list[list[int]]:
        return [getattr(self, f.name) for f in fields(self)]


def send(batches: list[HostBatch], device: torch.device) -> list:
    """The batches on ``device``, in one transfer: each as its own class, its lists as long tensors."""
    parts = [values for batch in batches for values in batch.lists()]
    host = torch.tensor([v for p in parts for v in p], dtype=torch.long, device=device).split([len(p) for p in parts])
    out, i = [], 0
    for batch in batches:
        n = len(fields(batch))
        out.append(type(batch)(*host[i : i + n]))
        i += n
    return out


@dataclass
class EntryBatch(HostBatch):
    """The rows that add their slot's entries this step (``count`` of them: the always-added ones, then
    the stop tokens below ``min_tokens``), and the bad words matched on the host (a row's token at -inf)."""

    rows: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    counts: list = field(default_factory=list)
    word_rows: list = field(default_factory=list)
    word_tokens: list = field(default_factory=list)


def ragged(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``lengths`` [n] entries laid end to end (``total`` of them, known on the host): each
    entry's row and its offset in the row, [total] each. (A cumulative sum of row starts, not
    ``repeat_interleave``, which a CPU runs on every thread for a few thousand entries.)"""
    ends = lengths.cumsum(0)
    marks = torch.zeros(total + 1, dtype=torch.long, device=lengths.device)
    marks.index_add_(0, ends[:-1], torch.ones_like(ends[:-1]))  # a row starts at each end before the last
    rows = marks[:total].cumsum(0)
    return rows, torch.arange(total, device=lengths.device) - (ends - lengths).index_select(0, rows)


class RequestTables:
    """The constant rows of every slot (see the module docstring); grown by the processor."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.params = torch.zeros(0, 3, device=device)  # [slots, 3]: repetition, frequency, presence
        self.entry_tokens = torch.zeros(0, _MIN_ENTRIES, dtype=torch.long, device=device)  # [slots, E]
        self.entry_values = torch.zeros(0, _MIN_ENTRIES, device=device)  # [slots, E]: bias or -inf

    @property
    def num_slots(self) -> int:
        return self.params.shape[0]

    @property
    def width(self) -> int:
        return self.entry_tokens.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.params, self.entry_tokens, self.entry_values

    def write(self, slot: int, tokens: list[int], values: list[float],
              penalties: tuple[float, float, float] | None) -> None:
        """A new request's rows: its entries (``tokens`` and their ``values``) and penalties (if any)."""
        n = len(tokens)
        if n:
            if n > self.width:
                pad = max(n, 2 * self.width) - self.width
                self.entry_tokens = torch.nn.functional.pad(self.entry_tokens, (0, pad))
                self.entry_values = torch.nn.functional.pad(self.entry_values, (0, pad))
            self.entry_tokens[slot, :n] = torch.tensor(tokens, dtype=torch.long).to(self.device)
            self.entry_values[slot, :n] = torch.tensor(values).to(self.device)
        if penalties is not None:
            self.params[slot] = torch.tensor(penalties, device=self.device)

    def grow(self, new: int) -> None:
        self.params, self.entry_tokens, self.entry_values = (
            torch.cat([t, t.new_zeros(new - t.shape[0], t.shape[1])]) for t in self.tensors())

    def compact(self, old_slots: torch.Tensor, slots: int, entries: int) -> None:
        """Slots ``old_slots`` renumbered from 0, in tables of ``slots`` rows and ``entries`` columns."""
        keep = old_slots.shape[0]
        params = self.params.new_zeros(slots, 3)
        params[:keep] = self.params.index_select(0, old_slots)
        entry_tokens = self.entry_tokens.new_zeros(slots, entries)
        entry_values = self.entry_values.new_zeros(slots, entries)
        width = min(entries, self.width)
        entry_tokens[:keep, :width] = self.entry_tokens.index_select(0, old_slots)[:, :width]
        entry_values[:keep, :width] = self.entry_values.index_select(0, old_slots)[:, :width]
        self.params, self.entry_tokens, self.entry_values = params, entry_tokens, entry_values

    def add_entries(self, flat: torch.Tensor, vocab: int, batch: EntryBatch, total: int, num_words: int) -> None:
        """Bad words, ``min_tokens`` and ``logit_bias`` into the flat logits [R * V]: one scatter-add (-inf
        absorbs the bias where both meet). ``batch`` on the device; ``total``: the sum of its counts."""
        entry, offset = ragged(batch.counts, total)
        cells = batch.slots.index_select(0, entry) * self.width + offset  # [A]
        index = batch.rows.index_select(0, entry) * vocab + self.entry_tokens.view(-1).index_select(0, cells)
        values = self.entry_values.view(-1).index_select(0, cells)
        if num_words:
            index = torch.cat([index, batch.word_rows * vocab + batch.word_tokens])
            values = torch.cat([values, torch.full((num_words,), NEG_INF, device=self.device)])
        flat.index_add_(0, index, values.to(flat.dtype))
