"""Drafting switched off per step where it would not pay (``spec_manager.DraftRule``): a step of more
requests than the rule allows runs no MTP pass and verifies nothing, a smaller one drafts again, and the
greedy tokens are plain decoding's throughout."""

from __future__ import annotations

import os

from epserve import LLM, SamplingParams
from epserve.engine.spec_manager import DraftRule

ENGINE = dict(dtype="float32", num_blocks=256, block_size=8, device=os.environ.get("EPSERVE_TEST_DEVICE", "cpu"))


def test_rule_from_batch_and_acceptance():
    cpu = DraftRule.for_device("cpu")
    assert cpu.pays(1, 1, 0, 0) and not cpu.pays(16, 1, 0, 0)  # batch 16 on the CPU: plain steps
    assert cpu.pays(1, 1, cpu.sample - 1, 0)  # too few verifications to judge
    assert not cpu.pays(1, 1, 1000, 500) and cpu.pays(1, 1, 1000, 900)  # a half of the drafts does not pay
    assert not cpu.pays(1, 2, 1000, 1400) and cpu.pays(1, 2, 1000, 1700)  # two drafts: 1.5 a step is needed
    assert DraftRule.for_device("cuda").pays(16, 3, 1000, 0)


def test_drafting_stops_at_a_large_batch_and_resumes_at_batch_one(counter_ckpt):
    """Five requests of staggered lengths: while more than two run, no step drafts; once two or fewer run,
    every step does; the tokens equal plain decoding's."""
    lengths = (6, 10, 14, 18, 40)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(len(lengths))]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    reference = [o.token_ids for o in LLM(counter_ckpt, num_speculative_tokens=0, **ENGINE).generate(prompts, params)]
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=1, **ENGINE)
    proposer, engine = llm.engine.runner.proposer, llm.engine
    proposer.rule = DraftRule(max_requests=2)  # (and no acceptance floor: the counter drafts right half the time)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    drafted_at: dict[bool, set[int]] = {True: set(), False: set()}  # drafted? -> batch sizes seen
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        skipped = proposer.steps_without_drafts
        for update in engine.step():
            tokens[update.request_id] += update.new_token_ids
        if running:
            drafted_at[proposer.steps_without_drafts == skipped].add(running)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert drafted_at[False] and min(drafted_at[False]) > 2  # off only above two requests
    assert drafted_at[True] and max(drafted_at[True]) <= 2  # on at two or fewer
    stats = llm.speculative_stats()
    assert 0 < stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
