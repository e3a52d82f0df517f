"""The logprobs of prompt tokens (vLLM's ``prompt_logprobs``): the model's own, unprocessed, computed
from a step's prefill hidden states for the requests that asked."""

from __future__ import annotations

from collections.abc import Callable

import torch

from epserve.engine.request import Request, ScheduledChunk
from epserve.messages.sampling import TokenLogprobs


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], chunks: list[ScheduledChunk],
                    hidden: torch.Tensor, rows_per_pass: int = 128) -> dict[str, tuple[TokenLogprobs, ...]]:
    """The logprobs of the prompt tokens the step's prefill chunks predict (position ``p``'s hidden
    state predicts token ``p + 1``), for requests that asked and lack them: the model's own
    (unprocessed) log-softmax, the prompt token's and the top ``k``; ``rows_per_pass`` rows of
    logits at a time."""
    rows: list[int] = []
    targets: list[int] = []
    wanted: list[tuple[Request, int, int]] = []  # request, its first row in rows, its row count
    offset = 0  # the chunk's first row of ``hidden`` (the plan lays chunks out in order)
    for c in chunks:
        request = c.request
        if request.wants_prompt_logprobs:
            first = max(c.start, len(request.prompt_logprobs))
            last = min(c.end, request.num_prompt_tokens - 1)
            if first < last:
                wanted.append((request, len(rows), last - first))
                rows.extend(range(offset + first - c.start, offset + last - c.start))
                targets.extend(request.prompt_token_ids[first + 1 : last + 1])
        offset += c.num_tokens
    if not rows:
        return {}
    k = max(request.sampling_params.prompt_logprobs or 0 for request, _, _ in wanted)
    device = hidden.device
    parts = []
    for start in range(0, len(rows), rows_per_pass):
        index = torch.tensor(rows[start : start + rows_per_pass], dtype=torch.long, device=device)
        target = torch.tensor(targets[start : start + rows_per_pass], dtype=torch.long, device=device)
        logits = compute_logits(hidden[index]).float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (no [rows, V] log-softmax made)
        top = torch.topk(logits, k, dim=-1) if k else None
        parts.append(torch.cat([(logits.gather(1, target[:, None]) - lse).double(),
                                *(((top.values - lse).double(), top.indices.double()) if top is not None else ())],
                               1))
    table = torch.cat(parts).tolist()  # one transfer: [rows, 1 + 2k]
    out: dict[str, tuple[TokenLogprobs, ...]] = {}
    for request, first_row, count in wanted:
        n = request.sampling_params.prompt_logprobs or 0
        out[request.request_id] = tuple(
            TokenLogprobs(targets[r], row[0],
                          tuple((int(t), v) for v, t in zip(row[1 : 1 + n], row[1 + k : 1 + k + n])))
            for r, row in enumerate(table[first_row : first_row + count], start=first_row)
        )
    return out
