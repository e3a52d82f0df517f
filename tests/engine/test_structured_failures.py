"""How constrained requests fail, wait and reuse in the engine: constraints that leave no token (against
min_tokens, bad_words) or a token the grammar refuses fail their request alone, never the step; grammars
compile off the step loop (a slow one holds nobody back, an abort frees it, a second identical one is
cached); a constrained request reuses the prefix cache. The grammar worker that compiles them: a compile
that crashes (a JSON-schema pattern of 30,000 nested groups overflows xgrammar's stack: it killed the
rank), runs past its time or needs more than its memory fails its request alone, and the worker goes on
serving; an abandoned compile is killed; compiles run two at a time, so one held does not hold the next,
and those waiting count as waiting. (What constrained outputs are: test_structured.py, whose helpers
these share; what is refused before compiling: test_structured_schemas.py; the engines: conftest.py; the
compile bounds through a real ``epserve serve``: tests/serve/test_compile_limits.py.)"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from test_structured import SCHEMAS, assert_valid, constrained
from test_structured_schemas import DEEP, NESTED

from epserve import LLM, SamplingParams
from epserve.config import LoopOptions
from epserve.engine.engine import RequestError
from epserve.engine.grammars import CompileLimits
from epserve.engine.loop import EngineLoop
from epserve.engine.structured import GrammarMasks
from epserve.messages.engine import AbortRequest, AddRequest, GeneratedTokens, RequestFailed
from epserve.messages.sampling import StructuredOutput

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")


# ---- a request's constraints that leave no token, or a token its grammar refuses: it fails alone ------
class Collect:
    """A step loop's frontend keeping what it delivers per request; ``finished[rid]`` is set at the
    request's end (its last tokens, or its failure)."""

    def __init__(self, ids: list[str]) -> None:
        self.outputs: dict[str, list] = {rid: [] for rid in ids}
        self.finished = {rid: threading.Event() for rid in ids}

    def deliver(self, outputs: list) -> None:
        for out in outputs:
            self.outputs[out.request_id].append(out)
            if isinstance(out, RequestFailed) or (isinstance(out, GeneratedTokens) and out.finish_reason):
                self.finished[out.request_id].set()

    def set_draining(self) -> None:
        pass

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] if isinstance(out, GeneratedTokens) for t in out.token_ids]

    def end(self, rid: str) -> GeneratedTokens | RequestFailed:
        assert self.finished[rid].is_set(), rid
        return self.outputs[rid][-1]


def add(llm: LLM, rid: str, prompt: str, params: SamplingParams) -> AddRequest:
    return llm.engine.check_request(AddRequest(rid, tuple(llm.tokenizer.encode(prompt)), params))


def run_loop(llm: LLM, requests: dict[str, tuple[str, SamplingParams]]) -> Collect:
    """The requests through the engine's step loop in this process (offline: until idle)."""
    loop, front = EngineLoop(llm.engine), Collect(list(requests))
    for rid, (prompt, params) in requests.items():
        loop.submit(add(llm, rid, prompt, params), ring=False)
    loop.run(front, until_idle=True)
    return front


def assert_clean(llm: LLM) -> None:
    """The engine holds nothing of finished or failed requests."""
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.constraints.num_matchers == 0
    kv = engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def allowed_tokens(llm: LLM, constraint: StructuredOutput, after: str = "") -> list[int]:
    """The tokens ``constraint``'s grammar allows first (after the text ``after``)."""
    matcher = xgr.GrammarMatcher(llm.engine.constraints.compile(constraint))
    assert matcher.accept_string(after) or not after
    vocab = llm.config.model.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return [t for t in range(vocab) if int(bitmask[0, t // 32]) >> (t % 32) & 1]


FREE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINES = ["llm", "mtp_llm"]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_grammar_ends_a_request_before_its_min_tokens(request, engine) -> None:
    """Where the grammar can only end, min_tokens does not take EOS away (the grammar wins: the output
    ends shorter); where it can go on, min_tokens holds."""
    llm = request.getfixturevalue(engine)
    alone = llm.generate(["The quick brown fox"], FREE)[0]
    outs = llm.generate(["Answer:", "The quick brown fox", "Answer:"], [
        constrained("choice", json.dumps(["yes", "no"]), temperature=1.0, seed=7, min_tokens=6),
        FREE,
        constrained("regex", "[a-z]+", temperature=1.0, seed=8, min_tokens=6, max_tokens=30)])
    assert outs[0].finish_reason == "stop" and outs[0].text in ("yes", "no") and len(outs[0].token_ids) < 6
    assert outs[1].token_ids == alone.token_ids
    assert re.fullmatch("[a-z]+", outs[2].text) and len(outs[2].token_ids) >= 6
    assert_clean(llm)


@pytest.mark.parametrize("engine", ENGINES)
def test_constraints_that_leave_no_token_fail_their_request_alone(request, engine) -> None:
    """bad_words that cover every token the grammar allows, at the first token or after one: that request
    fails with the reason (an error its client sees), the free one in its batch finishes as if alone."""
    llm = request.getfixturevalue(engine)
    alone = llm.generate(["The quick brown fox"], FREE)[0]
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    regex = StructuredOutput("regex", "x[0-9]{2}")
    first = allowed_tokens(llm, regex)
    (x,) = [t for t in first if llm.tokenizer.decode([t]) == "x"]
    banned_later = [[t] for t in first if t != x] + [[t] for t in allowed_tokens(llm, regex, "x")]
    front = run_loop(llm, {
        "at_once": ("Answer:", SamplingParams(max_tokens=20, temperature=1.0, seed=1, structured=choice,
                                              bad_words=[[t] for t in allowed_tokens(llm, choice)])),
        "free": ("The quick brown fox", FREE),
        "after_one": ("Answer:", SamplingParams(max_tokens=20, temperature=0.0, structured=regex,
                                                bad_words=banned_later)),
    })
    for rid, tokens in [("at_once", []), ("after_one", [x])]:
        end = front.end(rid)
        assert isinstance(end, RequestFailed) and end.reason == "invalid" and "no token allowed" in end.message
        assert front.tokens(rid) == tokens  # (what it had streamed before)
    assert front.tokens("free") == alone.token_ids and front.end("free").finish_reason == "length"
    assert_clean(llm)
    with pytest.raises(RequestError, match="no token allowed"):  # offline: the call says why
        llm.generate(["Answer:"], SamplingParams(max_tokens=5, structured=choice,
                                                 bad_words=[[t] for t in allowed_tokens(llm, choice)]))
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].token_ids  # the engine still serves


def test_a_token_its_grammar_refuses_fails_its_request_alone(llm, monkeypatch) -> None:
    """Were the mask ever wrong (here: not applied at all), the matcher's refusal fails that request, not
    the step."""
    alone = llm.generate(["The quick brown fox"], FREE)[0]
    first = llm.generate(["Answer:"], SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    choice = next(c for c in (StructuredOutput("choice", json.dumps([s])) for s in ("qz", "zq", "kk"))
                  if first not in allowed_tokens(llm, c))
    monkeypatch.setattr(GrammarMasks, "_mask", lambda self, logits, bitmask, rows, held: torch.zeros(
        len(rows), dtype=torch.bool, device=logits.device))
    front = run_loop(llm, {"wrong": ("Answer:", SamplingParams(max_tokens=8, temperature=0.0, structured=choice)),
                           "free": ("The quick brown fox", FREE)})
    end = front.end("wrong")
    assert isinstance(end, RequestFailed) and f"token {first} breaks the structured-output grammar" in end.message
    assert front.tokens("wrong") == [] and front.tokens("free") == alone.token_ids
    assert_clean(llm)


# ---- compiling off the step loop ---------------------------------------------------------------------
class Serving:
    """The engine's step loop serving on a thread of its own (as under the gRPC service), stopped at
    the end; the compiler's threads held at ``gate`` (``entered`` set once one waits there), then
    compiling on that thread (the grammar worker's own bounds and cancelling: test_structured_limits.py)."""

    def __init__(self, llm: LLM, ids: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.llm, self.gate, self.entered = llm, threading.Event(), threading.Event()
        grammars = llm.engine.constraints.compiler  # (the compiler's threads call its compile_in_worker)
        compile_ = grammars.compile

        def held(constraint: StructuredOutput, job: int):
            self.entered.set()
            assert self.gate.wait(60)
            return compile_(constraint)

        monkeypatch.setattr(grammars, "compile_in_worker", held)
        self.loop, self.front = EngineLoop(llm.engine, LoopOptions(stats_every=0)), Collect(ids)
        self.thread = threading.Thread(target=self.loop.run, args=(self.front,), daemon=True)

    def __enter__(self) -> Serving:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gate.set()
        self.loop.request_stop()
        self.thread.join(60)
        assert not self.thread.is_alive()

    def submit(self, rid: str, prompt: str, params: SamplingParams) -> None:
        self.loop.submit(add(self.llm, rid, prompt, params))

    def wait(self, rid: str) -> GeneratedTokens | RequestFailed:
        assert self.front.finished[rid].wait(60), rid
        return self.front.end(rid)


def unique_schema(tag: str) -> str:
    """A small schema no other test compiles (so the compiler's cache has not seen it)."""
    return json.dumps({"type": "object", "properties": {tag: {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": [tag], "additionalProperties": False})


def test_a_slow_compile_holds_no_request_back(llm, monkeypatch) -> None:
    with Serving(llm, ["slow", "free"], monkeypatch) as serving:
        serving.submit("slow", "Answer:", constrained("json_schema", unique_schema("slow"), temperature=0.0))
        assert serving.entered.wait(60)  # compiling, and held there
        serving.submit("free", "The quick brown fox", FREE)
        assert serving.wait("free").finish_reason == "length"
        assert not serving.front.finished["slow"].is_set() and "slow" in serving.loop.compiling
        serving.gate.set()
        end = serving.wait("slow")
    assert end.finish_reason == "stop"
    assert json.loads(llm.tokenizer.decode(serving.front.tokens("slow")))["slow"] in range(10)
    assert_clean(llm)


def test_an_abort_while_compiling_frees_the_request(llm, monkeypatch) -> None:
    with Serving(llm, ["cut", "free", "after"], monkeypatch) as serving:
        loop, submit = serving.loop, serving.loop.submit
        compiled = threading.Event()

        def noting(message, ring=True):  # the compiler's callback queues GrammarCompiled through this
            submit(message, ring)
            if type(message).__name__ == "GrammarCompiled":
                compiled.set()

        monkeypatch.setattr(loop, "submit", noting)
        serving.submit("cut", "Answer:", constrained("json_schema", unique_schema("cut"), temperature=0.0))
        assert serving.entered.wait(60)
        loop.submit(AbortRequest("cut"))
        serving.submit("free", "The quick brown fox", FREE)
        serving.wait("free")  # (queued after the abort: the loop took the abort first)
        assert "cut" not in loop.compiling
        serving.gate.set()
        assert compiled.wait(60)
        serving.submit("after", "The quick brown fox", FREE)
        assert serving.wait("after").finish_reason == "length"  # (the loop took GrammarCompiled before it)
        assert serving.front.outputs["cut"] == [] and not loop.compiling and "cut" not in loop.requests
    assert not llm.engine.constraints.constrains("cut")
    assert_clean(llm)


def test_an_identical_constraint_compiles_once(llm) -> None:
    grammars = llm.engine.constraints.compiler
    before = grammars.num_compiled
    same = constrained("json_schema", unique_schema("cached"), temperature=0.0)
    outs = llm.generate(["x", "y"], [same, same])
    assert grammars.num_compiled == before + 1 and all(o.finish_reason == "stop" for o in outs)
    llm.generate(["z"], same)
    assert grammars.num_compiled == before + 1
    llm.generate(["z"], constrained("json_schema", unique_schema("other"), temperature=0.0))
    assert grammars.num_compiled == before + 2


def test_a_constrained_request_reuses_the_prefix_cache(llm) -> None:
    prompt = list(range(300, 340))  # two full blocks of 16 tokens, then 8
    params = constrained("json_schema", json.dumps(SCHEMAS["enum_and_range"]), temperature=0.0)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.token_ids == first.token_ids and first.finish_reason == "stop"
    assert_valid(second.text, SCHEMAS["enum_and_range"])


# ---- the grammar worker: a compile that crashes, runs too long or needs too much fails alone -------
MANY = json.dumps([f"w{i}" for i in range(50_000)])  # a choice of these: seconds of compiling, hundreds of MiB


@pytest.fixture(scope="module")
def compiler(llm):
    """The engine's grammar compiler, its worker started."""
    grammars = llm.engine.constraints.compiler
    grammars.submit(StructuredOutput("regex", "[a-z]+_worker")).result(120)  # (a constraint nothing compiled)
    return grammars


def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def failure(future) -> str:
    error = future.exception(120)
    assert isinstance(error, ValueError), error
    return str(error)


def test_a_compile_that_crashes_fails_alone_and_the_worker_goes_on(compiler, monkeypatch) -> None:
    """With the bounds lifted, the nested pattern crashes its compile (SIGSEGV in xgrammar's converter):
    its request fails saying so, the rank and the worker live on and compile the next constraint."""
    worker = compiler.worker.pid
    monkeypatch.setattr(compiler, "limits", CompileLimits(max_nesting=10 * DEEP))
    assert "the json_schema constraint's compile crashed (SIGSEGV)" in failure(compiler.submit(
        StructuredOutput("json_schema", NESTED)))
    assert compiler.submit(StructuredOutput("json_schema", unique_schema("after_crash"))).result(60) is not None
    assert compiler.worker.pid == worker and compiler.num_pending == 0


def test_a_compile_past_its_time_or_memory_fails_alone(compiler, monkeypatch) -> None:
    monkeypatch.setattr(compiler, "limits", CompileLimits(time_limit_s=0.2))
    assert failure(compiler.submit(StructuredOutput("choice", MANY))) == (
        "the choice constraint's compile took longer than its limit of 0.2 s")
    monkeypatch.setattr(compiler, "limits", CompileLimits(memory_limit_mib=32))
    assert failure(compiler.submit(StructuredOutput("choice", MANY))) == (
        "the choice constraint's compile needs more than its memory limit of 32 MiB")
    assert not compiler.worker.running


# ---- through the step loop ---------------------------------------------------------------------------
@contextmanager
def serving(llm, ids: list[str]) -> Iterator[tuple[EngineLoop, Collect]]:
    """The engine's step loop serving on a thread (as under the gRPC service), its compiles in the worker."""
    loop, front = EngineLoop(llm.engine, LoopOptions(stats_every=0)), Collect(ids)
    thread = threading.Thread(target=loop.run, args=(front,), daemon=True)
    thread.start()
    try:
        yield loop, front
    finally:
        loop.request_stop()
        thread.join(60)
        assert not thread.is_alive()


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_abandoned_compiles_are_killed_and_queued_ones_count_as_waiting(llm, compiler) -> None:
    """The worker stopped, so that compiles sent to it hold both of the compiler's threads by
    construction: three constrained requests wait (two sent, one queued behind them), all counted as
    waiting; aborted, each compile is stopped (the queued one dropped, the sent ones killed when the
    worker reads on), none compiles, and nothing of them is left."""
    ids = ["a", "b", "c"]
    before = compiler.num_compiled
    with serving(llm, [*ids, "free"]) as (loop, front):
        with stopped(compiler.worker.pid):
            for rid in ids:
                loop.submit(add(llm, rid, "Answer:", constrained("json_schema", unique_schema(f"held_{rid}"))))
            until(lambda: len(loop.compiling) == 3 and compiler.worker.num_in_flight == 2)
            assert loop.load().num_waiting == 3 and compiler.num_pending == 3
            futures = [loop.compiling[rid][1] for rid in ids]
            for rid in ids:
                loop.submit(AbortRequest(rid))
            loop.submit(add(llm, "free", "The quick brown fox", FREE))
            assert front.finished["free"].wait(60)  # (the loop serves on while the compiles are held)
            assert loop.load().num_waiting == 0 and not loop.compiling
        until(lambda: compiler.num_pending == 0)
        assert futures[2].cancelled()
        assert all("cancelled" in failure(f) for f in futures[:2])
    assert compiler.num_compiled == before and not compiler.worker.running
    assert all(front.outputs[rid] == [] for rid in ids)
    assert_clean(llm)


def test_a_held_compile_holds_no_other_and_dies_with_its_request(llm, compiler) -> None:
    """A large compile, its process stopped once it started (held by construction), takes one of the
    compiler's two threads: another constrained request compiles and finishes meanwhile; the held
    one's abort kills its process."""
    with serving(llm, ["wide", "next"]) as (loop, front):
        loop.submit(add(llm, "wide", "Answer:", constrained("choice", MANY)))
        until(lambda: len(compiler.worker.running) == 1)
        pid = next(iter(compiler.worker.running.values()))
        os.kill(pid, signal.SIGSTOP)
        loop.submit(add(llm, "next", "Answer:", constrained("json_schema", unique_schema("next"), temperature=0.0)))
        assert front.finished["next"].wait(60) and front.end("next").finish_reason == "stop", front.outputs["next"]
        assert "wide" in loop.compiling and not front.finished["wide"].is_set()
        loop.submit(AbortRequest("wide"))
        until(lambda: not os.path.exists(f"/proc/{pid}"))  # killed and reaped by the worker
        until(lambda: compiler.num_pending == 0)
    assert front.outputs["wide"] == [] and not any(isinstance(o, RequestFailed) for o in front.outputs["next"])
    assert_clean(llm)


def test_a_worker_that_dies_fails_what_it_held_and_starts_again(compiler) -> None:
    """The worker killed with a compile sent to it (held by construction: it was stopped): that compile
    fails as the worker's failure (the loop answers unavailable), and the next one starts a new worker."""
    first = compiler.worker.pid
    os.kill(first, signal.SIGSTOP)
    future = compiler.submit(StructuredOutput("json_schema", unique_schema("lost")))
    until(lambda: compiler.worker.num_in_flight == 1)
    os.kill(first, signal.SIGKILL)
    error = future.exception(60)
    assert isinstance(error, RuntimeError) and "the grammar worker exited while compiling" in str(error)
    assert compiler.submit(StructuredOutput("json_schema", unique_schema("lost"))).result(120) is not None
    assert compiler.worker.pid not in (None, first)
