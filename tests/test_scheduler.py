from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from epserve.config import CacheConfig, SchedulerConfig
from epserve.engine.request import Request, RequestStatus, SamplingParams
from epserve.engine.scheduler import RequestUpdate, ScheduledChunk, Scheduler, SchedulerOutput

EOS = 2


def next_token(history: list[int]) -> int:
    """The fake model: a deterministic function of the whole token history, never EOS."""
    return (sum(history) * 31 + len(history) * 7) % 1000 + 10


class FakeRunner:
    """Stands in for the model runner. It writes each chunk's tokens into a fake paged cache through
    the slot mapping and predicts from what it reads back, so a wrong block table, a wrongly shared
    block or an overwritten block changes (or breaks) the output."""

    def __init__(self, block_size: int, model: Callable[[list[int]], int] = next_token) -> None:
        self.block_size = block_size
        self.model = model
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token)

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        bs = self.block_size
        for c in out.chunks:
            for pos, slot, tok in zip(range(c.start, c.end), c.slot_ids(bs), c.token_ids):
                self.kv[slot] = (pos, tok)
        sampled = {}
        for c in out.chunks:
            if c.needs_sample:
                table = c.request.block_ids
                context = [self.kv[table[p // bs] * bs + p % bs] for p in range(c.end)]
                assert context == list(enumerate(c.request.all_token_ids))
                sampled[c.request.request_id] = self.model([t for _, t in context])
        return sampled


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    prefix: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix),
        num_blocks,
        max_model_len,
    )


def req(rid: str, prompt: list[int] | range, max_tokens: int = 8, **kw: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids=(EOS,))


def view(out: SchedulerOutput) -> list[ChunkView]:
    """The chunks as (request id, start, num_tokens, is_prefill, needs_sample); valid only before
    ``update``, which appends to the requests."""
    return [(c.request.request_id, c.start, c.num_tokens, c.is_prefill, c.needs_sample) for c in out.chunks]


ChunkView = tuple[str, int, int, bool, bool]


def step(s: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[RequestUpdate], list[ChunkView]]:
    """One engine step; also returns ``view(out)`` taken before ``update``."""
    # a prefill stops short only when the budget runs out: at most one is ever unfinished
    assert sum(r.num_computed_tokens < r.num_tokens - 1 or r.num_output_tokens == 0 for r in s.running) <= 1
    out = s.schedule()
    seen = view(out)
    assert out.num_batched_tokens == sum(c.num_tokens for c in out.chunks)
    assert out.num_batched_tokens <= s.config.max_num_batched_tokens
    assert len(s.running) <= s.config.max_num_seqs
    return out, s.update(out, runner.execute(out)), seen


def run_all(s: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return outs
        outs.append(step(s, runner)[0])
    raise AssertionError("scheduler did not finish")


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(max_tokens):
        history.append(next_token(history))
    return history[len(prompt) :]


def test_chunked_prefill_tiles_the_prompt() -> None:
    s = make_scheduler(budget=8)
    r = req("a", range(50), max_tokens=3)
    s.add_request(r)
    runner = FakeRunner(4)
    chunks: list[ChunkView] = []
    tiled: list[int] = []
    while r.num_output_tokens == 0:
        out, _, seen = step(s, runner)
        assert len(seen) == 1
        chunks.extend(seen)
        tiled.extend(out.chunks[0].token_ids)
    expected = [(i, 8, True, False) for i in range(0, 48, 8)] + [(48, 2, True, True)]
    assert [c[1:] for c in chunks] == expected
    assert tiled == list(range(50))
    assert step(s, runner)[2] == [("a", 50, 1, False, True)]


def test_budget_smaller_than_any_prompt_still_works() -> None:
    s = make_scheduler(budget=3, block_size=2)
    prompts = {"a": list(range(10, 21)), "b": list(range(30, 37))}
    for rid, p in prompts.items():
        s.add_request(req(rid, p, max_tokens=4))
    done: dict[str, list[int]] = {rid: [] for rid in prompts}
    runner = FakeRunner(2)
    while s.has_unfinished_requests():
        _, updates, _ = step(s, runner)
        for u in updates:
            done[u.request_id].extend(u.new_token_ids)
    assert done == {rid: reference(p, 4) for rid, p in prompts.items()}


def test_continuous_batching_admits_while_others_decode_and_decodes_come_first() -> None:
    s = make_scheduler(budget=16)
    runner = FakeRunner(4)
    s.add_request(req("a", range(5), max_tokens=20))
    step(s, runner)
    step(s, runner)  # a is decoding
    s.add_request(req("b", range(100, 140), max_tokens=5))
    assert step(s, runner)[2] == [("a", 6, 1, False, True), ("b", 0, 15, True, False)]
    s.add_request(req("c", range(200, 210), max_tokens=5))
    # a's decode first, then b's unfinished prefill takes the rest: c waits
    assert step(s, runner)[2] == [("a", 7, 1, False, True), ("b", 15, 15, True, False)]
    assert s.num_waiting == 1
    # b's last prefill chunk and c's first share the step with a's decode
    assert step(s, runner)[2] == [
        ("a", 8, 1, False, True),
        ("b", 30, 10, True, True),
        ("c", 0, 5, True, False),
    ]
    assert step(s, runner)[2] == [
        ("a", 9, 1, False, True),
        ("b", 40, 1, False, True),
        ("c", 5, 5, True, True),
    ]


def test_preemption_by_recompute_and_resume() -> None:
    s = make_scheduler(num_blocks=6, block_size=4, prefix=False)
    runner = FakeRunner(4)
    a, b = req("a", range(8), max_tokens=12), req("b", range(100, 108), max_tokens=12)
    s.add_request(a)
    s.add_request(b)
    while True:
        out, _, seen = step(s, runner)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ("b",)  # the most recently arrived
    assert s.num_preemptions_total == 1
    assert [(c[0], c[3]) for c in seen] == [("a", False)]
    assert b.status is RequestStatus.WAITING and list(s.waiting) == [b]
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    outputs_at_preemption = list(b.output_token_ids)
    assert outputs_at_preemption  # kept
    resumed = None
    while resumed is None:
        out = s.schedule()
        resumed = next((c for c in out.chunks if c.request is b), None)
        if resumed is not None:
            # the recompute covers prompt + outputs in one chunk and samples the next token
            assert (resumed.start, resumed.num_tokens) == (0, 8 + len(outputs_at_preemption))
            assert resumed.token_ids == list(range(100, 108)) + outputs_at_preemption
            assert resumed.is_prefill and resumed.needs_sample
        s.update(out, runner.execute(out))
    run_all(s, runner)
    assert a.output_token_ids == reference(list(range(8)), 12)
    assert b.output_token_ids == reference(list(range(100, 108)), 12)
    assert s.kv_manager.num_free_blocks == 6


def test_request_may_preempt_itself() -> None:
    s = make_scheduler(num_blocks=5, block_size=4, prefix=False)
    runner = FakeRunner(4)
    s.add_request(req("a", range(6), max_tokens=4))  # 2 blocks, room for 2 more tokens
    s.add_request(req("b", range(50, 62), max_tokens=4))  # 3 full blocks
    step(s, runner)
    assert s.kv_manager.num_free_blocks == 0
    out, _, seen = step(s, runner)  # b's next token needs a 4th block; it is the newest, so it yields
    assert out.preempted_ids == ("b",)
    assert seen == [("a", 6, 1, False, True)]
    run_all(s, runner)


def test_unfinished_prefill_waits_for_blocks_without_preempting() -> None:
    s = make_scheduler(num_blocks=7, block_size=4, budget=5, prefix=False)
    runner = FakeRunner(4)
    a, b = req("a", range(15), max_tokens=5), req("b", range(100, 112), max_tokens=3)
    s.add_request(a)
    step(s, runner)
    s.add_request(b)
    for _ in range(4):
        step(s, runner)
    assert (b.num_computed_tokens, len(b.block_ids), s.kv_manager.num_free_blocks) == (8, 2, 0)
    _, _, seen = step(s, runner)  # b's next chunk needs a third block: it waits, keeping its KV
    assert seen == [("a", 17, 1, False, True)]
    assert (b.num_computed_tokens, len(b.block_ids), b.num_preemptions) == (8, 2, 0)
    run_all(s, runner)
    assert b.output_token_ids == reference(list(range(100, 112)), 3) and s.num_preemptions_total == 0


def test_preempted_requests_return_to_the_queue_front_in_arrival_order() -> None:
    s = make_scheduler(num_blocks=7, block_size=2, prefix=False, max_num_seqs=3)
    runner = FakeRunner(2)
    reqs = [req(str(i), range(10 * i, 10 * i + 4), max_tokens=8) for i in range(3)]  # 2 blocks each
    late = req("late", [1, 2, 3], max_tokens=2)
    for r in reqs:
        s.add_request(r)
    step(s, runner)
    s.add_request(late)
    step(s, runner)  # 0 gets the last block, 1 preempts 2, itself a decode
    seen = []
    for _ in range(3):
        out, _, _ = step(s, runner)
        seen.extend(out.preempted_ids)
    assert seen, "expected preemptions"
    waiting_ids = [r.request_id for r in s.waiting]
    assert waiting_ids[-1] == "late"
    assert waiting_ids[:-1] == sorted(waiting_ids[:-1])
    run_all(s, runner)
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 8)


def test_fifo_head_blocks_smaller_requests_behind_it() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, prefix=False)
    runner = FakeRunner(4)
    s.add_request(req("a", range(20), max_tokens=4))
    step(s, runner)
    s.add_request(req("big", range(100, 116), max_tokens=4))  # 4 blocks, only 2 free after a's decode
    s.add_request(req("small", [1, 2], max_tokens=4))
    out, _, _ = step(s, runner)
    assert [c.request.request_id for c in out.chunks] == ["a"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    run_all(s, runner)


def test_max_num_seqs_limits_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    prompts = {str(i): list(range(i, i + 5)) for i in range(5)}
    for rid, p in prompts.items():
        s.add_request(req(rid, p, max_tokens=3))
    out, _, _ = step(s, runner)
    assert len(out.chunks) == 2 and s.num_running == 2 and s.num_waiting == 3
    got: dict[str, list[int]] = {}
    while s.has_unfinished_requests():
        _, updates, _ = step(s, runner)
        for u in updates:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert len(got) == 5


def test_abort_frees_everything_and_is_reported_once() -> None:
    s = make_scheduler(num_blocks=32, budget=8)
    runner = FakeRunner(4)
    s.add_request(req("a", range(30), max_tokens=50))
    b = req("b", range(30), max_tokens=50)
    s.add_request(b)  # shares a's cached prefix
    s.add_request(req("w", range(5), max_tokens=5))
    for _ in range(6):
        step(s, runner)
    assert s.kv_manager.num_free_blocks < 32
    assert s.abort_request("a") and s.abort_request("w")
    assert not s.abort_request("a") and not s.abort_request("nope")
    out = s.schedule()
    assert s.has_unfinished_requests()  # the aborts are not reported yet
    assert s.abort_request("b")  # after schedule, before update: its chunk is ignored ...
    assert b.block_ids  # ... but its blocks stay valid for the forward in flight
    updates = s.update(out, runner.execute(out))
    assert sorted((u.request_id, u.new_token_ids, u.finished, u.finish_reason) for u in updates) == [
        ("a", (), True, "abort"),
        ("b", (), True, "abort"),
        ("w", (), True, "abort"),
    ]
    assert not s.has_unfinished_requests()
    assert s.update(s.schedule(), {}) == []
    assert s.kv_manager.num_free_blocks == 32 and s.kv_manager.usage == 0.0


def scripted(prompt_len: int, script: list[int]) -> Callable[[list[int]], int]:
    return lambda history: script[len(history) - prompt_len]


@pytest.mark.parametrize(
    "params, script, expected, reason, max_model_len",
    [
        (dict(max_tokens=10), [11, 12, EOS, 13], [11, 12, EOS], "stop", 64),
        (
            dict(max_tokens=5, ignore_eos=True),
            [11, EOS, 12, EOS, 13, 14],
            [11, EOS, 12, EOS, 13],
            "length",
            64,
        ),
        (dict(max_tokens=10, stop_token_ids=[12]), [11, 12, 13], [11, 12], "stop", 64),
        (dict(max_tokens=10, ignore_eos=True, stop_token_ids=[EOS]), [11, EOS], [11, EOS], "stop", 64),
        (dict(max_tokens=10), [11, 3, 12], [11, 3], "stop", 64),  # a second EOS id
        (dict(max_tokens=1), [11, 12], [11], "length", 64),
        (dict(max_tokens=100), list(range(20, 40)), [20, 21], "length", 12),  # the context limit
        (dict(max_tokens=2), [20, EOS, 3], [20, EOS], "stop", 12),  # stop wins over length
    ],
)
def test_stop_conditions(
    params: dict, script: list[int], expected: list[int], reason: str, max_model_len: int
) -> None:
    s = make_scheduler(num_blocks=16, max_model_len=max_model_len)
    runner = FakeRunner(4, scripted(10, script))
    r = Request("r", range(10), SamplingParams(**params), eos_token_ids=(EOS, 3))
    s.add_request(r)
    updates: list[RequestUpdate] = []
    while s.has_unfinished_requests():
        updates.extend(step(s, runner)[1])
    assert [t for u in updates for t in u.new_token_ids] == expected == r.output_token_ids
    assert [u.finished for u in updates] == [False] * (len(expected) - 1) + [True]
    assert updates[-1].finish_reason == reason == r.finish_reason
    assert r.num_tokens <= max_model_len
    assert s.kv_manager.num_free_blocks == 16 and s.num_running == 0


def test_prefix_reuse_shares_blocks() -> None:
    s = make_scheduler(num_blocks=32, block_size=16)
    runner = FakeRunner(16)
    prefix = list(range(500, 540))
    first = req("first", prefix, max_tokens=4)
    s.add_request(first)
    step(s, runner)  # first's prompt is computed and its two full blocks cached
    second = req("second", prefix + [1, 2, 3, 4, 5], max_tokens=4)
    s.add_request(second)
    out, _, _ = step(s, runner)
    chunk = next(c for c in out.chunks if c.request is second)
    assert (chunk.start, chunk.num_tokens) == (32, 13)
    assert second.num_cached_tokens == 32 and first.num_cached_tokens == 0
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    assert s.kv_manager.block_pool.ref_count(first.block_ids[0]) == 2
    run_all(s, runner)
    assert second.output_token_ids == reference(prefix + [1, 2, 3, 4, 5], 4)
    # both finished: the cached blocks stay reusable
    third = req("third", prefix, max_tokens=2)
    s.add_request(third)
    run_all(s, runner)
    assert third.num_cached_tokens == 32  # 40 tokens: the last one is never a hit
    assert s.kv_manager.num_prefix_hit_tokens == 64
    assert s.kv_manager.num_free_blocks == 32


def test_bad_prompts_raise() -> None:
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        s.add_request(req("e", []))
    with pytest.raises(ValueError, match="prompt has 64 tokens; the context is 64"):
        s.add_request(req("long", range(64)))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("pool", range(10), max_tokens=10))  # 19 tokens of KV > 16 slots
    s.add_request(req("fits", range(10), max_tokens=7))  # 16 tokens of KV: exactly the pool
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("fits", range(3)))
    assert s.num_waiting == 1


def test_context_overflow_allowed_and_truncated() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=16)
    r = req("r", range(10), max_tokens=1000)
    s.add_request(r)
    run_all(s, FakeRunner(4))
    assert r.num_tokens == 16 and r.finish_reason == "length"


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_matches_reference(seed: int) -> None:
    """Tight pool, tiny budget, shared prefixes: whatever the schedule (preemptions, prefix hits,
    evictions), every request gets exactly the tokens the model would produce alone, and the pool
    ends empty."""
    rng = random.Random(seed)
    block_size = 4
    s = make_scheduler(num_blocks=24, block_size=block_size, budget=rng.choice([5, 9, 16]), max_num_seqs=6)
    runner = FakeRunner(block_size)
    stems = [[rng.randrange(10, 1000) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    pending = []
    for i in range(20):
        prompt = rng.choice(stems) + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 12))]
        max_tokens = rng.randrange(1, 30)
        pending.append(req(f"r{i}", prompt, max_tokens=max_tokens))
        expected[f"r{i}"] = reference(prompt, max_tokens)
    num_preemptions = 0
    while pending or s.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                s.add_request(pending.pop(0))
        out, updates, seen = step(s, runner)
        num_preemptions += len(out.preempted_ids)
        assert [c[3] for c in seen] == sorted(c[3] for c in seen)  # decodes first
        for u in updates:
            got.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert got == expected
    assert num_preemptions > 0
    assert s.kv_manager.num_prefix_hit_tokens > 0
    assert s.kv_manager.num_free_blocks == 24


def test_chunk_properties() -> None:
    r = Request("r", range(10))
    r.block_ids = [5, 2, 7]
    whole = ScheduledChunk(r, 0, 10)
    assert whole.is_prefill and whole.needs_sample and whole.end == 10
    assert whole.slot_ids(4) == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    part = ScheduledChunk(r, 4, 3)
    assert part.token_ids == [4, 5, 6] and part.is_prefill and not part.needs_sample
    assert ScheduledChunk(r, 9, 1).is_prefill  # the last prompt token alone is still a prefill
    r.append_output_token(42)
    decode = ScheduledChunk(r, 10, 1)
    assert not decode.is_prefill and decode.needs_sample and decode.token_ids == [42]


def test_abort_waiting_request_and_empty_steps() -> None:
    s = make_scheduler()
    s.add_request(req("a", range(5)))
    assert s.abort_request("a")
    out = s.schedule()
    assert out.chunks == () and out.num_batched_tokens == 0 and out.is_empty
    assert s.update(out, {}) == [RequestUpdate("a", (), True, "abort")]
    assert not s.has_unfinished_requests() and s.num_waiting == 0
    s.add_request(req("a", range(5)))  # the id is free again


def test_update_misuse_is_caught() -> None:
    s = make_scheduler()
    s.add_request(req("a", range(5)))
    out = s.schedule()
    with pytest.raises(KeyError, match="no sampled token"):
        s.update(out, {})
    s = make_scheduler()
    s.add_request(req("a", range(5)))
    out = s.schedule()
    s.update(out, {"a": 11})
    with pytest.raises(RuntimeError, match="exactly once"):
        s.update(out, {"a": 11})


def test_logprobs_are_attached_to_the_request() -> None:
    s = make_scheduler()
    r = req("a", range(5), max_tokens=2)
    s.add_request(r)
    for lp in ("first", "second"):
        out = s.schedule()
        s.update(out, {"a": 11}, {"a": lp})
    assert r.output_logprobs == ["first", "second"] and r.finish_reason == "length"
