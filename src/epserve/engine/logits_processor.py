"""Logits processing before sampling: repetition, frequency and presence penalties, ``logit_bias`` and
``min_tokens``, as vLLM defines them (``SamplingParams``), batched on the logits' device.

Each row of a step's logits belongs to a request and may sit past tokens the request does not hold yet:
a verification row ``j`` follows the request's first ``j`` drafts, an MTP draft row follows this step's
sampled tokens and the drafts before it. Those ``extra`` tokens count as output, so the target and the
draft distributions are processed exactly as plain decoding would process the same position, and
rejection sampling stays exact.

A request with penalties keeps three rows on the device (pooled, made at its first processed step):
its output token counts, what the frequency and presence penalties subtract (``frequency x count +
presence x [count > 0]``) and which tokens the repetition penalty touches (prompt or output). Each step
updates them only at the output tokens appended since (a few ids from the host, never a request's
history), so the step itself is one gather and one subtraction over the processed rows (and, for a
repetition penalty, one masked scale), then one small scatter for the biases, the ``min_tokens`` masks
and the extra tokens' entries, whatever the batch size. Rows without processing are untouched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from epserve.engine.request import Request


class LogitsProcessor:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._counts = torch.zeros(0, vocab_size, device=device)  # output token counts, one pooled row each
        self._sub = torch.zeros(0, vocab_size, device=device)  # frequency x count + presence x [count > 0]
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # in the prompt or the output
        self._slot: dict[str, int] = {}  # request id -> its pooled row
        self._counted: dict[str, int] = {}  # output tokens already in the row
        self._free: list[int] = []

    def release(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            self._counted.pop(request_id)

    @property
    def num_tracked(self) -> int:
        return len(self._slot)

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
        index_r: list[int] = []
        index_t: list[int] = []
        values: list[float] = []
        if penalized:
            self._penalize(logits, penalized, [requests[r] for r in penalized], [extras[r] for r in penalized])
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
        if index_r:
            device = logits.device
            logits.index_put_((torch.tensor(index_r, device=device), torch.tensor(index_t, device=device)),
                              torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)
        return logits

    def _penalize(self, logits: torch.Tensor, rows: list[int], requests: list[Request],
                  extras: list[Sequence[int]]) -> None:
        """Repetition, frequency and presence penalties on ``logits[rows]``, in place."""
        slots = [self._slot_of(req) for req in requests]
        self._count_new_outputs(requests)
        device = logits.device
        every = len(rows) == logits.shape[0]
        row_index = torch.tensor(rows, device=device)
        slot_index = torch.tensor(slots, device=device)
        # The extra tokens' entries are decided apart, from their unprocessed logits (below).
        fix_r, fix_t, fix_c = [], [], []
        for i, extra in enumerate(extras):
            for token, count in Counter(extra).items():
                fix_r.append(i), fix_t.append(token), fix_c.append(count)
        if fix_r:
            fix_rows = torch.tensor([rows[i] for i in fix_r], device=device)
            fix_tokens = torch.tensor(fix_t, device=device)
            raw = logits[fix_rows, fix_tokens]
        x = logits if every else logits.index_select(0, row_index)
        rep = [req.sampling_params.repetition_penalty for req in requests]
        if any(p != 1.0 for p in rep):
            factor = torch.tensor(rep, dtype=x.dtype, device=device)[:, None]
            seen = self._seen.index_select(0, slot_index)
            x.mul_(torch.where(seen, torch.where(x > 0, 1.0 / factor, factor), 1.0))
        x.sub_(self._sub.index_select(0, slot_index))
        if not every:
            logits.index_copy_(0, row_index, x)
        if fix_r:
            fix_slots = torch.tensor([slots[i] for i in fix_r], device=device)
            count = self._counts[fix_slots, fix_tokens] + torch.tensor(fix_c, dtype=x.dtype, device=device)
            params = [requests[i].sampling_params for i in fix_r]
            column = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                                  dtype=x.dtype, device=device)
            scaled = torch.where(raw > 0, raw / column[:, 0], raw * column[:, 0])
            logits[fix_rows, fix_tokens] = scaled - column[:, 1] * count - column[:, 2] * (count > 0)

    def _slot_of(self, request: Request) -> int:
        rid = request.request_id
        slot = self._slot.get(rid)
        if slot is not None:
            return slot
        if not self._free:
            old = self._counts.shape[0]
            grow = max(old, 4)
            self._counts = torch.cat([self._counts, self._counts.new_zeros(grow, self.vocab_size)])
            self._sub = torch.cat([self._sub, self._sub.new_zeros(grow, self.vocab_size)])
            self._seen = torch.cat([self._seen, self._seen.new_zeros(grow, self.vocab_size)])
            self._free.extend(range(old + grow - 1, old - 1, -1))
        slot = self._slot[rid] = self._free.pop()
        self._counted[rid] = 0
        self._counts[slot].zero_()
        self._sub[slot].zero_()
        seen = self._seen[slot]
        seen.zero_()
        seen[torch.tensor(request.prompt_token_ids, device=self.device)] = True
        return slot

    def _count_new_outputs(self, requests: list[Request]) -> None:
        """The output tokens each request appended since its last processed step, into its rows."""
        index_s: list[int] = []
        index_t: list[int] = []
        penalties: list[tuple[float, float]] = []
        for req in requests:
            rid = req.request_id
            done = self._counted[rid]
            new = req.output_token_ids[done:]
            if new:
                params = req.sampling_params
                index_s.extend([self._slot[rid]] * len(new))
                index_t.extend(new)
                penalties.extend([(params.frequency_penalty, params.presence_penalty)] * len(new))
                self._counted[rid] = done + len(new)
        if not index_s:
            return
        device = self.device
        where = (torch.tensor(index_s, device=device), torch.tensor(index_t, device=device))
        self._counts.index_put_(where, torch.ones(len(index_t), device=device), accumulate=True)
        count = self._counts[where]
        column = torch.tensor(penalties, device=device)
        self._sub[where] = column[:, 0] * count + column[:, 1] * (count > 0)  # (a repeated id: equal values)
        self._seen[where] = True
