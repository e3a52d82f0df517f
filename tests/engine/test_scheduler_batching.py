"""The scheduler's batching: chunked prefill under the token budget, continuous batching, FIFO admission,
stop conditions, prefix reuse, request validation, and the chunk / update bookkeeping."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from scheduler_harness import EOS, ChunkView, FakeRunner, make_scheduler, reference, req, run_all, step

from epserve.engine.request import Request, check_prompt
from epserve.engine.scheduler import RequestUpdate, ScheduledChunk
from epserve.messages.sampling import SamplingParams


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
    """``check_prompt`` (the one check, in ``LLMEngine.check_request``) refuses a prompt that can never
    run; the scheduler trusts a checked request, but not an id in use."""

    def check(r: Request) -> None:
        check_prompt(r.request_id, r.num_prompt_tokens, r.sampling_params.max_tokens, 64, 4, 4)

    with pytest.raises(ValueError, match="empty"):
        check(req("e", []))
    with pytest.raises(ValueError, match="prompt has 64 tokens; the context is 64"):
        check(req("long", range(64)))
    with pytest.raises(ValueError, match="KV blocks"):
        check(req("pool", range(10), max_tokens=10))  # 19 tokens of KV > 16 slots
    check(req("fits", range(10), max_tokens=7))  # 16 tokens of KV: exactly the pool
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    s.add_request(req("fits", range(10), max_tokens=7))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("fits", range(3)))
    assert s.num_waiting == 1


def test_context_overflow_allowed_and_truncated() -> None:
    s = make_scheduler(num_blocks=8, block_size=4, max_model_len=16)
    r = req("r", range(10), max_tokens=1000)
    s.add_request(r)
    run_all(s, FakeRunner(4))
    assert r.num_tokens == 16 and r.finish_reason == "length"


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
