"""The lockstep step loop of one rank: the only driver of :meth:`LLMEngine.step`, for both of its
frontends, the offline ``Generate`` command (:class:`epserve.engine.worker.OfflineFrontend`) and the
gRPC service of a serving leader (:mod:`epserve.engine_server.service`; no gRPC here).

Each pass, a DP group's leader first moves what its frontend queued (:class:`AddRequest`,
:class:`AbortRequest`, :class:`KVReceived`) into the engine, then every rank runs the step together
(timed when profiling), and the leader hands the step's results to its :class:`Frontend` in one
batch (:class:`GeneratedTokens`, :class:`RequestFailed`, KV hand-off messages). Expert-load
statistics are gathered every ``stats_every`` forwards and when going idle. When the step's
all-reduce says nobody has work, an offline run returns; a serving one sleeps on the
:class:`~epserve.parallel.doorbell.Doorbell` (no spinning) until a leader rings it. A stop vote
(SIGTERM/SIGINT on any rank) travels in the same all-reduce: every leader stops taking requests, the
running ones finish (or are aborted after ``drain_timeout_s``), and all ranks leave together.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import time
from concurrent.futures import Future
from typing import Protocol

import torch

from epserve.config import LoopOptions
from epserve.engine.engine import LLMEngine
from epserve.engine.request import Request
from epserve.engine.scheduler import RequestUpdate
from epserve.messages.engine import (
    ITERATION_TOKENS_BUCKETS,
    AbortRequest,
    AddRequest,
    EngineLoad,
    GeneratedTokens,
    GrammarCompiled,
    KVReceived,
    LoopOutput,
    RequestFailed,
    RequestTimes,
)
from epserve.messages.expert_load import ExpertLoad
from epserve.parallel.doorbell import Doorbell, LocalDoorbell

logger = logging.getLogger(__name__)


OFFLINE = LoopOptions(stats_every=0)  # the offline frontend's loop: nobody reads its statistics


class Frontend(Protocol):
    """Where a leader's loop sends its results (the offline frontend, the gRPC service); called from
    the loop's thread."""

    def deliver(self, outputs: list[LoopOutput]) -> None: ...

    def set_draining(self) -> None: ...


class EngineLoop:
    """The step loop of ``engine``'s rank (``doorbell``: what a serving loop of several ranks sleeps
    on; by default one for a world in one process, and offline, where the loop never sleeps)."""

    def __init__(self, engine: LLMEngine, options: LoopOptions = OFFLINE,
                 doorbell: Doorbell | LocalDoorbell | None = None) -> None:
        self.engine = engine
        self.ctx = engine.ctx
        self.options = options
        self.doorbell = doorbell if doorbell is not None else LocalDoorbell()
        self.inbox: collections.deque[AddRequest | AbortRequest | KVReceived | GrammarCompiled] = collections.deque()
        # requests waiting for their constraint to compile (``engine.constraints``), and its future: those
        # compiling and those queued behind them, all counted as waiting (``load``)
        self.compiling: dict[str, tuple[AddRequest, Future]] = {}
        self._offline = False
        self.requests: dict[str, Request] = {}  # accepted by this leader, not finished (the loop's thread)
        self.stop_requested = False  # this rank's vote
        self.draining = False  # some rank voted: take no new requests
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # tokens per step (steps that computed any): the count in each bucket of ITERATION_TOKENS_BUCKETS
        # (the last: above them all), and their sum
        self.step_token_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.step_tokens_sum = 0
        self.expert_imbalance = 1.0
        self.expert_load: ExpertLoad | None = None  # since the last rebalance, from the last gather
        self.expert_load_total: ExpertLoad | None = None  # since start-up, from the same gather
        self._stats_at = 0
        self._drain_deadline: float | None = None
        self._frontend: Frontend | None = None
        self._busy_since: float | None = None  # start of the loop's current pass; None while asleep

    # ---- any thread ----------------------------------------------------------------------------
    def submit(self, message: AddRequest | AbortRequest | KVReceived | GrammarCompiled, ring: bool = True) -> None:
        """Queue ``message`` for the loop; ``ring=False`` when the loop is known to be busy (a stalled
        loop's store may not answer a ring)."""
        self.inbox.append(message)
        if ring:
            self.doorbell.ring()

    def stalled_for(self) -> float:
        """Seconds the loop's current pass (a step, a statistics gather) has run; 0 while it sleeps
        waiting for work. A pass past ``step_timeout_s`` means a rank hung or died."""
        busy_since = self._busy_since
        return 0.0 if busy_since is None else time.monotonic() - busy_since

    def request_stop(self) -> None:
        """Vote to drain and stop (signal handlers call this); wakes sleeping ranks."""
        if not self.stop_requested:
            logger.info("rank %d: stop requested; draining", self.ctx.rank)
        self.stop_requested = True
        self.doorbell.ring()

    def load(self) -> EngineLoad:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        kv = scheduler.kv_manager
        spec = self.engine.sampling.speculative_stats() or {}
        balancer = self.engine.runner.balancer
        return EngineLoad(
            dp_rank=self.ctx.dp_rank,
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + len(self.compiling) + sum(isinstance(m, AddRequest)
                                                                          for m in list(self.inbox)),
            kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
            kv_blocks_total=kv.num_blocks,
            prefix_query_tokens=kv.num_prefix_query_tokens,
            prefix_hit_tokens=kv.num_prefix_hit_tokens,
            expert_imbalance=self.expert_imbalance,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_preemptions_total=scheduler.num_preemptions_total,
            draining=self.draining,
            spec_num_drafts=spec.get("num_drafts", 0),  # type: ignore[arg-type]
            spec_num_draft_tokens=spec.get("num_draft_tokens", 0),  # type: ignore[arg-type]
            spec_num_accepted_tokens=spec.get("num_accepted_tokens", 0),  # type: ignore[arg-type]
            spec_accepted_per_position=tuple(spec.get("accepted_per_position", ())),  # type: ignore[arg-type]
            expert_layers=self.expert_load.layers if self.expert_load is not None else (),
            expert_layer_imbalance=tuple(self.expert_load.layer_imbalance) if self.expert_load is not None else (),
            eplb_rebalances_total=balancer.num_rebalances if balancer is not None else 0,
            stalled=self.stalled,
            restarts=self.options.restarts,
            role=self.options.role,
            num_receiving=scheduler.handoff.num_receiving,
            iteration_tokens_buckets=tuple(itertools.accumulate(self.step_token_counts[:-1])),
            iteration_tokens_sum=self.step_tokens_sum,
            iteration_steps_total=sum(self.step_token_counts),
        )

    @property
    def stalled(self) -> bool:
        """The current pass has run past the step timeout, and not because this rank is capturing or
        compiling a decode graph for the first time (minutes, legitimately)."""
        captured = self.engine.runner.captured
        warming_up = captured is not None and any(graphs.warming_up for graphs in captured.sets)
        return self.stalled_for() > self.options.step_timeout_s and not warming_up

    # ---- the loop's thread ---------------------------------------------------------------------
    def run(self, frontend: Frontend | None = None, until_idle: bool = False) -> None:
        """Step until every rank has stopped (serving), or with ``until_idle`` (offline) until no rank
        has work; every rank calls it, ``frontend`` on leaders. On failure every accepted request is
        aborted and fails as unavailable, and the error is raised."""
        self._frontend = frontend
        self._offline = until_idle  # (offline, a constraint compiles where the request is taken)
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)
        try:
            self._loop(until_idle)
        except BaseException as e:
            logger.error("rank %d: step loop failed: %s", self.ctx.rank, e)
            self._fail_accepted()
            raise

    def _loop(self, until_idle: bool) -> None:
        engine, leader, stats_every = self.engine, self.ctx.is_leader, self.options.stats_every
        while True:
            self._busy_since = time.monotonic()
            if leader:
                if self.inbox:
                    self._take_inbox()
                if self._drain_deadline is not None and time.monotonic() > self._drain_deadline:
                    self._abort_all("drain timeout")
            updates = engine.runner.profiler.time_step(engine.step, self.stop_requested)
            if leader:
                if n := engine.step_tokens:  # (counted before its outputs go out)
                    self.step_token_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
                    self.step_tokens_sum += n
                self._publish(updates)
            if engine.anybody_stopping and not self.draining:
                self._start_draining()
            if not engine.anybody_unfinished:
                if stats_every and engine.num_forwards != self._stats_at:
                    self._gather_stats()
                if until_idle or (engine.anybody_stopping and not engine.anybody_receiving):
                    return
                self._busy_since = None
                self.doorbell.wait()
            elif stats_every and engine.num_forwards - self._stats_at >= stats_every:
                self._gather_stats()

    def _fail_accepted(self) -> None:
        """After a failure: every accepted or queued request fails as unavailable, and the accepted
        ones are aborted, so the engine holds none of them (offline, the next call runs without them)."""
        pending = [*self.requests, *self._drop_compiles(),
                   *(m.request_id for m in list(self.inbox) if isinstance(m, AddRequest))]
        why = "the engine failed (a rank died, or a collective failed or timed out)"  # details: the log
        self._deliver([RequestFailed(rid, "unavailable", why) for rid in pending])
        self.inbox.clear()
        accepted, self.requests = list(self.requests), {}
        try:
            for rid in accepted:
                self.engine.abort_request(rid)
        except Exception as e:  # the failure may have left the scheduler inconsistent: keep the first error
            logger.warning("rank %d: aborting after the failure failed too: %s", self.ctx.rank, e)

    def _take_inbox(self) -> None:
        failed: list[LoopOutput] = []
        while self.inbox:
            message = self.inbox.popleft()
            if isinstance(message, AbortRequest):
                compiling = self.compiling.pop(message.request_id, None)
                if compiling is None:
                    self.engine.abort_request(message.request_id)
                else:  # its compile stops (waiting for the compiler, or killed in the grammar worker)
                    self.engine.constraints.cancel(compiling[1])
                continue
            if isinstance(message, KVReceived):
                self.engine.receive_kv(message.arrival)
                continue
            rid = message.request_id
            if isinstance(message, GrammarCompiled):  # its request, ready (unless aborted meanwhile)
                if rid not in self.compiling:
                    continue
                message, future = self.compiling.pop(rid)
                try:
                    self.engine.constraints.add(rid, future.result())
                except ValueError as e:  # it does not compile, or exceeds a bound of the compiler's
                    failed.append(RequestFailed(rid, "invalid", str(e)))
                    continue
                except Exception as e:  # (the compiler's own failure: the grammar worker did not start)
                    logger.warning("request %s: its constraint did not compile: %s", rid, e)
                    failed.append(RequestFailed(rid, "unavailable", f"the constraint could not compile: {e}"))
                    continue
            elif message.params.structured is not None:  # compiled first, off the loop
                if self.draining:
                    failed.append(RequestFailed(rid, "unavailable", "the engine is shutting down"))
                else:
                    self._compile(message)
                continue
            if self.draining:
                failed.append(RequestFailed(rid, "unavailable", "the engine is shutting down"))
                self.engine.constraints.release(rid)
                continue
            try:
                request = self.engine.enqueue(message)
            except ValueError as e:  # an id the scheduler still holds
                failed.append(RequestFailed(rid, "invalid", str(e)))
                continue
            self.requests[rid] = request
            self.prompt_tokens_total += request.num_prompt_tokens
        self._deliver(failed)

    def _compile(self, message: AddRequest) -> None:
        """Compile the request's constraint in the grammar worker; the loop takes the request when it is
        done. Offline, at once on this thread (nothing else waits; the caller's own constraints)."""
        constraint = message.params.structured
        assert constraint is not None
        if self._offline:
            future: Future = Future()
            try:
                future.set_result(self.engine.constraints.compile(constraint))
            except Exception as e:
                future.set_exception(e)
            self.compiling[message.request_id] = (message, future)
            self.inbox.appendleft(GrammarCompiled(message.request_id))
            return
        future = self.engine.constraints.submit(constraint)
        self.compiling[message.request_id] = (message, future)
        future.add_done_callback(lambda _: self.submit(GrammarCompiled(message.request_id)))

    def _drop_compiles(self) -> list[str]:
        """Every compiling request dropped, its compile stopped; their ids."""
        compiling, self.compiling = self.compiling, {}
        for _, future in compiling.values():
            self.engine.constraints.cancel(future)
        return list(compiling)

    def _publish(self, updates: list[RequestUpdate]) -> None:
        """Each request's new tokens, handed to the frontend once per step (not once per request)."""
        out: list[LoopOutput] = list(self.engine.take_kv_wanted())  # decode side: transfers to start
        requests, generated, failed = self.requests, 0, self.engine.failed
        for update in updates:
            rid = update.request_id
            request = requests.get(rid)
            if request is None:
                continue
            if update.finish_reason == "abort" and rid in failed:  # its own constraint stopped it
                out.append(RequestFailed(rid, "invalid", failed[rid]))
                del requests[rid]
                continue
            if request.kv_transfer == "send" and update.finished and update.finish_reason != "abort":
                out.append(self.engine.export_kv(rid))  # prefill side: its blocks, copied out
                del requests[rid]
                continue
            new = update.new_token_ids
            # (the update's own: a decode side's arrival and the step after it are two updates of one step)
            logprobs = update.new_logprobs if request.sampling_params.logprobs is not None else ()
            # the prompt's logprobs, when asked for, go with the request's first message
            prompt_lps = (tuple(request.prompt_logprobs)  # type: ignore[arg-type]
                          if request.prompt_logprobs and update.num_output_tokens == len(new) else ())
            # the engine's times: queue and prefill with the first token, all three at the finish
            times = (_times(request, update.finished)
                     if update.finished or (new and update.num_output_tokens == len(new)) else None)
            # (positional: a frozen dataclass takes keywords markedly slower, and this runs per request)
            out.append(GeneratedTokens(rid, new, logprobs, request.num_prompt_tokens, request.num_cached_tokens,
                                       update.num_output_tokens, update.finish_reason, prompt_lps, times))
            generated += len(new)
            if update.finished:
                del requests[rid]
        self.generation_tokens_total += generated
        self._deliver(out)

    def _deliver(self, outputs: list[LoopOutput]) -> None:
        if outputs and self._frontend is not None:
            self._frontend.deliver(outputs)

    def _abort_all(self, why: str) -> None:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        handoff = scheduler.handoff
        ids = [r.request_id for r in (*scheduler.running, *scheduler.waiting, *handoff.pending,
                                       *handoff.receiving.values())]
        compiling = self._drop_compiles()
        if ids or compiling:
            logger.warning("aborting %d requests: %s", len(ids) + len(compiling), why)
        for rid in ids:
            self.engine.abort_request(rid)
        self._deliver([RequestFailed(rid, "unavailable", f"aborted: {why}") for rid in compiling])

    def _start_draining(self) -> None:
        self.draining = True
        self._drain_deadline = time.monotonic() + self.options.drain_timeout_s
        if self._frontend is not None:
            self._frontend.set_draining()

    def _gather_stats(self) -> None:
        """Expert load over the whole EP group (a collective: every rank calls it at the same step)."""
        self.expert_load_total, self.expert_load = self.engine.expert_loads()
        self.expert_imbalance = self.expert_load.imbalance
        self._stats_at = self.engine.num_forwards


def _times(request: Request, finished: bool) -> RequestTimes:
    """A request's queue, prefill and (when ``finished``) decode time; 0 for a stage it never reached."""
    now = time.monotonic()
    scheduled = request.first_scheduled_time
    if scheduled is None:
        return RequestTimes(now - request.arrival_time, 0.0, 0.0)
    first = request.first_token_time if request.first_token_time is not None else now
    return RequestTimes(scheduled - request.arrival_time, max(first - scheduled, 0.0), now - first if finished else 0.0)
