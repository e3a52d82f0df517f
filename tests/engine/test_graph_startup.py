"""The captured decode's start-up: which buckets are captured with which schedule, the KV pool sized
after what the graphs need, every bucket run once largest first, and the shared expert on a second
stream (in place off CUDA, concurrent and captured on CUDA)."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.config import CacheConfig, ModelConfig, OutOfMemoryError
from epserve.engine import memory
from epserve.engine.graphs import DecodeGraphs, bucket_schedules
from epserve.kernels import decode_plan
from epserve.model.streams import SideStream
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.parallel.overlap import choose_overlap
from epserve.presets import build_config

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300]]


def test_bucket_schedules_follow_the_smallest_step_of_each_bucket():
    """auto with a micro-batch threshold of 10 tokens: bucket 8 serves 5..8 tokens (dispatch overlap),
    16 serves 9..16 (9 still below the threshold: captured with dispatch overlap, the steps of 10..16 run
    micro-batches eagerly), 24 serves 17..24 (all micro-batched: not captured)."""
    schedules = bucket_schedules((1, 2, 4, 8, 16, 24), lambda tokens: choose_overlap("auto", tokens, 10))
    assert schedules == {1: "dispatch", 2: "dispatch", 4: "dispatch", 8: "dispatch", 16: "dispatch"}
    assert bucket_schedules((1, 2), lambda tokens: choose_overlap("microbatch", tokens, None)) == {}
    assert bucket_schedules((1, 8), lambda tokens: choose_overlap("none", tokens, None)) == {1: "none", 8: "none"}


def test_the_kv_pool_is_sized_after_the_graphs(monkeypatch):
    """What the probe capture measured comes off what the budget leaves for the cache, and a budget the
    graphs exhaust is a clear error naming them."""
    model, gib, cpu = ModelConfig.from_dict(build_config("tiny")), 2**30, torch.device("cpu")
    monkeypatch.setattr(memory, "total_memory", lambda device: 10 * gib)
    monkeypatch.setattr(memory, "available_memory", lambda device: 8 * gib)
    per_block = memory.kv_bytes_per_block(model, 16, torch.float32)

    def blocks(reserved: int, **cache) -> int:
        return memory.determine_num_blocks(model, CacheConfig(**cache), torch.float32, cpu, gib, 10**9,
                                           reserved_bytes=reserved)

    assert blocks(0, memory_fraction=0.5) == int(4 * gib * 0.9) // per_block
    assert blocks(gib, memory_fraction=0.5) == int(3 * gib * 0.9) // per_block
    assert blocks(gib) == int((0.5 * 8 * gib - gib) * 0.9) // per_block
    with pytest.raises(OutOfMemoryError, match="the decode graphs 4096.0 MiB"):
        blocks(4 * gib, memory_fraction=0.5)


def test_the_dispatchers_workspace_comes_off_the_kv_cache(make_ckpt, monkeypatch):
    """A dispatcher holding N bytes of buffers (symm_mem's symmetric ones, allocated before the pool is sized)
    leaves N bytes less for the KV cache under a memory budget (beside the device block tables, counted too)."""
    ckpt, budget, n = make_ckpt("tiny"), 48 * 2**20, 16 * 2**20

    def runner():
        return LLM(ckpt, dtype="float32", memory_budget_bytes=budget, cuda_graph=False).engine.runner

    def blocks(runner, left: int) -> int:
        per_block = memory.kv_bytes_per_block(runner.config.model, runner.block_size, runner.kv_dtype,
                                              runner.num_cache_layers)
        tables = runner.tables.table.numel() * runner.tables.table.element_size()
        return int((left - tables) * (1 - memory._ACTIVATION_RESERVE)) // per_block

    plain = runner()
    assert plain.dispatcher.workspace_bytes() == 0
    assert plain.num_blocks == blocks(plain, budget - plain.weight_bytes)  # (not capped by the scheduler's need)
    monkeypatch.setattr(LocalDispatcher, "workspace_bytes", lambda self: n)
    held = runner()
    assert held.dispatcher.workspace_bytes() == n
    assert held.num_blocks == blocks(held, budget - held.weight_bytes - n) < plain.num_blocks


def test_warm_up_runs_every_bucket_once_largest_first(make_ckpt, monkeypatch):
    """On the CPU the same start-up pass compiles the buckets (the engine leaves compiling to a bucket's
    first use; this is the path CUDA graphs take at start-up): largest first, each bucket warm afterwards,
    and decoding through the warmed graph gives the eager engine's tokens."""
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")  # the fullgraph trace, without inductor's codegen
    ckpt = make_ckpt("tiny")
    params = SamplingParams(max_tokens=3, temperature=0.0)
    want = [o.token_ids for o in LLM(ckpt, dtype="float32", num_blocks=64).generate(PROMPTS, params)]
    llm = LLM(ckpt, dtype="float32", num_blocks=64, compile=True, cuda_graph_max_bs=2)
    runner = llm.engine.runner
    graphs: DecodeGraphs = runner.decode_graphs
    assert runner.captured.drafts is None  # (no MTP)
    schedules = runner.captured.schedules(graphs)
    assert schedules == {1: "dispatch", 2: "dispatch"}
    warm = graphs.warm_up(runner.captured.empty, {2: "dispatch"})
    assert warm.buckets == (2,) and warm.memory_bytes == 0 and graphs._warm == {(2, "dispatch")}
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    assert graphs._warm == {(2, "dispatch")}  # the steps replayed the warmed bucket: nothing new compiled


def test_the_side_stream_runs_in_place_off_cuda():
    x = torch.randn(3, 4)
    forked = SideStream().start(lambda t: t * 2, x)
    assert forked.done is None and torch.equal(SideStream.join(forked), x * 2)


@pytest.mark.cuda
def test_the_side_stream_is_concurrent_and_captured():
    """On CUDA the function runs on another stream, ordered after the main stream's earlier work and
    before the main stream's later use; inside a captured graph the replay gives the same result."""
    side = SideStream()
    x = torch.randn(256, 256, device="cuda")
    y = x @ x  # main-stream work the side stream must wait for
    forked = side.start(lambda t: t @ t, y)
    assert forked.done is not None
    torch.testing.assert_close(SideStream.join(forked), (x @ x) @ (x @ x))
    static = torch.randn(64, 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side.start(lambda t: t + 1, static)  # warm-up outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = SideStream.join(side.start(lambda t: t * 3, static)) + 1
    static.copy_(torch.ones(64, 64, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, torch.full((64, 64), 4.0, device="cuda"))


@pytest.mark.cuda
def test_a_buckets_warm_up_run_and_capture_take_the_same_inputs_and_planning(make_ckpt):
    """CUDA: a bucket's first run is planned, run once on a side stream and captured on the same static inputs
    (each plan made outside the capture), then planned again before its replay; a later step plans and
    replays alone."""
    llm = LLM(make_ckpt("tiny"), dtype="bfloat16", device="cuda", num_blocks=64, max_num_seqs=2)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, 2, "cuda_graph", tables=runner.tables)
    calls = []

    def planner(replay: decode_plan.DecodeReplay) -> None:
        calls.append((replay.bucket, replay.host_seq_lens, replay.block_tables.data_ptr(), replay.seq_lens.data_ptr(),
                      torch.cuda.is_current_stream_capturing()))

    decode_plan.register(planner)
    try:
        first = graphs.run(runner.captured.empty(2), "dispatch").clone()
        assert len(calls) == 3 and len(graphs._graphs) == 1  # warm-up, capture, replay
        again = graphs.run(runner.captured.empty(2), "dispatch")
    finally:
        decode_plan.unregister(planner)
    assert len(calls) == 4 and len(set(calls)) == 1 and calls[0][:2] == (2, (0, 0)) and calls[0][4] is False
    torch.testing.assert_close(again, first)
