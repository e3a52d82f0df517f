"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, optional logprobs; the
sampling pipeline's draw (``engine/sampling.py``) when speculative decoding is off.

The whole batch is sampled on the logits' device: the filters run on ``[S, V]`` with one value per row,
the draw is an exponential race (``argmax(p / Exp(1))`` samples from ``p``) whose noise comes from each
request's own generator (so a seeded request's tokens do not depend on its batch), and the sampled ids
with any logprobs come back to the host in one transfer per step. A row with no token left to draw
(every logit -inf: the request's masks cover the vocabulary) comes back as -1 in that same transfer,
and is reported (``SamplerOutput.empty_rows``) rather than drawn as token 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.messages.sampling import SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # (an empty row's: 0, its caller fails its request)
    logprobs: list[TokenLogprobs | None]
    empty_rows: tuple[int, ...] = ()  # rows that had no token left to draw (every logit -inf)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]  # [S, 1]


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, each row with its own values: logits [S, V] -> [S, V] with
    the dropped tokens at -inf. Greedy rows (temperature 0) come back unscaled."""
    vocab = logits.shape[-1]
    logits = logits / _column([p.temperature if p.temperature > 0 else 1.0 for p in params], logits)
    if any(0 < p.top_k < vocab for p in params):
        ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, ks[:, None] - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix reaching top_p
        drop = probs.cumsum(-1) - probs >= _column([p.top_p for p in params], probs)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        probs = logits.softmax(-1)
        floor = _column([p.min_p for p in params], probs) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self._default = torch.Generator(device=self.device).manual_seed(seed)

    @property
    def default_generator(self) -> torch.Generator:
        """The generator of unseeded requests."""
        return self._default

    def make_generator(self, seed: int, vocab_size: int = 0, num_drawn: int = 0) -> torch.Generator:
        """A seeded request's generator. ``num_drawn``: tokens already sampled from this seed elsewhere
        (a prefill instance's first token): their draws are skipped (one exponential per vocabulary
        entry of ``vocab_size``, as :meth:`sample` draws), so the request's tokens are one sampler's."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for _ in range(num_drawn):
            torch.empty(vocab_size, device=self.device).exponential_(generator=gen)
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        raw_logits: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits [S, V] fp32 (after ``LogitsProcessor``), one SamplingParams and optional per-request
        generator per row. Logprobs are the model's own: of ``raw_logits`` (the logits before processing),
        when given."""
        ids = logits.argmax(dim=-1)
        empty = logits.amax(dim=-1) == float("-inf")  # (read back with the ids: no transfer of its own)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            probs = filter_logits(logits[sampled], [params[i] for i in sampled]).softmax(-1)
            noise = torch.empty_like(probs)
            unseeded = [row for row, i in enumerate(sampled) if generators[i] is None]
            if unseeded:  # one draw from the sampler's generator for every unseeded row
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(
                    generator=self._default)
            for row, i in enumerate(sampled):
                if generators[i] is not None:
                    noise[row].exponential_(generator=generators[i])
            ids[sampled] = (probs / noise).argmax(dim=-1)  # (an empty row's NaNs: index 0)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            token_ids, empty_rows = _unmarked(ids.masked_fill(empty, -1).tolist())
            return SamplerOutput(token_ids, [None] * len(params), empty_rows)
        k = max(params[i].logprobs or 0 for i in wanted)
        lp = torch.log_softmax((logits if raw_logits is None else raw_logits)[wanted], dim=-1)
        chosen = lp.gather(1, ids[wanted, None])  # [W, 1]
        top = torch.topk(lp, k, dim=-1)
        packed = torch.cat([ids.masked_fill(empty, -1).double(), chosen.double().flatten(),
                            top.values.double().flatten(), top.indices.double().flatten()]).tolist()  # one transfer
        s, w = len(params), len(wanted)
        token_ids, empty_rows = _unmarked([int(t) for t in packed[:s]])
        values, indices = packed[s + w : s + w + w * k], packed[s + w + w * k :]
        logprobs: list[TokenLogprobs | None] = [None] * s
        for row, i in enumerate(wanted):
            n = params[i].logprobs or 0
            pairs = zip(indices[row * k : row * k + n], values[row * k : row * k + n])
            logprobs[i] = TokenLogprobs(token_ids[i], packed[s + row], tuple((int(t), v) for t, v in pairs))
        return SamplerOutput(token_ids, logprobs, empty_rows)


def _unmarked(token_ids: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """The ids read back, the empty rows' -1 made 0, and those rows."""
    empty = tuple(row for row, t in enumerate(token_ids) if t < 0)
    for row in empty:
        token_ids[row] = 0
    return token_ids, empty


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, as ``torch.argmax`` picks it (the first of equal maxima; a NaN before any number):
    on the host numpy's (one thread, vectorised: torch's reduction over a few long rows splits them between its
    threads, which costs milliseconds beside other work on the cores), else (another device or a dtype numpy
    lacks) torch's."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()
