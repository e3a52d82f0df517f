"""The scheduler tests' fake model and runner, and helpers that build a scheduler, make requests and step it."""

from __future__ import annotations

from collections.abc import Callable

from epserve.config import CacheConfig, SchedulerConfig
from epserve.engine.request import Request
from epserve.engine.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from epserve.messages.sampling import SamplingParams

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
