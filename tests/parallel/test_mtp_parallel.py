"""MTP speculative decoding across ranks: every layout, dispatcher and overlap mode gives the tokens of
one process decoding plainly, while DP groups accept different numbers of drafts (the ranks stay in
lockstep: every rank runs the same number of MTP passes each step)."""

from __future__ import annotations

import pytest

from epserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[11, 12, 13], [40, 41], list(range(100, 140)), [7], [200, 201, 202, 203, 204], [60] * 9]
PARAMS = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=2) for i in range(6)]
ENGINE = dict(dtype="float32", num_blocks=256, block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(counter_ckpt):
    return LLM(counter_ckpt, **ENGINE).generate(PROMPTS, PARAMS)


@pytest.mark.parametrize(("dp", "tp", "dispatch", "k", "modes"), [
    (2, 1, "all_to_all", 2, ("none", "dispatch", "microbatch")),
    (2, 1, "padded", 1, ("dispatch", "microbatch")),
    (1, 2, "padded", 3, ("none", "microbatch")),
])
def test_layouts_with_mtp_match_one_process(counter_ckpt, reference, dp, tp, dispatch, k, modes):
    with LLM(counter_ckpt, dp=dp, tp=tp, dispatch=dispatch, speculative="mtp", num_speculative_tokens=k,
             **ENGINE) as llm:
        for mode in modes:
            llm.set_overlap(mode)
            outs = llm.generate(PROMPTS, PARAMS)
            for i, (out, ref) in enumerate(zip(outs, reference)):
                assert out.token_ids == ref.token_ids, f"dp={dp} tp={tp} {dispatch} {mode}: prompt {i}"
                assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(out.logprobs, ref.logprobs))
        stats = llm.speculative_stats()
        assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
        assert len(stats["accepted_per_position"]) == k
