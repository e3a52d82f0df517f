"""MTP speculative decoding in the engine: greedy tokens equal plain decoding's for k = 1, 2, 3, sampling
keeps the target distribution, stop conditions cut accepted tokens exactly, the prefix cache and aborts
leave the KV pool consistent, and a checkpoint without MTP is refused at start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from epserve import LLM, SamplingParams
from epserve.checkpoint import CheckpointError
from epserve.config import ConfigError
from epserve.engine.spec_manager import DraftRule
from epserve.model.load_plan import model_bytes

PROMPTS = ["The object", "In the following example, the", "A class definition", "If the", "Names",
           "The value of the expression is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
ENGINE = dict(dtype="float32", num_blocks=256, block_size=8, device=os.environ.get("EPSERVE_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def plain(counter_ckpt):
    return LLM(counter_ckpt, num_speculative_tokens=0, **ENGINE)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda k: f"k{k}")
def mtp(request, counter_ckpt):
    return LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=request.param, **ENGINE)


def test_greedy_tokens_equal_plain_decoding(mtp, reference):
    before = mtp.speculative_stats()
    outs = mtp.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    stats = mtp.speculative_stats()
    k = mtp.config.num_speculative_tokens
    drafted = stats["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = stats["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert 0 < accepted < drafted  # both paths taken: accepted drafts and rejected ones (rolled back)
    per_pos = stats["accepted_per_position"]
    assert len(per_pos) == k and sum(per_pos) == stats["num_accepted_tokens"]
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))  # draft j+1 is accepted only after draft j
    assert stats["acceptance_rate"] == pytest.approx(stats["num_accepted_tokens"] / stats["num_draft_tokens"])
    # every block is back in the pool (cached ones evictable)
    kv = mtp.engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_stop_tokens_and_max_tokens_cut_exactly_where_plain_decoding_stops(mtp, plain, reference):
    for i in range(3):
        stop = reference[i][7]
        cut = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=(stop,))
        assert mtp.generate(PROMPTS[i], cut)[0].token_ids == plain.generate(PROMPTS[i], cut)[0].token_ids
        assert mtp.generate(PROMPTS[i], cut)[0].token_ids == reference[i][: reference[i].index(stop) + 1]
        for n in (1, 2, 5):
            short = mtp.generate(PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
            assert short.token_ids == reference[i][:n] and short.finish_reason == "length"


def test_logprobs_are_the_target_models(mtp, plain):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    a, b = mtp.generate(PROMPTS[:2], params), plain.generate(PROMPTS[:2], params)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and len(x.logprobs) == len(y.logprobs) == 12
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert lx.token_id == ly.token_id and lx.logprob == pytest.approx(ly.logprob, abs=1e-4)
            assert [t for t, _ in lx.top] == [t for t, _ in ly.top]


def test_prefix_cache_hits_keep_the_draft_layers_cache_right(counter_ckpt, reference):
    """A second pass over the same prompts reuses cached blocks (the MTP layer's KV included: a block's
    hash covers the token after it) and gives the same tokens."""
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **ENGINE)
    long = [p * 3 for p in PROMPTS]
    first = llm.generate(long, GREEDY)
    second = llm.generate(long, GREEDY)
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert sum(o.num_cached_tokens for o in second) > 0
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_preemption_under_speculation_gives_the_same_tokens(counter_ckpt, reference):
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=3, **{**ENGINE, "num_blocks": 24},
              enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_aborts_mid_speculation_leave_no_block_behind(counter_ckpt):
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=3, **ENGINE)
    engine = llm.engine
    params = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True, seed=1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", llm.tokenizer.encode(prompt), params)
    for _ in range(6):
        engine.step()
    assert any(engine.scheduler.spec.pending(r) for r in engine.scheduler.running)
    for i in range(len(PROMPTS)):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_sampling_keeps_the_target_distribution(counter_ckpt, plain):
    """Thousands of seeded samples of the tokens after a prompt, with and without MTP (k = 2): the
    frequency of each (second, third) output token agrees within 5 sigma of the two sample sizes."""
    n = 1500
    prompt = plain.tokenizer.encode("The")
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **{**ENGINE, "num_blocks": 1024},
              max_num_seqs=256)
    llm.engine.runner.proposer.rule = DraftRule(max_requests=256)  # always draft (the CPU rule: <= 8, acceptance)
    counts = []
    for engine in (plain, llm):
        params = [SamplingParams(temperature=1.0, top_k=6, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
        outs = engine.generate([prompt] * n, params)
        counts.append([torch.bincount(torch.tensor([o.token_ids[j] for o in outs]), minlength=512).double() / n
                       for j in (1, 2)])
    for (f_plain, f_mtp) in zip(*counts):
        p = (f_plain + f_mtp) / 2
        sigma = (p * (1 - p) * 2 / n).sqrt()
        assert ((f_plain - f_mtp).abs() <= 5 * sigma + 1e-9).all()
    assert llm.speculative_stats()["num_accepted_tokens"] > n / 4  # drafts were really verified by sampling


def test_a_checkpoint_without_mtp_is_refused_at_start(make_ckpt, tmp_path):
    no_mtp = make_ckpt("tiny", overrides={"num_nextn_predict_layers": 0})
    with pytest.raises(ConfigError, match="needs MTP layers"):
        LLM(no_mtp, speculative="mtp")
    # the config announces an MTP layer, but its tensors are missing
    src = make_ckpt("tiny")
    broken = tmp_path / "broken"
    shutil.copytree(no_mtp, broken)
    cfg = json.loads((broken / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="MTP layer's tensors"):
        LLM(broken, speculative="mtp", dtype="float32")
    out = subprocess.run([sys.executable, "-m", "epserve.cli", "generate", str(no_mtp), "--speculative", "mtp",
                          "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "needs MTP layers" in out.stderr and "Traceback" not in out.stderr
    assert src.exists()


def test_zero_speculative_tokens_is_speculative_decoding_off(counter_ckpt, make_ckpt, reference, caplog):
    """``num_speculative_tokens=0`` (``--num-speculative-tokens 0``): no MTP layer loaded, no drafts, plain
    decoding's tokens; on a checkpoint without an MTP layer too; a negative count is refused. Logged."""
    with caplog.at_level("INFO", logger="epserve.engine.options"):
        off = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=0, **ENGINE)
    assert "speculative decoding: off (num_speculative_tokens 0)" in caplog.text
    runner = off.engine.runner
    assert runner.proposer is None and runner.num_spec == 0 and len(runner.model.mtp) == 0
    assert [o.token_ids for o in off.generate(PROMPTS, GREEDY)] == reference and off.speculative_stats() is None
    no_mtp = make_ckpt("tiny", overrides={"num_nextn_predict_layers": 0})
    assert LLM(no_mtp, speculative="mtp", num_speculative_tokens=0, num_blocks=16).engine.runner.proposer is None
    with pytest.raises(ConfigError, match="integer >= 0"):
        LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=-1, **ENGINE)


def test_mtp_shares_the_embedding_and_head_when_equal(counter_ckpt, make_ckpt):
    """The counter checkpoint's MTP embedding equals the main one (shared, counted once), its head does
    not; the random preset copies both (both shared)."""
    llm = LLM(counter_ckpt, speculative="mtp", **ENGINE)
    model = llm.engine.runner.model
    mtp = model.mtp[0]
    assert mtp.embed_tokens.data_ptr() == model.embed_tokens.data_ptr()
    assert mtp.shared_head.head.data_ptr() != model.lm_head.data_ptr()
    assert torch.equal(mtp.shared_head.head, load_file(next(counter_ckpt.glob("*.safetensors")))[
        f"model.layers.{model.config.num_hidden_layers}.shared_head.head.weight"])
    assert llm.engine.runner.weight_bytes == model_bytes(model)
    assert model_bytes(model) == sum(t.numel() * t.element_size() for t in {
        t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}.values())
    random = LLM(make_ckpt("tiny"), speculative="mtp", dtype="float32", num_blocks=64).engine.runner.model
    assert random.mtp[0].embed_tokens.data_ptr() == random.embed_tokens.data_ptr()
    assert random.mtp[0].shared_head.head.data_ptr() == random.lm_head.data_ptr()


def test_accepted_drafts_give_the_oracles_tokens(counter_ckpt, reference):
    """transformers' DeepseekV3ForCausalLM (which ignores the MTP layer) continues the prompts with the
    tokens MTP decoding produced while accepting drafts."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(counter_ckpt), dtype=torch.float32).eval()
    from epserve.tokenizer import load_tokenizer

    tok = load_tokenizer(counter_ckpt)
    for prompt, ref in list(zip(PROMPTS, reference))[:3]:
        ids = tok.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out == ref


def test_captured_decode_with_mtp(counter_ckpt, reference, monkeypatch):
    """``compile=True`` (CUDA graphs on a GPU): verification rows run through the captured decode forward
    (one graph per row bucket), a pure-decode step's MTP passes through the captured draft pass; the tokens
    stay plain decoding's."""
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")  # the capture, without inductor's code generation
    capture = {"compile": True} if ENGINE["device"] == "cpu" else {"cuda_graph": True}
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **capture, **ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert llm.speculative_stats()["num_accepted_tokens"] > 0
    captured = llm.engine.runner.captured
    assert captured.graphs._warm and captured.drafts._warm  # both replayed (warmed at their first use)
    eager = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **ENGINE)
    eager.generate(PROMPTS, GREEDY)  # the same drafts: the same acceptance
    assert eager.speculative_stats() == llm.speculative_stats()


def test_sampled_requests_waiting_for_budget_keep_their_drafts(counter_ckpt):
    """A tight step budget leaves some decodes out of a step: their pending drafts (and the draft
    distributions rejection sampling needs) wait for the next one; a seeded request gives the same
    tokens again, with prefix-cache hits, and alone."""
    llm = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, max_num_batched_tokens=4, **ENGINE)
    params = [SamplingParams(temperature=1.5, top_k=8, max_tokens=24, ignore_eos=True, seed=s) for s in range(4)]
    first = [o.token_ids for o in llm.generate(PROMPTS[:4], params)]
    assert all(len(t) == 24 for t in first)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], params)] == first  # with prefix-cache hits now
    assert llm.generate(PROMPTS[2], params[2])[0].token_ids == first[2]  # alone
    assert llm.speculative_stats()["num_accepted_tokens"] > 0
