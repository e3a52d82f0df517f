"""Speculative decoding's sampling side: drafting from the MTP layer's logits, verifying drafts against
the target model's logits, and the acceptance statistics.

A decode that verifies ``d`` drafts runs ``d + 1`` target rows: row ``j`` holds the target's
distribution after the known token and the first ``j`` drafts. Greedy requests accept a draft while it
equals the target's argmax. Sampled requests use speculative rejection sampling (Leviathan et al.,
Chen et al.): draft ``j`` was drawn from the draft distribution ``q_j``; it is accepted with probability
``min(1, p_j / q_j)``; at the first rejection the next token is drawn from ``normalize(max(0, p_j -
q_j))``, and when every draft is accepted a bonus token is drawn from ``p_d``. ``p`` and ``q`` both pass
through the request's temperature, top-k, top-p and min-p (``sampler.filter_logits``), so the output
follows exactly the distribution plain sampling draws from. A seeded request's draws are keyed by
(seed, position of the token they decide, role) (``Noise``), not taken in turn from one generator: how
the steps group its positions (drafts cut short, other requests, prefix-cache hits, preemption) does
not change what it draws, so it stays reproducible. Everything runs on the logits' device; the host
gets one transfer per verification.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from epserve.engine.sampler import argmax_rows, filter_logits
from epserve.messages.sampling import SamplingParams, TokenLogprobs

DRAFT, ACCEPT, SAMPLE = 1, 2, 3  # the roles of a position's draws


class Noise:
    """Where a request's random draws come from: for a seeded request, a generator per (seed, position,
    role), the same however steps group positions; unseeded requests share the engine's generator."""

    def __init__(self, default: torch.Generator) -> None:
        self.default = default
        self.device = default.device

    def generator(self, seed: int | None, position: int, role: int) -> torch.Generator:
        if seed is None:
            return self.default
        key = ((seed % 2**61) * 1_000_003 + position * 7 + role) % 2**63
        return torch.Generator(device=self.device).manual_seed(key)


@dataclass(frozen=True)
class VerifyGroup:
    """One request's ``len(drafts) + 1`` rows in the verification batch (the groups tile the batch in
    order), deciding the tokens at ``first_position`` onwards; ``draft_probs`` [d, V]: the filtered draft
    distributions the drafts were drawn from (None for greedy requests, whose drafts are the draft
    model's argmax)."""

    drafts: tuple[int, ...]
    draft_probs: torch.Tensor | None
    params: SamplingParams
    first_position: int

    @property
    def num_rows(self) -> int:
        return len(self.drafts) + 1


@dataclass(frozen=True)
class VerifyOutcome:
    """The tokens a request gets this step (the accepted drafts, then the token sampled after them), the
    target's logprobs of each when asked, and how many drafts were accepted. ``no_token_left``: the row after
    the accepted drafts had every logit masked (-inf): its token is 0, to be dropped, and the request fails
    (``sampler.SamplerOutput.empty_rows``' case, with drafts)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    num_accepted: int
    no_token_left: bool = False


@dataclass
class SpecStats:
    """Acceptance counters of one engine (vLLM's ``spec_decode`` metrics)."""

    num_speculative_tokens: int
    num_drafts: int = 0  # decodes that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def as_dict(self) -> dict[str, object]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            "accepted_per_position": list(self.accepted_per_position),
        }


def merge_stats(stats: list[dict[str, object]]) -> dict[str, object]:
    """The counters of several engines (DP groups) as one."""
    total = SpecStats(max((len(s["accepted_per_position"]) for s in stats), default=0))  # type: ignore[arg-type]
    for s in stats:
        total.num_drafts += s["num_drafts"]  # type: ignore[operator]
        total.num_draft_tokens += s["num_draft_tokens"]  # type: ignore[operator]
        total.num_accepted_tokens += s["num_accepted_tokens"]  # type: ignore[operator]
        for j, n in enumerate(s["accepted_per_position"]):  # type: ignore[arg-type]
            total.accepted_per_position[j] += n
    return total.as_dict()


def _race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [n, V] (an exponential race: ``argmax(p / Exp(1))`` samples ``p``)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _race_rows(probs: torch.Tensor, seed: int | None, first_position: int, noise: Noise) -> torch.Tensor:
    """Row ``j`` of ``probs`` decides the token at ``first_position + j``: a seeded request draws it from
    that position's own generator."""
    if seed is None:
        return _race(probs, noise.default)
    return torch.cat([_race(probs[j : j + 1], noise.generator(seed, first_position + j, SAMPLE))
                      for j in range(probs.shape[0])])


def draft_tokens(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int], noise: Noise
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Draft one token per row of the draft model's ``logits`` [D, V] (row ``i`` proposes the token at
    ``positions[i]``): the argmax for greedy requests, a draw from the filtered distribution ``q``
    otherwise. Returns the ids [D] (on the device) and each sampled row's ``q`` [V] (None for greedy
    rows), which verification needs."""
    ids = logits.argmax(dim=-1)
    probs: list[torch.Tensor | None] = [None] * len(params)
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    if sampled:
        q = filter_logits(logits[sampled], [params[i] for i in sampled]).softmax(-1)
        for row, i in enumerate(sampled):
            ids[i] = _race(q[row : row + 1], noise.generator(params[i].seed, positions[i], DRAFT))[0]
            probs[i] = q[row]
    return ids, probs


def verify(logits: torch.Tensor, groups: list[VerifyGroup], noise: Noise,
           raw_logits: torch.Tensor | None = None) -> list[VerifyOutcome]:
    """Verify every group's drafts against the target ``logits`` [R, V] (fp32, after ``LogitsProcessor``;
    the groups' rows in order) and sample the token after the accepted ones (see the module docstring).
    Logprobs are of ``raw_logits`` (before processing) when given. A row whose every logit is -inf (its masks
    cover the vocabulary) accepts no draft and draws nothing: its request's outcome says ``no_token_left``."""
    device = logits.device
    firsts = [0]
    for g in groups:
        firsts.append(firsts[-1] + g.num_rows)
    if firsts[-1] != logits.shape[0]:
        raise ValueError(f"the groups have {firsts[-1]} rows, the logits {logits.shape[0]}")
    if all(g.params.is_greedy and g.params.logprobs is None for g in groups):
        return verify_greedy(_argmax_marked(logits), [g.drafts for g in groups])
    argmax = logits.argmax(dim=-1)
    nxt = torch.tensor([t for g in groups for t in (*g.drafts, -1)], dtype=torch.long, device=device)  # -1: bonus
    accept = argmax == nxt  # greedy rows; sampled rows are decided below
    empty = logits.amax(dim=-1) == float("-inf")  # rows with no token left (read back with the tokens)
    candidate = argmax.clone()  # the token each row emits if verification stops there
    for g, first in zip(groups, firsts):
        if g.params.is_greedy:
            continue
        rows = slice(first, first + g.num_rows)
        p = filter_logits(logits[rows], [g.params] * g.num_rows).softmax(-1)  # [d + 1, V]
        q = torch.zeros_like(p)
        if g.drafts:
            if g.draft_probs is None:
                raise ValueError("a sampled request's drafts need the draft distributions they were drawn from")
            q[:-1] = g.draft_probs
            j, drafts = torch.arange(len(g.drafts), device=device), nxt[first : first + len(g.drafts)]
            seed, pos = g.params.seed, g.first_position
            u = (torch.rand(len(g.drafts), generator=noise.default, device=device) if seed is None else
                 torch.cat([torch.rand(1, generator=noise.generator(seed, pos + i, ACCEPT), device=device)
                            for i in range(len(g.drafts))]))
            accept[first : first + len(g.drafts)] = u * q[j, drafts] < p[j, drafts]
        residual = (p - q).clamp_(min=0)  # the bonus row: q = 0, so p itself
        same = residual.sum(dim=-1, keepdim=True) <= 0  # p == q exactly: the residual is p
        candidate[rows] = _race_rows(torch.where(same, p, residual), g.params.seed, g.first_position, noise)
    accept &= ~empty  # (an empty row's argmax is 0, and its p NaN)
    candidate.masked_fill_(empty, -1)
    wanted = [(g, first) for g, first in zip(groups, firsts) if g.params.logprobs is not None]
    packed = [argmax.new_tensor([])]
    k = max((g.params.logprobs or 0 for g, _ in wanted), default=0)
    if wanted:
        lp_rows = torch.cat([torch.arange(first, first + g.num_rows, device=device) for g, first in wanted])
        lp = torch.log_softmax((logits if raw_logits is None else raw_logits)[lp_rows], dim=-1)
        top = torch.topk(lp, k, dim=-1)
        packed = [lp.gather(1, nxt[lp_rows, None].clamp(min=0)).flatten(),
                  lp.gather(1, candidate[lp_rows, None].clamp(min=0)).flatten(),
                  top.values.flatten(), top.indices.double().flatten()]
    flat = torch.cat([candidate.double(), accept.double(), *(t.double() for t in packed)]).tolist()  # one transfer
    n = logits.shape[0]
    cand, acc, rest = flat[:n], flat[n : 2 * n], flat[2 * n :]
    m = sum(g.num_rows for g, _ in wanted)
    lp_draft, lp_cand, top_v, top_i = rest[:m], rest[m : 2 * m], rest[2 * m : 2 * m + m * k], rest[2 * m + m * k :]
    outcomes, lp_row = [], 0
    for g, first in zip(groups, firsts):
        a = next((j for j in range(len(g.drafts)) if not acc[first + j]), len(g.drafts))
        last = int(cand[first + a])
        tokens = (*g.drafts[:a], max(last, 0))
        lps = None
        if g.params.logprobs is not None:
            want = g.params.logprobs
            lps = tuple(
                TokenLogprobs(t, (lp_draft if j < a else lp_cand)[lp_row + j],
                              tuple((int(i), v) for i, v in zip(top_i[(lp_row + j) * k : (lp_row + j) * k + want],
                                                                 top_v[(lp_row + j) * k : (lp_row + j) * k + want])))
                for j, t in enumerate(tokens)
            )
            lp_row += g.num_rows
        outcomes.append(VerifyOutcome(tokens, lps, a, last < 0))
    return outcomes


def verify_greedy(argmax: list[int], drafts: list[tuple[int, ...]]) -> list[VerifyOutcome]:
    """Greedy groups without logprobs, from the target's argmax of every row (``argmax``: the groups' rows in
    order, ``len(drafts[i]) + 1`` each; -1: a row with no token left): each group's drafts while each equals the
    argmax, then the argmax after them (what :func:`verify`'s general path gives such rows)."""
    outcomes, first = [], 0
    for d in drafts:
        a = next((j for j, t in enumerate(d) if argmax[first + j] != t), len(d))
        last = argmax[first + a]
        outcomes.append(VerifyOutcome((*d[:a], max(last, 0)), None, a, last < 0))
        first += len(d) + 1
    return outcomes


def _argmax_marked(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (``sampler.argmax_rows``' on the CPU), -1 where every logit is -inf (masked): one
    transfer elsewhere."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        ids = argmax_rows(logits)
        rows = logits.numpy()
        return [-1 if rows[r, t] == -np.inf else t for r, t in enumerate(ids)]
    return logits.argmax(dim=-1).masked_fill(logits.amax(dim=-1) == float("-inf"), -1).tolist()
