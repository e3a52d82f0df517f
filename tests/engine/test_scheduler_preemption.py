"""The scheduler under KV-block pressure and aborts: preemption by recompute and resumption, the waiting
queue's order, aborts freeing everything, and a random workload that must match the reference model."""

from __future__ import annotations

import random

import pytest
from scheduler_harness import FakeRunner, make_scheduler, reference, req, run_all, step

from epserve.engine.request import RequestStatus
from epserve.engine.scheduler import RequestUpdate


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


def test_abort_waiting_request_and_empty_steps() -> None:
    s = make_scheduler()
    s.add_request(req("a", range(5)))
    assert s.abort_request("a")
    out = s.schedule()
    assert out.chunks == () and out.num_batched_tokens == 0 and out.is_empty
    assert s.update(out, {}) == [RequestUpdate("a", (), True, "abort")]
    assert not s.has_unfinished_requests() and s.num_waiting == 0
    s.add_request(req("a", range(5)))  # the id is free again


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
