"""Sampler: filters keep the right tokens, seeds reproduce, sampling follows the distribution."""

from __future__ import annotations

import torch

from epserve.engine.sampler import Sampler, filter_logits
from epserve.messages.sampling import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def kept(p: SamplingParams) -> list[int]:
    return torch.isfinite(filter_logits(LOGITS[None], [p])[0]).nonzero().flatten().tolist()


def test_filters_keep_the_expected_tokens():
    assert kept(SamplingParams(temperature=1.0)) == [0, 1, 2, 3, 4, 5]
    assert kept(SamplingParams(temperature=1.0, top_k=3)) == [0, 1, 2]
    probs = LOGITS.softmax(-1)  # 0.57, 0.21, 0.13, 0.08, ...
    assert kept(SamplingParams(temperature=1.0, top_p=0.5)) == [0]
    assert kept(SamplingParams(temperature=1.0, top_p=0.7)) == [0, 1]
    assert kept(SamplingParams(temperature=1.0, top_p=0.85)) == [0, 1, 2]
    assert kept(SamplingParams(temperature=1.0, top_p=0.9)) == [0, 1, 2, 3]
    assert float(probs[:4].sum()) > 0.9 > float(probs[:3].sum()) > 0.85 > float(probs[:2].sum())
    assert kept(SamplingParams(temperature=1.0, min_p=0.3)) == [0, 1]  # 0.21/0.57 ≥ 0.3 > 0.13/0.57


def test_greedy_and_degenerate_filters_pick_argmax():
    s = Sampler()
    logits = torch.randn(5, 50)
    for p in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, top_p=1e-6)):
        out = s.sample(logits, [p] * 5, [None] * 5)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_reproduce_and_differ_by_seed():
    s = Sampler()
    logits = torch.zeros(1, 1000)
    p = SamplingParams(temperature=1.0)
    a = [s.sample(logits, [p], [s.make_generator(3)]).token_ids[0] for _ in range(3)]
    b = s.sample(logits, [p], [s.make_generator(4)]).token_ids[0]
    assert a[0] == a[1] == a[2] and b != a[0]


def test_sampling_follows_the_distribution():
    s = Sampler(seed=0)
    n = 4000
    logits = LOGITS[None].expand(n, -1).contiguous()
    tokens = torch.tensor(s.sample(logits, [SamplingParams(temperature=1.0)] * n, [None] * n).token_ids)
    freq = torch.bincount(tokens, minlength=6).float() / n
    assert torch.allclose(freq, LOGITS.softmax(-1), atol=0.03)
    hot = torch.tensor(s.sample(logits, [SamplingParams(temperature=0.5)] * n, [None] * n).token_ids)
    assert (hot == 0).float().mean() > (tokens == 0).float().mean() + 0.1  # lower temperature sharpens


def test_logprobs_are_normalised_and_ranked():
    s = Sampler()
    out = s.sample(LOGITS[None], [SamplingParams(temperature=0.0, logprobs=3)], [None])
    lp = out.logprobs[0]
    assert lp.token_id == 0 and [t for t, _ in lp.top] == [0, 1, 2]
    assert abs(sum(torch.tensor([v for _, v in lp.top]).exp()) - float(LOGITS.softmax(-1)[:3].sum())) < 1e-5
