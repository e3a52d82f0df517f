"""MTP speculative decoding across ranks: every layout, dispatcher and overlap mode gives the tokens of
one process decoding plainly, while DP groups accept different numbers of drafts (the ranks stay in
lockstep: every rank runs the same number of MTP passes each step), logits processing (penalties,
``logit_bias``, ``min_tokens``, ``bad_words``) included."""

from __future__ import annotations

import pytest

from epserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[11, 12, 13], [40, 41], list(range(100, 140)), [7], [200, 201, 202, 203, 204], [60] * 9, [90, 91, 92],
           [300, 301]]
PARAMS = [SamplingParams(max_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=2) for i in range(6)] + [
    # logits processing over the drafts' rows: the bias takes 50 once (its penalties then count it), the
    # stop token 303 is held back below min_tokens and 304 is banned (both change the counter's tokens)
    SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2, logit_bias={50: 14.0},
                   frequency_penalty=2.0, repetition_penalty=1.2),
    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2, presence_penalty=0.8, min_tokens=5,
                   stop_token_ids=[303], logit_bias={303: 30.0}, bad_words=[(304,)]),
]
ENGINE = dict(dtype="float32", num_blocks=256, block_size=8, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def reference(counter_ckpt):
    return LLM(counter_ckpt, num_speculative_tokens=0, **ENGINE).generate(PROMPTS, PARAMS)


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
