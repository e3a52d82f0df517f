"""The device block tables' bookkeeping (``engine/block_tables.py``): rows handed out, appended to, trimmed,
freed and reused as the KV cache manager allocates, and every plan's rows read from the device tables equal to
the whole tables a plan built without them carries (``batch_plan.block_tables``); then the engine's step on them:
a captured step's host bytes independent of ``max_model_len``, each captured run planned
(``kernels/decode_plan.py``) on tables already holding its rows, the eager engine's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.engine.batch_plan import BatchPlan
from epserve.engine.block_tables import PAD_ROW, DeviceTables, TableAppends
from epserve.engine.kv_manager import KVCacheManager
from epserve.engine.request import Request, ScheduledChunk
from epserve.kernels import cpu, decode_plan

BS = 4


class _Cache:
    """A KV cache manager and the device tables of one rank, stepped as the engine steps them: plan, apply the
    plan's appends, check every row against the whole-table plan of the same chunks."""

    def __init__(self, num_blocks: int = 64, max_blocks: int = 16, prefix: bool = True) -> None:
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)
        self.tables = DeviceTables(max_blocks, num_blocks, torch.device("cpu"))

    def step(self, chunks: list[ScheduledChunk]) -> BatchPlan:
        plan = BatchPlan.from_chunks(chunks, BS, self.kv.table_rows)
        whole = BatchPlan.from_chunks(chunks, BS)  # the same chunks, whole tables
        assert plan.block_tables == () and len(plan.table_rows) == len(whole.block_tables)
        self.tables.apply(plan.table_appends)
        for row, expected, length in zip(plan.table_rows, whole.block_tables, plan.seq_lens):
            used = -(-length // BS)
            assert self.tables.table[row, :used].tolist() == list(expected[:used])
        assert (self.tables.table[PAD_ROW] == self.tables.sink_block).all()  # the padding row never changes
        for chunk in chunks:
            chunk.request.num_computed_tokens = chunk.end
            self.kv.cache_full_blocks(chunk.request)
        return plan

    def run(self, request: Request, tokens: int) -> ScheduledChunk:
        """Room for ``tokens`` more of ``request`` (its known tokens extended to cover them)."""
        assert self.kv.allocate_slots(request, tokens)
        while request.num_tokens < request.num_computed_tokens + tokens:
            request.append_output_token(7)
        return ScheduledChunk(request, request.num_computed_tokens, tokens)


def _request(rid: str, prompt: int, first: int = 1) -> Request:
    return Request(rid, list(range(first, first + prompt)))


def test_rows_grow_by_the_blocks_each_step_appends():
    cache = _Cache()
    a, b = _request("a", 6), _request("b", 9, first=100)
    plan = cache.step([cache.run(a, 6), cache.run(b, 9)])
    assert plan.table_rows == (1, 2)
    assert plan.table_appends == TableAppends((1, 1, 2, 2, 2), (0, 1, 0, 1, 2), (*a.block_ids, *b.block_ids))
    plan = cache.step([cache.run(a, 1), cache.run(b, 1)])  # a's 7th token: its second block holds it
    assert plan.table_rows == (1, 2) and len(plan.table_appends) == 0  # nothing new: O(1) host values a row
    assert len(cache.step([cache.run(a, 1), cache.run(b, 1)]).table_appends) == 0
    plan = cache.step([cache.run(a, 1), cache.run(b, 1)])  # a's 9th token opens its block 2
    assert plan.table_appends == TableAppends((1,), (2,), (a.block_ids[2],))
    plan = cache.step([cache.run(a, 1), cache.run(b, 1)])  # b's 13th: its block 3
    assert plan.table_appends == TableAppends((2,), (3,), (b.block_ids[3],))


def test_a_freed_row_is_reused_and_its_old_columns_are_never_read():
    cache = _Cache()
    a, b = _request("a", 15), _request("b", 3, first=50)
    cache.step([cache.run(a, 15), cache.run(b, 3)])
    cache.kv.free(a)  # finished: row 1 free again
    assert "a" not in cache.kv.table_rows
    c = _request("c", 5, first=200)
    plan = cache.step([cache.run(b, 1), cache.run(c, 5)])
    assert plan.table_rows == (2, 1)  # c took a's row; its two blocks overwrite columns 0 and 1 only
    assert plan.table_appends == TableAppends((1, 1), (0, 1), tuple(c.block_ids))
    assert cache.tables.table[1, 2:4].tolist() != [cache.tables.sink_block] * 2  # a's stale blocks, past c's length
    assert cache.kv.table_rows.num_rows == 3  # the padding row and two request rows, never more


def test_preemption_releases_the_row_and_the_recompute_appends_every_block_again():
    cache = _Cache(num_blocks=12)
    a = _request("a", 10)
    cache.step([cache.run(a, 10)])
    for _ in range(4):
        cache.step([cache.run(a, 1)])
    cache.kv.free(a)  # preempted: KV dropped, recomputed from the start later
    a.num_computed_tokens = 0
    hit = cache.kv.get_computed_blocks(a)
    assert hit.num_tokens > 0  # its full blocks are still cached: the recompute starts after them
    assert cache.kv.allocate_slots(a, a.num_tokens - hit.num_tokens, hit.block_ids)
    a.num_computed_tokens = hit.num_tokens
    plan = cache.step([ScheduledChunk(a, hit.num_tokens, a.num_tokens - hit.num_tokens)])
    assert plan.table_appends.columns == tuple(range(len(a.block_ids)))  # the hit blocks too: a new row


def test_a_trim_rolls_the_row_back_and_the_reallocated_blocks_are_appended_again():
    """Speculative decoding: a step's lookahead blocks for drafts, freed when the drafts were rejected, then
    other blocks allocated at the same columns (the same length as before: only the bookkeeping knows)."""
    cache = _Cache()
    a = _request("a", 4)
    cache.step([cache.run(a, 4)])
    cache.step([cache.run(a, 5)])  # the verified drafts' room: blocks 1 and 2
    a.num_computed_tokens = 5  # 4 of them rejected
    cache.kv.trim(a)
    assert len(a.block_ids) == 2
    filler = _request("f", 4, first=300)  # takes the freed block before a grows again
    cache.step([cache.run(filler, 4)])
    plan = cache.step([cache.run(a, 5)])
    assert plan.table_appends == TableAppends((1,), (2,), (a.block_ids[2],))
    assert a.block_ids[2] not in filler.block_ids


def test_spec_decode_rows_share_their_request_row():
    cache = _Cache(prefix=False)  # (the drafts' positions are past the known tokens the hashes cover)
    a, b = _request("a", 5), _request("b", 3, first=40)
    cache.step([cache.run(a, 5), cache.run(b, 3)])
    a.append_output_token(9)
    b.append_output_token(9)
    for r in (a, b):
        assert cache.kv.allocate_slots(r, 3)
    plan = cache.step([ScheduledChunk(a, 5, 3, drafts=(1, 2)), ScheduledChunk(b, 3, 3, drafts=(3, 4))])
    assert plan.table_rows == (1, 1, 1, 2, 2, 2)


def test_random_lifetimes_match_the_whole_tables():
    """Requests arriving, growing by chunks and single tokens, finishing, preempted and rolled back at random:
    every step's rows on the device are the whole tables' (checked inside ``_Cache.step``)."""
    rng = random.Random(0)
    cache = _Cache(num_blocks=48, max_blocks=32)
    live: list[Request] = []
    for step in range(200):
        if len(live) < 6 and rng.random() < 0.3:
            live.append(_request(f"r{step}", rng.randint(1, 12), first=rng.choice((1, 500 + step))))
        chunks = []
        for r in list(live):
            action = rng.random()
            if action < 0.05 or r.num_tokens > 100:
                cache.kv.free(r)
                live.remove(r)
            elif action < 0.1 and r.num_computed_tokens:
                cache.kv.free(r)
                r.num_computed_tokens = 0
            elif action < 0.15 and r.num_computed_tokens > 2:
                r.num_computed_tokens -= rng.randint(1, 2)
                cache.kv.trim(r)
            else:
                tokens = rng.randint(1, 6) if r.num_computed_tokens == 0 or rng.random() < 0.2 else 1
                if cache.kv.allocate_slots(r, tokens):
                    while r.num_tokens < r.num_computed_tokens + tokens:
                        r.append_output_token(rng.randint(1, 50))
                    chunks.append(ScheduledChunk(r, r.num_computed_tokens, tokens))
        if chunks:
            cache.step(chunks)
    assert cache.kv.table_rows.num_rows <= 8


def test_device_tables_grow_and_drop_columns_past_their_width():
    tables = DeviceTables(3, 99, torch.device("cpu"), rows=2)
    tables.apply(TableAppends((5, 5, 5, 5), (0, 1, 2, 3), (10, 11, 12, 13)))  # column 3: past max_model_len
    assert tables.table.shape == (6, 3) and tables.table[5].tolist() == [10, 11, 12]
    assert (tables.table[:5] == 99).all()
    out = torch.empty(2, 3, dtype=torch.long)
    tables.gather(torch.tensor([5, PAD_ROW]), out=out)
    assert out.tolist() == [[10, 11, 12], [99, 99, 99]]
    assert tables.select((5, 5), 2).tolist() == [[10, 11], [10, 11]]
    assert tables.staged_bytes == 8 * (3 * 3 + 2)  # the appends kept, then the two rows selected


def test_a_plan_naming_rows_needs_the_device_tables():
    cache = _Cache()
    plan = cache.step([cache.run(_request("a", 3), 3)])
    with pytest.raises(ValueError, match="needs the device tables"):
        plan.to_batch(torch.device("cpu"), BS)
    batch = plan.to_batch(torch.device("cpu"), BS, cache.tables)
    assert batch.block_tables.tolist() == [list(plan.table_appends.blocks)]


# ---- the engine's step on the device tables --------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [42] * 5, list(range(300, 340))]


@pytest.fixture(scope="module")
def long_ckpt(make_ckpt):
    return make_ckpt("tiny", overrides={"max_position_embeddings": 65536})  # float32


def _generate(llm, prompts: list[list[int]], max_tokens: int, planned: list | None = None) -> dict:
    """``llm``'s engine stepped to the end of ``prompts`` (greedy) with its plans built on the leader's
    device-table rows (``BatchPlan.from_chunks`` with the KV cache manager's ``TableRows``); per captured step
    the host bytes staged to the device. ``planned``: each step's whole-table plan appended before its forward
    (what a planner compares the device tables with)."""
    engine, runner = llm.engine, llm.engine.runner
    scheduler = engine.scheduler
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    staged: list[tuple[int, int]] = []  # (rows, bytes) of each captured step
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        chunks = list(output.chunks)
        plan = BatchPlan.from_chunks(chunks, runner.block_size, scheduler.kv_manager.table_rows)
        if planned is not None:
            planned.append(BatchPlan.from_chunks(chunks, runner.block_size))
        decode = plan.num_decode_seqs == len(plan.seq_lens)
        before = runner.tables.staged_bytes
        hidden = runner.forward(plan, plan.num_tokens, all_decode=decode)
        if runner._replay_bucket(plan.num_tokens, decode, runner._step_shape(plan.num_tokens)[1]) is not None:
            staged.append((len(plan.seq_lens), runner.tables.staged_bytes - before))
        result = engine.sampling.sample(chunks, hidden, plan)
        scheduler.update(output, result.sampled, result.logprobs, None, result.prompt_logprobs)
    return {"tokens": [r.output_token_ids for r in requests], "staged": staged}


needs_cpu_graph = pytest.mark.skipif(not (cpu.available(cpu.OPS) and cpu.available(torch.float32)),
                                     reason="the CPU graph records the C kernels: AVX2, a compiler")


@needs_cpu_graph
def test_a_captured_steps_host_bytes_do_not_grow_with_max_model_len(long_ckpt):
    """The same requests at a 1,024- and a 65,536-token context limit: every captured step stages the same
    bytes, its O(bucket) values (five int64 a row: token, position, slot, length, table row) and the blocks
    appended that step, never a [bucket, max_model_len / block_size] table; the tokens are the eager engine's."""
    kw = dict(dtype="float32", num_blocks=128, block_size=4)
    eager = _generate(LLM(long_ckpt, cuda_graph=False, **kw), PROMPTS, 12)
    runs = {n: _generate(LLM(long_ckpt, max_model_len=n, **kw), PROMPTS, 12) for n in (1024, 65536)}
    assert LLM(long_ckpt, max_model_len=65536, **kw).engine.runner.tables.max_blocks == 65536 // 4
    short, long = runs[1024]["staged"], runs[65536]["staged"]
    assert len(short) >= 10 and short == long
    for rows, staged in short:
        assert staged <= 8 * (5 * rows + 3 * rows)  # at most one new block a row
    assert runs[1024]["tokens"] == runs[65536]["tokens"] == eager["tokens"]


@pytest.mark.parametrize("mode", ["cpu_graph", "compile"])
def test_each_captured_run_is_planned_on_tables_holding_its_rows(long_ckpt, mode, monkeypatch):
    """A planner registered with ``kernels.decode_plan`` is called before every run of a bucket (a CPU graph's
    recording and each replay; each call of the compiled forward), with the bucket's lengths on the host and
    the static tables already holding the step's rows."""
    if mode == "cpu_graph" and not (cpu.available(cpu.OPS) and cpu.available(torch.float32)):
        pytest.skip("the CPU graph records the C kernels: AVX2, a compiler")
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")  # the fullgraph trace, without inductor's codegen
    llm = LLM(long_ckpt, dtype="float32", num_blocks=128, block_size=4, max_num_seqs=4, compile=mode == "compile")
    assert llm.engine.runner.captured.mode == mode
    planned: list[BatchPlan] = []
    seen: list[tuple[int, tuple[int, ...]]] = []

    def planner(replay: decode_plan.DecodeReplay) -> None:
        whole = planned[-1]
        n = len(whole.seq_lens)
        assert replay.host_seq_lens == (*whole.seq_lens, *(0,) * (replay.bucket - n))
        assert replay.seq_lens.tolist() == list(replay.host_seq_lens)
        assert replay.block_size == 4 and replay.block_tables.shape == (replay.bucket, 65536 // 4)
        for i, (length, blocks) in enumerate(zip(whole.seq_lens, whole.block_tables)):
            used = -(-length // 4)
            assert replay.block_tables[i, :used].tolist() == list(blocks[:used])
        seen.append((replay.bucket, replay.host_seq_lens))

    decode_plan.register(planner)
    try:
        out = _generate(llm, PROMPTS, 6, planned)
    finally:
        decode_plan.unregister(planner)
    assert len(seen) == len(out["staged"]) >= 5  # once a captured step: recording or replay, compiled call
    assert {bucket for bucket, _ in seen} >= {4}


def test_the_memory_plan_counts_the_tables_and_flashinfers_graph_wrappers(monkeypatch):
    """What the decode allocates after the pool is sized: the device tables always; with FlashInfer decoding
    inside captured graphs, one graph-mode wrapper per bucket and set (the MTP passes have their own)."""
    from epserve.engine.captured import CaptureShape, side_buffer_bytes
    from epserve.engine.graphs import decode_buckets
    from epserve.kernels import mla_flashinfer_graph, ops

    shape = CaptureShape(64, 16, 10240, 7168, torch.bfloat16, torch.device("cuda"), lambda n: "none",
                         lambda b: None)
    table = 257 * 10240 * 8
    monkeypatch.setattr(ops.mla_decode, "chosen", lambda where, dtype: [
        "epserve.kernels.mla_decode_triton:paged_mla_decode_triton"])
    assert side_buffer_bytes(shape, "cuda_graph", True, torch.bfloat16, 257) == table
    monkeypatch.setattr(ops.mla_decode, "chosen", lambda where, dtype: [
        "epserve.kernels.mla_flashinfer:paged_mla_decode_fi", "epserve.kernels.mla_decode_triton:x"])
    wrappers = sum(mla_flashinfer_graph.wrapper_bytes(b, 10240) for b in decode_buckets(64))
    assert wrappers > 0
    assert side_buffer_bytes(shape, "cuda_graph", False, torch.bfloat16, 257) == table + wrappers
    assert side_buffer_bytes(shape, "cuda_graph", True, torch.bfloat16, 257) == table + 2 * wrappers
    assert side_buffer_bytes(shape, None, True, torch.bfloat16, 257) == table  # eager decode: no graph wrappers
