"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, optional logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.engine.request import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of the sampled token under the model's (unmodified) distribution, and the top ones."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one row of logits [V]."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, idx, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self._default = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SamplerOutput:
        """logits [S, V] fp32, one SamplingParams and optional per-request generator per row."""
        greedy = logits.argmax(dim=-1)
        token_ids = greedy.tolist()
        for i, p in enumerate(params):
            if p.is_greedy:
                continue
            probs = _filter(logits[i], p).softmax(-1)
            # Exponential race: argmax(p / Exp(1)) samples from p, with one generator per request.
            noise = torch.empty_like(probs).exponential_(generator=generators[i] or self._default)
            token_ids[i] = int((probs / noise).argmax())
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            lp = torch.log_softmax(logits[wanted], dim=-1)
            for row, i in enumerate(wanted):
                k = params[i].logprobs or 0
                top = torch.topk(lp[row], k) if k else None
                logprobs[i] = TokenLogprobs(
                    token_id=token_ids[i],
                    logprob=float(lp[row, token_ids[i]]),
                    top=tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (),
                )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
