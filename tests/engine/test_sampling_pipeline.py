"""The sampling pipeline (``engine/sampling.py``) on the tiny model's head: plain decoding is verification
with zero drafts (one token from the target distribution), a verification keeps the drafts up to the first
the target refuses then one token after them, and the draft distributions it keeps follow the requests."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from epserve import LLM
from epserve.engine.batch_plan import BatchPlan
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.sampling import SamplingPipeline
from epserve.messages.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def head(tiny_ckpt):
    """The tiny model's config and head (final hidden states -> logits)."""
    llm = LLM(tiny_ckpt, dtype="float32", num_blocks=64)
    return llm.engine.config, llm.engine.runner.model.compute_logits


def _decode(rid: str, drafts: tuple[int, ...] = (), params: SamplingParams = GREEDY) -> ScheduledChunk:
    request = Request(rid, [1, 2, 3], params)
    request.append_output_token(4)  # a decode: one known token, an output
    return ScheduledChunk(request, request.num_tokens - 1, 1 + len(drafts), drafts)


def _plan(chunks: list[ScheduledChunk]) -> BatchPlan:
    rows = sum(c.num_tokens if c.drafts else 1 for c in chunks)
    return BatchPlan(logits_indices=tuple(range(rows)))


def test_plain_decoding_draws_one_token_from_the_target(head):
    config, compute_logits = head
    pipeline = SamplingPipeline(config, compute_logits, torch.device("cpu"))
    hidden = torch.randn(2, config.model.hidden_size, generator=torch.Generator().manual_seed(0))
    chunks = [_decode("a"), _decode("b", params=replace(GREEDY, logprobs=2))]
    result = pipeline.sample(chunks, hidden, _plan(chunks))
    want = compute_logits(hidden).argmax(-1).tolist()
    assert result.sampled == {"a": want[0], "b": want[1]}  # one token each, not a tuple
    assert set(result.logprobs) == {"b"} and result.logprobs["b"].token_id == want[1]
    assert pipeline.speculative_stats() is None


def test_verification_keeps_the_drafts_the_target_agrees_with(head):
    config, compute_logits = head
    pipeline = SamplingPipeline(replace(config, speculative="mtp", num_speculative_tokens=2), compute_logits,
                                torch.device("cpu"))
    hidden = torch.randn(4, config.model.hidden_size, generator=torch.Generator().manual_seed(1))
    target = compute_logits(hidden).argmax(-1).tolist()
    wrong = (target[1] + 1) % config.model.vocab_size
    chunks = [_decode("v", (target[0], wrong)), _decode("z")]  # rows 0-2 verify two drafts; row 3: none
    result = pipeline.sample(chunks, hidden, _plan(chunks))
    assert result.sampled["v"] == (target[0], target[1])  # the first draft kept, the second refused
    assert result.sampled["z"] == (target[3],)  # zero drafts: one token, from the target
    stats = pipeline.speculative_stats()
    assert stats["num_drafts"] == 1 and stats["num_draft_tokens"] == 2 and stats["num_accepted_tokens"] == 1


def test_draft_distributions_follow_their_requests(head):
    config, compute_logits = head
    pipeline = SamplingPipeline(replace(config, speculative="mtp", num_speculative_tokens=1), compute_logits,
                                torch.device("cpu"))
    sampled = SamplingParams(temperature=0.9, seed=3, max_tokens=8)
    chunk = _decode("s", params=sampled)
    logits = compute_logits(torch.randn(1, config.model.hidden_size, generator=torch.Generator().manual_seed(2)))
    ids, q = pipeline.draft(logits, [chunk.request], [(5,)], [()], [chunk.start + 2])
    assert len(ids) == 1 and q[0] is not None and q[0][ids[0]] > 0  # drawn from its filtered distribution
    pipeline.keep_drafts([chunk], {"s": q})
    assert torch.equal(pipeline._pending_probs("s", 1), q[0][None])
    pipeline.keep_drafts([chunk], {})  # it stepped without drafting: nothing pending
    assert pipeline._pending_probs("s", 1) is None
    pipeline.keep_drafts([chunk], {"s": q})
    pipeline.release("s")
    assert pipeline._pending_probs("s", 1) is None
