"""The warm-up runs exactly the capture path: the kernel ops a decode forward reaches are the same whether or
not the stream is capturing (``kernels.opdef.record_calls`` lists them), and FlashInfer's MLA decode runs in a
captured decode through its CUDA-graph-mode wrappers, planned before each replay (``kernels.decode_plan``,
``kernels.mla_flashinfer_graph``): the plan's page lists against a plain construction, built without reading
the device; on CUDA, a captured decode replayed with new lengths against the reference."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from epserve import LLM, SamplingParams, env
from epserve.engine.graphs import DecodeGraphs
from epserve.kernels import backends, decode_plan, ops
from epserve.kernels import mla_flashinfer as mf
from epserve.kernels import mla_flashinfer_graph as mg
from epserve.kernels.decode_plan import DecodeReplay
from epserve.kernels.device import trace_as_cuda
from epserve.kernels.mla_decode import paged_mla_decode, paged_mla_decode_ref
from epserve.kernels.opdef import OpImpl, record_calls

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
BF16 = torch.bfloat16
BUCKET = 4

# a backend of paged_mla_decode on the CPU (its self-test passes for bf16 caches only), standing where FlashInfer
# stands on CUDA: listed ahead of the C kernel where ``kernels.backends`` chose it
impls = types.ModuleType("capture_path_impls")
sys.modules[impls.__name__] = impls


def _fast_mla(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale=None,  # noqa: ANN001, ANN201
              num_splits=None):
    return paged_mla_decode_ref(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale)


def _bf16_only(device: torch.device, dtype: torch.dtype) -> None:
    if dtype != BF16:
        raise backends.KernelMismatch(f"off the reference for {dtype}")


impls.fast_mla = _fast_mla


@pytest.fixture(scope="module")
def llm(make_ckpt):  # noqa: ANN001, ANN201
    return LLM(make_ckpt("tiny", dtype="bfloat16"), dtype="bfloat16", num_blocks=32, max_num_seqs=BUCKET)


@pytest.fixture
def fast_mla(monkeypatch):  # noqa: ANN001, ANN201
    """``test_fast_mla``'s ``fast`` listed first on the CPU for ``paged_mla_decode`` (``takes``: FlashInfer's
    shape rule, or another given), decided at start-up as the engine's backends are."""

    def install(takes=None) -> None:  # noqa: ANN001
        paged_mla_decode.forget()
        backends.register(backends.KernelOp("test_fast_mla", (backends.KernelBackend("fast", _bf16_only),
                                                              backends.KernelBackend("kernel"))))
        listed = [OpImpl("cpu", f"{impls.__name__}:fast_mla", takes, "skip", ("test_fast_mla", "fast")),
                  *paged_mla_decode.impls["cpu"]]
        monkeypatch.setitem(paged_mla_decode.impls, "cpu", listed)
        paged_mla_decode.forget()
        backends.resolve("cpu", {"test_fast_mla": BF16})

    yield install
    backends.unregister("test_fast_mla")
    paged_mla_decode.forget()


def _decode_calls(llm: LLM, capturing: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The kernel ops one full-bucket decode forward of the tiny model reaches, with the stream's capture state
    simulated (what ``torch.cuda`` and ``kernels.backends`` read); the tables filled anew inside it."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, BUCKET, "cuda_graph")
    ids = torch.arange(1, BUCKET + 1)
    tables = torch.arange(BUCKET * 2).view(BUCKET, 2) % 31 + 1
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        m.setattr(backends, "_capturing", lambda device: capturing)
        for op in ops.defined().values():
            op.forget()  # filled again under this capture state
        with torch.inference_mode(), record_calls() as calls:
            graphs._forward(ids, ids + 2, ids * runner.block_size, ids + 3, tables, "dispatch")
    return calls


def test_the_warm_up_reaches_the_implementations_the_capture_reaches(llm, monkeypatch):  # noqa: ANN001
    warm_up = _decode_calls(llm, False, monkeypatch)
    captured = _decode_calls(llm, True, monkeypatch)
    assert warm_up == captured and len(warm_up) > 20
    assert {name for name, _ in warm_up} >= {"paged_mla_decode", "rms_norm", "grouped_topk", "linear"}


def test_a_listed_backend_runs_in_the_capture_as_in_the_warm_up(llm, fast_mla, monkeypatch):  # noqa: ANN001
    fast_mla()
    warm_up = _decode_calls(llm, False, monkeypatch)
    assert warm_up == _decode_calls(llm, True, monkeypatch)
    layers = llm.config.model.num_hidden_layers
    assert warm_up.count((paged_mla_decode.name, f"{impls.__name__}:fast_mla")) == layers


def test_the_comparison_catches_a_choice_that_depends_on_the_capture(llm, fast_mla, monkeypatch):  # noqa: ANN001
    """The old rule (FlashInfer's ``eligible`` false during a capture): the warm-up ran the backend, the capture
    another kernel; the recorded lists differ."""
    fast_mla(takes=lambda *args, **kwargs: not torch.cuda.is_current_stream_capturing())
    warm_up, captured = _decode_calls(llm, False, monkeypatch), _decode_calls(llm, True, monkeypatch)
    assert warm_up != captured
    assert (paged_mla_decode.name, f"{impls.__name__}:fast_mla") in set(warm_up) - set(captured)


def test_flashinfer_eligibility_reads_shapes_not_the_capture_state(monkeypatch):
    q = torch.empty(2, 16, 576, device="meta")
    cache = torch.empty(8, 16, 576, dtype=BF16, device="meta")
    tables = torch.empty(2, 4, dtype=torch.long, device="meta")
    with trace_as_cuda((9, 0)):
        for capturing in (False, True):
            monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda c=capturing: c)
            assert mf.eligible(q, cache, tables, 512, None)
            assert not mf.eligible(q, cache.to(torch.float8_e4m3fn), tables, 512, torch.tensor(1.0, device="meta"))


# ---- FlashInfer's CUDA-graph-mode plan ---------------------------------------------------------------


def _plain_pages(tables: list[list[int]], lens: list[int], block_size: int) -> tuple[list[int], list[int]]:
    """FlashInfer's page lists built plainly: (kv_indptr, kv_indices); an empty row reads its first block."""
    indptr, indices = [0], []
    for row, n in zip(tables, lens):
        pages = max(1, -(-n // block_size))
        indices += row[:pages]
        indptr.append(indptr[-1] + pages)
    return indptr, indices


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_graph_plan_lists_each_rows_pages_as_a_plain_construction(dtype):
    g = torch.Generator().manual_seed(5)
    tables = torch.randint(0, 1000, (6, 9), generator=g, dtype=dtype)
    lens = (1, 0, 16, 17, 9 * 16, 0)  # padding rows of length 0 among real ones, a full table
    layout = mg.page_layout(lens, 16, tables.shape[1])
    indices = mg.graph_pages(tables, layout.kv_indptr, layout.pages)
    indptr, want = _plain_pages(tables.tolist(), list(lens), 16)
    assert layout.kv_indptr.tolist() == indptr and layout.pages == indptr[-1]
    assert indices.dtype == torch.int32 and indices.tolist() == want
    assert layout.read.tolist() == [1, 1, 16, 17, 144, 1] and layout.empty.tolist() == [n == 0 for n in lens]
    assert layout.read.dtype == layout.kv_indptr.dtype == torch.int32
    with pytest.raises(mg.SeqLensError, match=r"must lie in \[0, 144\]"):
        mg.page_layout((1, 145), 16, 9)


def test_a_wrappers_bytes_grow_with_its_rows_and_table_width():
    assert mg.wrapper_bytes(256, 10240) - mg.INT_WORKSPACE_BYTES >= 256 * 10240 * 4  # kv_indices: every entry
    assert mg.wrapper_bytes(1, 1) > mg.INT_WORKSPACE_BYTES and mg.wrapper_bytes(2, 4) < mg.wrapper_bytes(2, 5)


def test_planning_a_replay_reads_nothing_from_the_device():
    """The planner registered, a replay planned and its page list built on meta tensors standing for CUDA ones
    (values nowhere): any host read of a device value (``.item()``, ``.tolist()``, a data-dependent shape) would
    raise here."""
    assert mg.plan_captured in decode_plan._planners
    lens = (5, 0, 40, 33)
    layout = mg.page_layout(lens, 16, 3)
    with trace_as_cuda((9, 0)):
        tables = torch.zeros(BUCKET, 3, dtype=torch.int32, device="meta")
        seq_lens = torch.zeros(BUCKET, dtype=torch.long, device="meta")
        decode_plan.plan_replay(DecodeReplay(tables, seq_lens, lens, 16))
        assert mg.planned_rows(tables, seq_lens)[0].host_lens == lens  # remembered for the wrappers to plan
        indices = mg.graph_pages(tables, layout.kv_indptr, layout.pages)
        with pytest.raises(RuntimeError, match="meta"):
            tables.tolist()  # what a host read meets here
    assert tuple(indices.shape) == (layout.pages,) == (1 + 1 + 3 + 3,)
    mg._buckets.clear()


def test_a_captured_buckets_rows_are_found_by_their_static_tensors():
    tables, lens = torch.zeros(8, 5, dtype=torch.long), torch.zeros(8, dtype=torch.long)
    bucket = mg.remember(DecodeReplay(tables, lens, (3,) * 8, 16))
    try:
        assert mg.planned_rows(tables, lens) == (bucket, 0)
        assert mg.planned_rows(tables[:8], lens[:8]) == (bucket, 0)
        assert mg.planned_rows(tables[4:], lens[4:]) == (bucket, 4)  # a micro-batch's half
        assert mg.planned_rows(tables[4:], lens[:4]) is None  # rows that do not belong together
        assert mg.planned_rows(tables.clone(), lens) is None  # an eager step's tables
        assert mg.planned_rows(tables[:, :3], lens) is None
        assert mg.remember(DecodeReplay(tables, lens, (4,) * 8, 16)) is bucket and bucket.host_lens == (4,) * 8
    finally:
        mg._buckets.clear()


# ---- CUDA --------------------------------------------------------------------------------------------


@pytest.fixture
def forced_flashinfer(monkeypatch):  # noqa: ANN001, ANN201
    """``EPSERVE_MLA_BACKEND=flashinfer``, the op's tables filled anew under it (and after)."""
    monkeypatch.setenv(env.MLA_BACKEND, "flashinfer")
    paged_mla_decode.forget()
    yield
    paged_mla_decode.forget()
    mg._buckets.clear()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
@pytest.mark.parametrize("heads", [16, 128])
def test_captured_flashinfer_decode_replays_new_lengths(heads, forced_flashinfer):  # noqa: ANN001
    """A captured FlashInfer decode (warm-up, capture, replays), planned through ``decode_plan`` before each,
    against the reference: rows growing, shrinking and padding rows of length 0, block ids shuffled."""
    device, block_size, width = torch.device("cuda"), 16, 8
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(BUCKET * width + 1, block_size, 576, generator=g).to(device, BF16)
    q = torch.randn(BUCKET, heads, 576, generator=g).to(device)
    tables = torch.zeros(BUCKET, width, dtype=torch.int32, device=device)
    lens = torch.zeros(BUCKET, dtype=torch.long, device=device)

    def step(host_lens: tuple[int, ...]) -> None:
        tables.copy_(torch.randperm(BUCKET * width, generator=g).view(BUCKET, width) + 1)
        lens.copy_(torch.tensor(host_lens))
        decode_plan.plan_replay(DecodeReplay(tables, lens, host_lens, block_size))

    def forward() -> torch.Tensor:
        return paged_mla_decode(q, cache, tables, lens, 0.07, 512)

    step((7, 0, 33, 100))
    forward()  # the warm-up: makes and plans the bucket's wrapper
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    for host_lens in ((7, 0, 33, 100), (1, 16, 0, 0), (128, 127, 64, 17), (0, 0, 0, 5)):
        step(host_lens)
        graph.replay()
        want = paged_mla_decode_ref(q.to(BF16).float(), cache, tables, lens, 0.07, 512)
        assert (out - want).abs().max() <= 1e-2 * cache.float().abs().max(), host_lens
        assert all(bool((out[i] == 0).all()) for i, n in enumerate(host_lens) if n == 0)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
def test_flashinfer_inside_a_capture_without_a_plan_raises(forced_flashinfer):  # noqa: ANN001
    device = torch.device("cuda")
    cache = torch.randn(8, 16, 576, device=device).to(BF16)
    q, tables = torch.randn(2, 16, 576, device=device), torch.arange(8, device=device).view(2, 4)
    lens = torch.tensor([5, 40], device=device)
    paged_mla_decode(q, cache, tables, lens, 0.07, 512)  # eager: planned per call
    with pytest.raises(mg.NotPlanned), torch.cuda.graph(torch.cuda.CUDAGraph()):
        paged_mla_decode(q, cache, tables, lens, 0.07, 512)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
def test_flashinfer_engine_captures_its_decode_and_decodes_as_its_eager_run(make_ckpt, forced_flashinfer):  # noqa: ANN001
    """What used to crash in ``probe_graph_memory``: a bf16 engine whose MLA decode is FlashInfer (DeepSeek's 512 +
    64 latent, 16 heads) captures its decode buckets, the captured decode running FlashInfer's graph-mode
    wrappers, and gives its eager run's greedy tokens (one FlashInfer schedule from the same lengths)."""
    ckpt = make_ckpt("tiny", dtype="bfloat16", overrides={"kv_lora_rank": 512, "qk_rope_head_dim": 64,
                                                          "num_attention_heads": 16, "num_key_value_heads": 16})
    prompts, params = [[1, 2, 3, 4], [5, 6, 7], list(range(9, 40))], SamplingParams(max_tokens=6, temperature=0.0)
    kw = {"dtype": "bfloat16", "num_blocks": 64, "max_num_seqs": 4, "device": "cuda"}
    eager = [o.token_ids for o in LLM(ckpt, cuda_graph=False, **kw).generate(prompts, params)]
    llm = LLM(ckpt, **kw)
    assert llm.engine.runner.decode_graphs is not None and llm.engine.runner.decode_graphs.mode == "cuda_graph"
    assert [o.token_ids for o in llm.generate(prompts, params)] == eager
    assert any(bucket.wrappers for bucket in mg._buckets.values() if bucket.alive())
