"""The device-resident decode step: padded batch buckets, a forward with no host syncs (run under
FakeTensorMode, where reading a tensor's value on the host raises), ``compile=True`` (the same decode
forward through ``torch.compile(fullgraph=True)``) giving the eager engine's tokens, and the CPU's default
captured decode (``cpu_graph``: the step's C kernel calls recorded, then replayed) giving them bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from epserve import LLM, SamplingParams
from epserve.config import ConfigError
from epserve.engine.block_tables import TableAppends
from epserve.engine.graphs import DecodeGraphs, DecodeStep, decode_buckets
from epserve.kernels import cpu, cpu_ops
from epserve.kernels.cpu_graph import CpuGraph
from epserve.moe.dispatch.padded import PaddedDispatcher

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [42] * 5, list(range(300, 340))]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("tiny")  # float32


def test_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(6) == (1, 2, 4, 6)
    assert decode_buckets(33) == (1, 2, 4, 8, 16, 24, 32, 33)
    with pytest.raises(ValueError):
        decode_buckets(0)


def _decode_inputs(runner, graphs: DecodeGraphs, rows: int, bucket: int, seed: int = 0):
    """``rows`` decode rows at different context lengths in their own blocks (rows 1.. of the device tables),
    padded to ``bucket``: the bucket's static inputs holding them."""
    g = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    positions = tuple(int(p) for p in torch.randint(1, 3 * bs, (rows,), generator=g))
    tables = [list(range(4 * i, 4 * i + -(-(p + 1) // bs))) for i, p in enumerate(positions)]
    owners = tuple(i + 1 for i, t in enumerate(tables) for _ in t)  # row i + 1 holds sequence i's blocks
    columns = tuple(c for t in tables for c in range(len(t)))
    runner.tables.apply(TableAppends(owners, columns, tuple(b for t in tables for b in t)))
    slots = tuple(t[p // bs] * bs + p % bs for t, p in zip(tables, positions))
    ids = tuple(int(t) for t in torch.randint(2, 500, (rows,), generator=g))
    step = DecodeStep.pad(ids, positions, slots, tuple(p + 1 for p in positions), tuple(range(1, rows + 1)), bucket,
                          runner.sink_slot)
    return graphs.stage(step)


def test_padding_rows_change_no_real_row(ckpt):
    """The same 3 decode rows padded to 4 and to 8: the real rows' hidden states and the KV they write
    agree; the padding rows write only the sink block."""
    llm = LLM(ckpt, dtype="float32", num_blocks=64)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 8, "compile", tables=runner.tables)
    torch.manual_seed(0)
    for cache in runner.kv_caches:
        cache.normal_()  # a context to attend to
    before = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        small = graphs._forward(*_decode_inputs(runner, graphs, 3, 4).tensors(), "dispatch")
        after_small = [c.clone() for c in runner.kv_caches]
        for c, b in zip(runner.kv_caches, before):
            c.copy_(b)
        big = graphs._forward(*_decode_inputs(runner, graphs, 3, 8).tensors(), "dispatch")
    torch.testing.assert_close(big[:3], small[:3], rtol=1e-5, atol=1e-5)  # (GEMM blocking differs by rows)
    sink = runner.num_blocks
    for c, s, b in zip(runner.kv_caches, after_small, before):
        c, s, b = (t[:sink].flatten(0, 1) for t in (c, s, b))
        written = (s != b).any(dim=-1)
        assert int(written.sum()) == 3  # one slot per real row, nothing else outside the sink
        assert torch.equal(c[~written], b[~written])
        torch.testing.assert_close(c[written], s[written], rtol=1e-5, atol=1e-5)


def _host_read_raises(mode: FakeTensorMode) -> bool:
    with mode:
        try:
            torch.ones(3).sum().item()
        except Exception:  # noqa: BLE001 - DataDependentOutputException and kin
            return True
    return False


@pytest.mark.parametrize("dispatch", ["local", "padded"])
def test_decode_forward_has_no_host_syncs(ckpt, dispatch, request):
    """The whole decode forward under FakeTensorMode: any ``.item()``, ``.tolist()``, ``.cpu()`` or
    data-dependent shape in it raises, so a new one fails here."""
    llm = LLM(ckpt, dtype="float32", num_blocks=64)
    runner = llm.engine.runner
    if dispatch == "padded":  # a one-rank gloo group: the real fixed-shape backend and its collectives
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        request.addfinalizer(dist.destroy_process_group)
        padded = PaddedDispatcher(runner.placement.num_local_slots, dist.group.WORLD)
        padded.begin_step(8)
        for layer in runner.model.layers:
            if layer.is_moe:
                layer.mlp.dispatcher = padded
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 8, "compile", tables=runner.tables)
    inputs = _decode_inputs(runner, graphs, 5, 8)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    assert _host_read_raises(mode)  # the check can fail
    with torch.inference_mode(), mode:
        fake = [mode.from_tensor(t) for t in inputs.tensors()]
        out = graphs._forward(*fake, "dispatch")
    assert tuple(out.shape) == (8, llm.config.model.hidden_size)


def test_compiled_decode_matches_eager(ckpt, monkeypatch):
    # The fullgraph trace (which fails on any graph break or host sync) without inductor's CPU code
    # generation, which took a minute cold in CI for nothing the GPU path runs (benchmarks/decode_capture.py
    # times inductor).
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)
    eager = LLM(ckpt, dtype="float32", num_blocks=64, max_num_seqs=2, cuda_graph=False).generate(PROMPTS, params)
    llm = LLM(ckpt, dtype="float32", num_blocks=64, max_num_seqs=2, compile=True)
    assert llm.engine.runner.decode_graphs is not None
    for a, b in zip(eager, llm.generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.slow
def test_compiled_decode_matches_eager_over_two_ranks_with_the_padded_dispatcher(ckpt, monkeypatch):
    # The same fullgraph trace without inductor's code generation: what is tested here is the trace over
    # ranks and collectives.
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")
    params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)
    # eager over two ranks = one process (test_parallel): one process is the reference
    one = LLM(ckpt, dtype="float32", num_blocks=64, max_num_seqs=2)
    eager = one.generate(PROMPTS, params)
    kw = dict(dtype="float32", num_blocks=64, max_num_seqs=2, dp=2, dispatch="padded")
    with LLM(ckpt, compile=True, **kw) as llm:
        compiled = llm.generate(PROMPTS, params)
        load = llm.expert_load()
    for a, b in zip(eager, compiled):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # a rank of fewer rows than the step's bucket sends its padding rows' copies as the dispatcher's padding:
    # every expert counts the tokens one process counts
    assert load.per_expert == one.expert_load().per_expert


def test_capture_options_are_checked(ckpt):
    with pytest.raises(ConfigError, match="cuda_graph=True needs a CUDA device"):
        LLM(ckpt, cuda_graph=True)
    with pytest.raises(ConfigError, match="cuda_graph_max_bs must be >= 1"):
        LLM(ckpt, compile=True, cuda_graph_max_bs=0)


def test_captured_decode_over_ranks_needs_the_padded_dispatcher(ckpt):
    with pytest.raises(ValueError, match="dispatch='padded'"):
        LLM(ckpt, compile=True, dp=2)


needs_cpu_kernels = pytest.mark.skipif(not (cpu.available(cpu.OPS) and cpu.available(torch.bfloat16)),
                                       reason="the CPU graph records the C kernels: AVX512-BF16, AVX2, a compiler")


def _count_replays(monkeypatch) -> list[int]:
    replays = [0]
    replay = CpuGraph.replay

    def counted(self, seconds=None):  # noqa: ANN001, ANN202
        replays[0] += 1
        return replay(self, seconds)

    monkeypatch.setattr(CpuGraph, "replay", counted)
    return replays


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_graph_is_the_cpu_default_and_gives_the_eager_engine_bit_for_bit(ckpt, dtype, monkeypatch):
    """On one rank the CPU records each decode bucket's kernel calls once and replays them, the model's head
    included: the same tokens, logprobs and expert load counters as ``--enforce-eager`` (the same kernels on
    the same rows), through the sampling pipeline's whole path (logprobs) and its greedy shortcut alike."""
    replays = _count_replays(monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    eager_llm = LLM(ckpt, dtype=dtype, num_blocks=64, cuda_graph=False)
    assert eager_llm.engine.runner.decode_graphs is None
    eager = eager_llm.generate(PROMPTS, params)
    llm = LLM(ckpt, dtype=dtype, num_blocks=64)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.mode == "cpu_graph"
    assert graphs.buckets == tuple(range(1, cpu.TILE_M + 1))  # every size: no padding rows on the CPU
    out = llm.generate(PROMPTS, params)
    assert graphs._cpu_graphs and not graphs._eager and replays[0] >= 5  # recorded once, then replayed
    for a, b in zip(eager, out):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [y.logprob for y in b.logprobs]
    _assert_the_head_replays(llm)
    assert eager_llm.expert_load() == llm.expert_load()
    plain = replace(params, logprobs=None)  # the greedy shortcut, on the graph's logits
    shortcut = llm.generate(PROMPTS, plain)
    assert [o.token_ids for o in eager_llm.generate(PROMPTS, plain)] == [o.token_ids for o in shortcut]


def _assert_the_head_replays(llm) -> None:  # noqa: ANN001
    """Each recorded bucket's logits, as its last replay left them: the head's of its hidden states, bit for bit
    (the recording held the head; the sampling pipeline read them, never running the head itself)."""
    graphs, head = llm.engine.runner.decode_graphs, llm.engine.runner.model.compute_logits
    for _, (hidden, logits) in graphs._cpu_graphs.values():
        assert logits is not None and logits.dtype == torch.float32 and torch.equal(logits, head(hidden))


@needs_cpu_kernels
def test_a_bucket_that_cannot_be_recorded_runs_eagerly_and_counts_once(ckpt, monkeypatch):
    """A torch op on the step's data (here the weighted combine's kernel reported missing: the first MoE
    layer has counted its tokens by then) ends the recording: the bucket runs eagerly from then on, with the
    same results, and the load counters the failed recording had advanced are put back."""
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=1)
    eager_llm = LLM(ckpt, dtype="bfloat16", num_blocks=64, cuda_graph=False)
    eager = eager_llm.generate(PROMPTS, params)
    llm = LLM(ckpt, dtype="bfloat16", num_blocks=64)
    monkeypatch.setattr(cpu_ops, "weighted_combine", lambda *args: None)
    replays = _count_replays(monkeypatch)
    out = llm.generate(PROMPTS, params)
    graphs = llm.engine.runner.decode_graphs
    assert graphs._eager and not graphs._cpu_graphs and replays[0] == 0
    for a, b in zip(eager, out):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [y.logprob for y in b.logprobs]
    assert eager_llm.expert_load() == llm.expert_load()


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_mtp_draft_passes_replay_too(counter_ckpt, dtype, monkeypatch):
    """Speculative decoding on the CPU graph: the MTP layer's draft passes are recorded as well, the MTP head
    inside them (each pass's draft logits are the MTP head's of its output, bit for bit); drafts, acceptance
    and tokens are the eager engine's."""
    kw = dict(speculative="mtp", num_speculative_tokens=2, dtype=dtype, num_blocks=256, block_size=8)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [[3, 4, 5, 6], [10, 11, 12]]
    eager_llm = LLM(counter_ckpt, cuda_graph=False, **kw)
    eager = eager_llm.generate(prompts, params)
    llm = LLM(counter_ckpt, **kw)
    out = llm.generate(prompts, params)
    captured = llm.engine.runner.captured
    assert captured.drafts is not None and captured.drafts._cpu_graphs and not captured.drafts._eager
    assert [a.token_ids for a in eager] == [b.token_ids for b in out]
    assert eager_llm.engine.sampling.speculative_stats() == llm.engine.sampling.speculative_stats()
    _assert_the_head_replays(llm)  # the verification rows' logits
    mtp_head = llm.engine.runner.model.compute_mtp_logits
    for _, (hidden, logits) in captured.drafts._cpu_graphs.values():  # the drafts' logits, from the recording
        assert logits is not None and logits.dtype == torch.float32 and torch.equal(logits, mtp_head(hidden))


@needs_cpu_kernels
def test_cpu_graph_is_left_off_where_a_step_needs_torch_ops(ckpt):
    """An FP8 KV cache (its append and attention are torch references) and ``--enforce-eager``: eager steps,
    no recording tried; dp 2 (collectives in the forward) too."""
    assert LLM(ckpt, dtype="bfloat16", num_blocks=64, kv_cache_dtype="fp8").engine.runner.decode_graphs is None
    assert LLM(ckpt, dtype="bfloat16", num_blocks=64, cuda_graph=False).engine.runner.decode_graphs is None
    config = LLM(ckpt, dtype="bfloat16", num_blocks=64).engine.config
    assert config.capture_mode == "cpu_graph"
    assert replace(config, parallel=replace(config.parallel, dp=2, dispatch="padded")).capture_mode is None
