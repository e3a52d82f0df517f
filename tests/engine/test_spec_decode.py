"""Speculative decoding's sampling side (engine/spec_decode.py) and the scheduler's bookkeeping of drafts:
greedy acceptance, rejection sampling that keeps the target distribution, logprobs of the target, the
step budget, draft caps, and the KV rollback of rejected drafts."""

from __future__ import annotations

import math

import pytest
import torch

from epserve.config import CacheConfig, SchedulerConfig
from epserve.engine.request import Request
from epserve.engine.sampler import filter_logits
from epserve.engine.scheduler import Scheduler
from epserve.engine.spec_decode import Noise, SpecStats, VerifyGroup, draft_tokens, merge_stats, verify
from epserve.messages.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def _logits_with_argmax(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), vocab)
    for row, t in enumerate(argmaxes):
        logits[row, t] = 5.0
    return logits


def test_greedy_accepts_the_drafts_that_match_then_takes_the_target_token():
    noise = Noise(torch.Generator().manual_seed(0))
    # request A: drafts (3, 4, 5) against target argmax (3, 4, 1, 6): two accepted, then 1
    # request B: no drafts: plain argmax; request C: every draft accepted, then the bonus row
    logits = _logits_with_argmax([3, 4, 1, 6, 2, 7, 7, 0])
    groups = [VerifyGroup((3, 4, 5), None, GREEDY, 10), VerifyGroup((), None, GREEDY, 3),
              VerifyGroup((7, 7), None, GREEDY, 7)]
    out = verify(logits, groups, noise)
    assert [o.token_ids for o in out] == [(3, 4, 1), (2,), (7, 7, 0)]
    assert [o.num_accepted for o in out] == [2, 0, 2]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.0, logprobs=1),
                                    SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "logprobs", "sampled"])
def test_a_row_with_no_token_left_fails_its_request_after_the_drafts_before_it(params):
    """A row whose every logit is masked (-inf: bad words, a grammar) accepts no draft, not even a draft 0 (its
    argmax), and draws nothing: its request keeps the drafts accepted before it, then token 0 to drop, and fails
    (``no_token_left``), as plain sampling fails such a row; the other requests are verified as before."""
    noise = Noise(torch.Generator().manual_seed(0))
    logits = _logits_with_argmax([3, 0, 0, 2, 5])
    logits[1] = float("-inf")  # request A's row after its first draft: nothing allowed
    drafts = [(3, 0), (2,)]
    probs = None
    if not params.is_greedy:  # the drafts drawn from q = their rows' own distributions
        probs = [torch.softmax(_logits_with_argmax([3, 0]), -1), torch.softmax(_logits_with_argmax([2]), -1)]
    groups = [VerifyGroup(d, q, params, 10) for d, q in zip(drafts, probs or [None, None])]
    a, b = verify(logits, groups, noise)
    assert (a.token_ids, a.num_accepted) == ((3, 0), 1)  # draft 0 rejected: the 0 is the failed row's, dropped
    assert a.no_token_left
    assert not b.no_token_left and b.token_ids[0] == 2
    if params.logprobs is not None:
        assert a.logprobs is not None and len(a.logprobs) == 2


def test_logprobs_are_the_targets_for_every_emitted_token():
    noise = Noise(torch.Generator().manual_seed(0))
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    target = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = verify(logits, [VerifyGroup((target[0], (target[1] + 1) % 10), None, params, 5)], noise)[0]
    lp = torch.log_softmax(logits, -1)
    assert out.token_ids == (target[0], target[1])
    assert out.logprobs is not None and len(out.logprobs) == 2
    for row, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(float(lp[row, tok]), abs=1e-6)
        top = torch.topk(lp[row], 2)
        assert [t for t, _ in entry.top] == top.indices.tolist()


def _frequencies(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, max_tokens=100),
                                    SamplingParams(temperature=1.3, top_k=4, top_p=0.9, max_tokens=100)],
                         ids=["temperature", "top_k_top_p"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Drafts drawn from a different (filtered) draft distribution q, verified against p: the first
    emitted token follows the filtered p, within a 5-sigma band of the sample size; the second one
    (after an accepted draft) too."""
    vocab, n = 6, 6000
    noise = Noise(torch.Generator().manual_seed(1234))
    target = torch.tensor([[1.0, 0.5, 0.2, -0.3, 0.8, -1.0], [0.1, 0.9, -0.5, 0.4, 0.0, 0.3]])
    draft = torch.tensor([0.2, 1.2, -0.2, 0.6, -0.5, 0.9])  # the draft model's logits, unlike the target's
    p0 = filter_logits(target[:1], [params]).softmax(-1)[0].double()
    q = filter_logits(draft[None], [params]).softmax(-1)
    firsts, seconds, accepted = [], [], 0
    batch = 500
    for _ in range(n // batch):
        ids, probs = draft_tokens(draft.expand(batch, vocab), [params] * batch, [6] * batch, noise)
        d = ids.tolist()
        groups = [VerifyGroup((d[i],), probs[i][None], params, 6) for i in range(batch)]
        outs = verify(target.repeat(batch, 1), groups, noise)
        for o in outs:
            firsts.append(o.token_ids[0])
            if o.num_accepted:
                accepted += 1
                seconds.append(o.token_ids[1])
    freq = _frequencies(firsts, vocab)
    sigma = (p0 * (1 - p0) / n).sqrt()
    assert ((freq - p0).abs() <= 5 * sigma + 1e-9).all(), (freq, p0)
    assert torch.all(q[0] > 0) or params.top_k  # the test means something: q differs from p
    expected_accept = float(torch.minimum(p0, q[0].double()).sum())
    assert accepted / n == pytest.approx(expected_accept, abs=5 * math.sqrt(expected_accept / n))
    p1 = filter_logits(target[1:], [params]).softmax(-1)[0].double()
    freq1 = _frequencies(seconds, vocab)
    sigma1 = (p1 * (1 - p1) / len(seconds)).sqrt()
    assert ((freq1 - p1).abs() <= 5 * sigma1 + 1e-9).all(), (freq1, p1)


def test_seeded_requests_draw_by_position_whatever_the_batch():
    """A seeded request's draws are keyed by the position they decide: the same drafts and tokens alone
    or behind other requests, and its other seeds differ."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    draft = torch.randn(50, generator=torch.Generator().manual_seed(4))

    def run(extra: int, seed: int = 7) -> tuple[int, ...]:
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=10)
        noise = Noise(torch.Generator().manual_seed(99 + extra))  # unseeded draws differ between the runs
        pad = [VerifyGroup((1,), torch.full((1, 50), 1 / 50), SamplingParams(temperature=1.0), 20)
               for i in range(extra)]
        ids, probs = draft_tokens(draft.expand(extra + 1, 50), [SamplingParams(temperature=1.0)] * extra + [params],
                                  [21] * extra + [12], noise)
        group = VerifyGroup((int(ids[-1]),), probs[-1][None], params, 12)
        return verify(torch.cat([logits] * (extra + 1)), pad + [group], noise)[-1].token_ids

    assert run(0) == run(3)
    assert len({run(0, seed) for seed in range(8)}) > 1


def test_stats_count_drafts_acceptance_and_positions():
    stats = SpecStats(3)
    stats.record(3, 2)
    stats.record(3, 0)
    stats.record(0, 0)  # a decode without drafts is no draft
    stats.record(2, 2)
    d = stats.as_dict()
    assert d == {"num_drafts": 3, "num_draft_tokens": 8, "num_accepted_tokens": 4, "acceptance_rate": 0.5,
                 "accepted_per_position": [2, 2, 0]}
    assert merge_stats([d, d])["accepted_per_position"] == [4, 4, 0]


# ---- the scheduler's side ------------------------------------------------------------------------


def _scheduler(num_blocks: int = 32, k: int = 2, budget: int = 64, max_model_len: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget), CacheConfig(block_size=4),
                     num_blocks, max_model_len, num_speculative_tokens=k)


def _prefill(s: Scheduler, request: Request, drafts: list[int]) -> None:
    out = s.schedule()
    s.update(out, {request.request_id: (9,)}, drafts={request.request_id: drafts})


def test_a_decode_verifies_its_drafts_and_counts_them_in_the_budget():
    s = _scheduler(k=2)
    r = Request("a", [1, 2, 3, 4, 5], GREEDY)
    s.add_request(r)
    _prefill(s, r, [7, 8])
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.is_decode and chunk.drafts == (7, 8) and chunk.num_tokens == 3
    assert chunk.token_ids == [9, 7, 8] and out.num_batched_tokens == 3
    # positions 5..7 verified, and a chained draft's KV at one more position (8): three blocks of 4
    assert len(r.block_ids) == 3
    updates = s.update(out, {"a": (7, 3)}, drafts={"a": [4, 4]})  # one draft accepted, then 3
    assert updates[0].new_token_ids == (7, 3)
    assert r.all_token_ids == [1, 2, 3, 4, 5, 9, 7, 3] and r.num_computed_tokens == 7
    assert len(r.block_ids) == 2 and s.spec.pending(r) == [4, 4]


def test_rejected_drafts_give_their_blocks_back():
    s = _scheduler(k=3, num_blocks=16)
    r = Request("a", [1, 2, 3], GREEDY)
    s.add_request(r)
    _prefill(s, r, [5, 6, 7])
    free_before = s.kv_manager.num_free_blocks
    out = s.schedule()  # verifies positions 3..6 and may chain to 8: three blocks of 4
    assert len(r.block_ids) == 3
    s.update(out, {"a": (2,)}, drafts={"a": [1, 1, 1]})  # every draft rejected
    assert r.num_computed_tokens == 4 and len(r.block_ids) == 1
    assert s.kv_manager.num_free_blocks == free_before


def test_drafts_stop_at_max_tokens_and_the_budget():
    s = _scheduler(k=3, budget=3)
    r = Request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    s.add_request(r)
    _prefill(s, r, [5, 6, 7])
    (chunk,) = s.schedule().chunks
    assert chunk.drafts == (5,)  # one token out, two more allowed: one draft plus the token after it


def test_a_stop_token_cuts_the_accepted_tokens():
    s = _scheduler(k=3)
    r = Request("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=(6,)))
    s.add_request(r)
    _prefill(s, r, [5, 6, 7])
    out = s.schedule()
    updates = s.update(out, {"a": (5, 6, 7, 8)})
    assert updates[0].new_token_ids == (5, 6) and updates[0].finished and updates[0].finish_reason == "stop"
    assert r.output_token_ids == [9, 5, 6]
    assert s.kv_manager.num_free_blocks == s.kv_manager.num_blocks


def test_aborting_mid_speculation_leaves_no_block_behind():
    s = _scheduler(k=3, num_blocks=16)
    reqs = [Request(str(i), list(range(1, 8)), GREEDY) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    s.update(out, {r.request_id: (9,) for r in reqs}, drafts={r.request_id: [1, 2, 3] for r in reqs})
    out = s.schedule()
    s.abort_request("1")  # in flight: keeps its blocks until the update
    s.update(out, {"0": (1, 2, 5), "2": (4,)}, drafts={"0": [1], "2": [1]})
    s.abort_request("0")
    s.abort_request("2")
    s.update(s.schedule(), {})
    assert s.kv_manager.num_free_blocks == s.kv_manager.num_blocks
    assert not s.has_unfinished_requests()
