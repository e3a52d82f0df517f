"""Speculative decoding (MTP) on each decode path of one rank: eager steps, the recorded CPU graph and
``torch.compile`` give the same tokens, logprobs and expert-load counters, every MoE layer's, the MTP layer's
included. A draft pass keeps only the verification's accepted rows, so a captured bucket sized for the whole
verification holds padding rows: they are never counted. EPLB balances the MTP layer's experts as a layer of
their own (it is one: its own weights on the ranks, its own tokens through the dispatcher)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from epserve import LLM, SamplingParams
from epserve.kernels import cpu
from epserve.moe.dispatch.exchange import GlooExchange
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.dispatch.symm_mem import SymmMemDispatcher

PROMPTS = [[3, 4, 5, 6], [10, 11, 12], [20, 21], list(range(30, 60))]
MTP = dict(speculative="mtp", num_speculative_tokens=1, dtype="float32", num_blocks=64)
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)

needs_cpu_kernels = pytest.mark.skipif(not (cpu.available(cpu.OPS) and cpu.available(torch.float32)),
                                       reason="the CPU graph records the C kernels: AVX2 and a compiler")


@pytest.fixture(scope="module")
def eager(counter_ckpt):
    """The eager engine with MTP (the reference), and its outputs."""
    llm = LLM(counter_ckpt, cuda_graph=False, **MTP)
    return llm, llm.generate(PROMPTS, PARAMS)


def _assert_mtp_counted(llm: LLM) -> None:
    """The expert load names the MTP layer (index L) beside the model's MoE layers, with tokens counted, and
    some drafts were rejected (so a draft pass had fewer rows than its verification)."""
    load, mc = llm.expert_load(), llm.config.model
    assert load.layers == (*mc.moe_layer_ids, mc.num_hidden_layers)
    assert sum(load.per_expert[-1]) > 0
    stats = llm.speculative_stats()
    assert stats is not None and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]


@needs_cpu_kernels
def test_the_recorded_decode_with_mtp_counts_what_the_eager_one_does(counter_ckpt, eager):
    """Tokens, logprobs, drafts and every layer's expert load of the recorded CPU step (its draft passes
    recorded too) are the eager engine's, bit for bit: a draft pass of fewer rows than its verification runs
    as a bucket of its own rows, no padding row routed to (and counted by) the MTP layer's experts."""
    eager_llm, want = eager
    llm = LLM(counter_ckpt, **MTP)
    out = llm.generate(PROMPTS, PARAMS)
    drafts = llm.engine.runner.captured.drafts
    assert drafts is not None and drafts._cpu_graphs and not drafts._eager
    for a, b in zip(want, out):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [y.logprob for y in b.logprobs]
    assert eager_llm.speculative_stats() == llm.speculative_stats()
    _assert_mtp_counted(llm)
    assert eager_llm.expert_load() == llm.expert_load()


def test_the_compiled_decode_with_mtp_counts_no_padding_row(counter_ckpt, monkeypatch):
    """``compile=True`` (the fullgraph trace; buckets 1, 2, 4 for two requests of two rows each): the draft
    passes compile too, a function of their own beside the decode's, and their padding rows (a rejected draft
    leaves one) are not counted: the eager engine's tokens and expert load."""
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")
    eager_llm = LLM(counter_ckpt, cuda_graph=False, max_num_seqs=2, **MTP)
    want = eager_llm.generate(PROMPTS[:2], PARAMS)
    llm = LLM(counter_ckpt, compile=True, max_num_seqs=2, **MTP)
    out = llm.generate(PROMPTS[:2], PARAMS)
    captured = llm.engine.runner.captured
    assert captured.drafts is not None and captured.drafts._warm and captured.graphs._warm
    for a, b in zip(want, out):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    _assert_mtp_counted(llm)
    assert eager_llm.expert_load() == llm.expert_load()


def test_eplb_with_mtp_balances_the_mtp_layer_too(skewed_ckpt):
    """With MTP on, the MTP layer's experts are a layer of the balancer's: a rebalance places them by their
    own load (the hot experts replicated there too) and changes no token."""
    kw = dict(MTP, num_redundant_experts=4)
    llm = LLM(skewed_ckpt, **kw)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(PROMPTS, params)]
    mc = llm.config.model
    assert llm.expert_load().layers == (*mc.moe_layer_ids, mc.num_hidden_layers)
    report = llm.rebalance_experts()
    assert report.layers_changed == len(mc.moe_layer_ids) + 1 and report.bytes_moved == 0
    mtp_moe = llm.engine.runner.model.moe_layers()[mc.num_hidden_layers]
    assert mtp_moe.replica_count[4:6].min() >= 2  # the hot experts got the redundant slots there too
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == before


@pytest.mark.parametrize("backend", ["padded", "symm_mem"])
def test_the_fixed_shape_dispatchers_leave_padding_rows_unsent(backend, request):
    """Over ranks a captured bucket's padding rows are the fixed-shape dispatchers' to leave out: their copies
    are not sent (``padded``: as its own padding, zero rows at slot -1; ``symm_mem``: sorted past every slot),
    so no rank computes or counts them, and the real rows combine as before (a one-rank gloo group: the real
    backends, ``symm_mem`` through its exchange's gloo twin)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    request.addfinalizer(dist.destroy_process_group)
    g = torch.Generator().manual_seed(0)
    slots, tokens, top_k, hidden = 6, 5, 2, 8
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    real = torch.tensor([True, True, True, False, False])
    group = dist.group.WORLD
    if backend == "padded":
        dispatcher = PaddedDispatcher(slots, group)
    else:
        dispatcher = SymmMemDispatcher(slots, group, top_k, tokens, hidden, torch.float32, torch.device("cpu"),
                                       exchange=GlooExchange(group))
    outputs, counts = [], []
    for marks in (None, real):
        dispatcher.begin_step(tokens)
        got, route = dispatcher.dispatch(x, ids, weights, marks)
        counts.append(got.num_tokens_per_expert)
        if not got.masked:  # the unsent copies arrive as zero rows past the counted ones
            assert not got.hidden_states[int(got.num_tokens_per_expert.sum()):].any()
        outputs.append(dispatcher.combine(got.hidden_states * 2, route))  # (an "expert" doubling its rows)
    assert torch.equal(counts[0], torch.bincount(ids.flatten(), minlength=slots))
    assert torch.equal(counts[1], torch.bincount(ids[real].flatten(), minlength=slots))
    torch.testing.assert_close(outputs[1][real], outputs[0][real])
    torch.testing.assert_close(outputs[0], 2 * x * weights.sum(1, keepdim=True))
