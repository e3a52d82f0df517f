"""Logits processing before sampling: repetition, frequency and presence penalties, ``logit_bias`` and
``min_tokens``, as vLLM defines them (``SamplingParams``), batched on the logits' device.

Each row of a step's logits belongs to a request and may sit past tokens the request does not hold yet:
a verification row ``j`` follows the request's first ``j`` drafts, an MTP draft row follows this step's
sampled tokens and the drafts before it. Those ``extra`` tokens count as output, so the target and the
draft distributions are processed exactly as plain decoding would process the same position, and
rejection sampling stays exact.

The penalties touch only the tokens a request has seen (its prompt's and its output's), so they are
kept sparse: a request with penalties holds a pooled row on the device listing its distinct seen tokens
and their output counts, extended at the output tokens appended since its last step (a few ids from
the host; the host keeps each request's token -> column map). A step gathers the processed rows'
logits at those columns, penalizes them and scatters them back: work in the tokens seen, not in the
vocabulary (a DeepSeek-V3 vocabulary is 129280 entries a row). ``logit_bias`` and the ``min_tokens``
masks and ``bad_words`` are one more small scatter. Rows without processing are untouched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from epserve.engine.request import Request


@dataclass
class _Seen:
    """A request's seen tokens: its pooled row, the column of each distinct token, outputs counted."""

    slot: int
    columns: dict[int, int] = field(default_factory=dict)
    counted: int = 0


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._tokens = torch.zeros(0, 0, dtype=torch.long, device=device)  # [slots, columns]: seen token ids
        self._counts = torch.zeros(0, 0, device=device)  # [slots, columns]: their counts in the output
        self._seen: dict[str, _Seen] = {}
        self._free: list[int] = []

    def release(self, request_id: str) -> None:
        seen = self._seen.pop(request_id, None)
        if seen is not None:
            self._free.append(seen.slot)

    @property
    def num_tracked(self) -> int:
        return len(self._seen)

    def apply(self, logits: torch.Tensor, requests: Sequence[Request],
              extras: Sequence[Sequence[int]] | None = None, in_place: bool = False) -> torch.Tensor:
        """``logits`` [R, V] (fp32): row ``r`` is ``requests[r]``'s next token after its outputs and then
        ``extras[r]`` (tokens not appended yet). Returns the processed logits: ``logits`` itself when no
        row asks for processing or ``in_place`` (the caller needs no unprocessed copy), else a new tensor."""
        rows = [r for r, req in enumerate(requests) if req.sampling_params.processes_logits]
        if not rows:
            return logits
        extras = extras if extras is not None else [()] * len(requests)
        if not in_place:
            logits = logits.clone()
        penalized = [r for r in rows if requests[r].sampling_params.has_penalties]
        if penalized:
            self._penalize(logits, penalized, [requests[r] for r in penalized], [extras[r] for r in penalized])
        index_r: list[int] = []
        index_t: list[int] = []
        values: list[float] = []
        vocab = self.vocab_size
        for r in rows:
            req = requests[r]
            params = req.sampling_params
            for token, bias in params.logit_bias:
                index_r.append(r), index_t.append(token), values.append(bias)
            if req.num_output_tokens + len(extras[r]) < params.min_tokens:
                stops = (*params.stop_token_ids, *(() if params.ignore_eos else req.eos_token_ids))
                for token in stops:
                    if token < vocab:
                        index_r.append(r), index_t.append(token), values.append(float("-inf"))
            for word in params.bad_words:  # its last token, where the output ends with the rest of it
                n = len(word) - 1
                if n and tuple((*req.output_token_ids[-n:], *extras[r])[-n:]) != word[:-1]:
                    continue
                index_r.append(r), index_t.append(word[-1]), values.append(float("-inf"))
        if index_r:
            device = logits.device
            logits.index_put_((torch.tensor(index_r, device=device), torch.tensor(index_t, device=device)),
                              torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
        return logits

    def _penalize(self, logits: torch.Tensor, rows: list[int], requests: list[Request],
                  extras: list[Sequence[int]]) -> None:
        """Repetition, frequency and presence penalties on ``logits[rows]``, in place."""
        seen = self._update(requests)
        device = logits.device
        # The extra tokens' entries are decided apart, from their unprocessed logits (below).
        fix_i, fix_t, fix_c, fix_col = [], [], [], []
        for i, extra in enumerate(extras):
            for token, count in Counter(extra).items():
                fix_i.append(i), fix_t.append(token), fix_c.append(count)
                fix_col.append(seen[i].columns.get(token, -1))
        if fix_i:
            fix_rows = torch.tensor([rows[i] for i in fix_i], device=device)
            fix_tokens = torch.tensor(fix_t, device=device)
            raw = logits[fix_rows, fix_tokens]
        column = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                               for p in (req.sampling_params for req in requests)], dtype=logits.dtype, device=device)
        # Each row's seen tokens, padded by repeating its last column (an equal entry: the scatter writes
        # the same value twice).
        width = max(len(s.columns) for s in seen)
        slots = torch.tensor([s.slot for s in seen], device=device)
        last = torch.tensor([len(s.columns) - 1 for s in seen], device=device)
        cols = torch.minimum(torch.arange(width, device=device)[None, :], last[:, None])
        tokens = self._tokens[slots[:, None], cols]  # [P, width]
        counts = self._counts[slots[:, None], cols]
        row_index = torch.tensor(rows, device=device)[:, None]
        x = logits[row_index, tokens]
        x = torch.where(x > 0, x / column[:, 0:1], x * column[:, 0:1])  # every seen token: repetition
        logits[row_index, tokens] = x - column[:, 1:2] * counts - column[:, 2:3] * (counts > 0)
        if fix_i:
            fix_slots = torch.tensor([seen[i].slot for i in fix_i], device=device)
            fix_cols = torch.tensor(fix_col, device=device)
            base = torch.where(fix_cols >= 0, self._counts[fix_slots, fix_cols.clamp(min=0)], 0.0)
            count = base + torch.tensor(fix_c, dtype=logits.dtype, device=device)
            c = column[torch.tensor(fix_i, device=device)]
            scaled = torch.where(raw > 0, raw / c[:, 0], raw * c[:, 0])
            logits[fix_rows, fix_tokens] = scaled - c[:, 1] * count - c[:, 2]

    def _update(self, requests: list[Request]) -> list[_Seen]:
        """Each request's seen tokens, with the outputs appended since its last step (its row made at its
        first): one scatter of the new columns and one of the new counts for the batch."""
        new_s: list[int] = []  # new columns: slot, column, token
        new_c: list[int] = []
        new_t: list[int] = []
        count_s: list[int] = []  # output counts to add: slot, column
        count_c: list[int] = []
        out = []
        for request in requests:
            seen = self._seen.get(request.request_id)
            if seen is None:
                slot = self._free.pop() if self._free else self._grow_slots()
                seen = self._seen[request.request_id] = _Seen(slot)
                self._counts[slot].zero_()
                tokens: Sequence[int] = request.prompt_token_ids
            else:
                tokens = ()
            outputs = request.output_token_ids[seen.counted :]
            columns = seen.columns
            for token in (*tokens, *outputs):
                if token not in columns:
                    new_s.append(seen.slot), new_c.append(len(columns)), new_t.append(token)
                    columns[token] = len(columns)
            for token in outputs:
                count_s.append(seen.slot), count_c.append(columns[token])
            seen.counted += len(outputs)
            out.append(seen)
        widest = max(len(s.columns) for s in out)
        if widest > self._tokens.shape[1]:
            self._grow_columns(widest)
        device = self.device
        if new_s:
            where = (torch.tensor(new_s, device=device), torch.tensor(new_c, device=device))
            self._tokens[where] = torch.tensor(new_t, device=device)
        if count_s:
            where = (torch.tensor(count_s, device=device), torch.tensor(count_c, device=device))
            self._counts.index_put_(where, torch.ones(len(count_s), device=device), accumulate=True)
        return out

    def _grow_slots(self) -> int:
        old = self._tokens.shape[0]
        grow = max(old, 4)
        self._tokens = torch.cat([self._tokens, self._tokens.new_zeros(grow, self._tokens.shape[1])])
        self._counts = torch.cat([self._counts, self._counts.new_zeros(grow, self._counts.shape[1])])
        self._free.extend(range(old + grow - 1, old, -1))
        return old

    def _grow_columns(self, needed: int) -> None:
        width = max(needed, 2 * self._tokens.shape[1], 64)
        pad = width - self._tokens.shape[1]
        self._tokens = torch.nn.functional.pad(self._tokens, (0, pad))
        self._counts = torch.nn.functional.pad(self._counts, (0, pad))
