"""One rank's engine and the lockstep step loop (ARCHITECTURE.md, "One step").

Every rank of the EP group calls :meth:`LLMEngine.step` together: each DP group's leader schedules
its batch (possibly empty); one small all-reduce over every rank says whether anybody has work and
how many tokens the largest batch holds; if anybody has, the leaders broadcast their batch to their
TP peers and every rank runs the forward (an idle DP group runs the empty batch, so every MoE
collective has all participants); leaders sample and update their requests.
"""

from __future__ import annotations

import logging

from epserve.config import EngineConfig
from epserve.engine.balancer import RebalanceReport
from epserve.engine.request import Request, SamplingParams
from epserve.engine.runner import BatchPlan, ModelRunner, resolve_device
from epserve.engine.scheduler import RequestUpdate, Scheduler, check_prompt
from epserve.moe.stats import ExpertLoad
from epserve.parallel.comm import all_reduce_max, broadcast_from_leader, gather_objects
from epserve.parallel.context import ParallelContext
from epserve.parallel.launch import CommandRefused

logger = logging.getLogger(__name__)


class RequestError(CommandRefused):
    """A request the engine refuses; raised identically on every rank, before any collective, so
    the ranks stay usable."""


class LLMEngine:
    """Token-in/token-out engine of one rank; the leader of a DP group owns its scheduler."""

    def __init__(self, config: EngineConfig, ctx: ParallelContext | None = None) -> None:
        self.config = config
        self.ctx = ctx if ctx is not None else ParallelContext.single(resolve_device(config.device))
        self.runner = ModelRunner(config, self.ctx)
        self.scheduler = (
            Scheduler(config.scheduler, config.cache, self.runner.num_blocks, config.max_model_len, config.num_spec_tokens)
            if self.ctx.is_leader
            else None
        )
        self.anybody_unfinished = False  # from the last step's all-reduce
        self.anybody_stopping = False  # likewise: some rank asked the group to drain and stop
        self.num_forwards = 0  # steps that ran a forward (the same count on every rank)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """The one check of a request, where it enters (the offline command on every rank, the gRPC
        call on a leader): RequestError for a prompt this engine cannot serve (the same answer on every
        rank), else the request, ready for :meth:`enqueue`."""
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        try:
            check_prompt(request_id, len(prompt_token_ids), params.max_tokens, self.config.max_model_len,
                         self.config.cache.block_size, self.runner.num_blocks, self.config.num_spec_tokens)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return Request(request_id, prompt_token_ids, params, eos_token_ids=self.config.model.eos_token_ids)

    def enqueue(self, request: Request) -> None:
        """Queue a request from :meth:`make_request` on this DP group (leader only). ValueError only
        for an id the scheduler already holds."""
        if self.scheduler is None:
            raise RuntimeError("requests go to the leader rank of a DP group")
        self.scheduler.add_request(request)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """:meth:`make_request` then :meth:`enqueue` (leader only); RequestError for a bad request."""
        request = self.make_request(request_id, prompt_token_ids, params)
        self.enqueue(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler is not None and self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished_requests()

    def expert_loads(self) -> tuple[ExpertLoad, ExpertLoad]:
        """Token copies per (MoE layer, logical expert) and per rank over the whole EP group since
        start-up (or the last reset), and since the last rebalance (what the placement in use saw); one
        collective."""
        layers, total = self.runner.expert_load()
        _, recent = self.runner.expert_load(since_rebalance=True)
        parts: list = gather_objects((total, recent), self.ctx)
        return (ExpertLoad.from_ranks(layers, [p[0] for p in parts]),
                ExpertLoad.from_ranks(layers, [p[1] for p in parts]))

    def rebalance_experts(self) -> RebalanceReport | None:
        """Place the experts by the recorded load now (a collective, between steps); None without
        routed experts."""
        return self.runner.balancer.rebalance() if self.runner.balancer is not None else None

    def reset_expert_load(self) -> None:
        if self.runner.balancer is not None:
            self.runner.balancer.reset()

    def step(self, stopping: bool = False) -> list[RequestUpdate]:
        """One lockstep step; every rank must call it. Returns the leader's request updates.
        ``stopping`` is this rank's vote to drain and stop; the step's all-reduce tells every rank
        (``anybody_stopping``)."""
        profiler = self.runner.profiler
        if profiler is None:
            return self._step(stopping)
        start, num_records = profiler.now(), len(profiler.steps)
        updates = self._step(stopping)
        if len(profiler.steps) > num_records:  # a forward ran: the whole step's wall time joins its record
            profiler.steps[-1].seconds["step"] = profiler.now() - start
        return updates

    def _step(self, stopping: bool) -> list[RequestUpdate]:
        scheduler = self.scheduler
        output = scheduler.schedule() if scheduler is not None else None
        chunks = list(output.chunks) if output else []  # decodes first
        plan = BatchPlan.from_chunks(chunks, self.runner.block_size) if chunks else BatchPlan()
        prefilling = plan.num_tokens > plan.num_decode_seqs
        max_tokens, unfinished, stop, any_prefill = all_reduce_max(
            [plan.num_tokens, int(self.has_unfinished_requests()), int(stopping), int(prefilling)], self.ctx
        )
        self.anybody_unfinished, self.anybody_stopping = bool(unfinished), bool(stop)
        result, drafts = None, None
        if max_tokens:
            self.num_forwards += 1
            plan = broadcast_from_leader(plan, self.ctx)
            hidden = self.runner.forward(plan, max_tokens, all_decode=not any_prefill)
            if chunks:
                result = self.runner.sample(chunks, hidden, plan)
            if self.runner.proposer is not None:  # every rank: the MTP layer's passes, in lockstep
                drafts = self.runner.propose(chunks, plan, result, hidden, max_tokens)
            balancer = self.runner.balancer
            if balancer is not None and balancer.record_step():  # every rank at the same step
                balancer.rebalance()
        if scheduler is None:
            return []
        updates = scheduler.update(output, result.sampled if result else {}, result.logprobs if result else None,
                                   drafts)
        if not chunks and not updates and scheduler.has_unfinished_requests():
            # Cannot happen while the scheduler keeps its invariants; never spin silently.
            raise RuntimeError(
                f"scheduler stalled: {scheduler.num_running} running, {scheduler.num_waiting} waiting, "
                f"{scheduler.kv_manager.num_free_blocks} free KV blocks"
            )
        for update in updates:
            if update.finished:
                self.runner.release(update.request_id)
        return updates
