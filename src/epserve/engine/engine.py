"""One rank's engine and the lockstep step (docs/architecture.md, "One step").

Every rank of the EP group calls :meth:`LLMEngine.step` together: each DP group's leader schedules
its batch (possibly empty); one small all-reduce over every rank says whether anybody has work and
how many tokens the largest batch holds; if anybody has, the leaders broadcast their batch to their
TP peers and every rank runs the forward (an idle DP group runs the empty batch, so every MoE
collective has all participants); leaders sample (the engine's sampling pipeline, ``engine/sampling.py``,
which also holds the structured-output constraints the step loop adds and releases) and update their
requests.
"""

from __future__ import annotations

import gc
import logging
import weakref
from dataclasses import replace

import torch

from epserve.config import EngineConfig, OutOfMemoryError
from epserve.engine.balancer import RebalanceReport
from epserve.engine.kv_handoff import KVWrite
from epserve.engine.memory import keep_freed_host_memory
from epserve.engine.request import Request, check_prompt
from epserve.engine.runner import BatchPlan, ModelRunner, resolve_device
from epserve.engine.sampling import SamplingPipeline, no_token_left
from epserve.engine.scheduler import RequestUpdate, Scheduler
from epserve.engine.spec_probe import PROBE_MARGIN, SpecDecision, probes, run_probe, unprobed
from epserve.messages.engine import AddRequest
from epserve.messages.expert_load import ExpertLoad
from epserve.messages.kv import KVWanted, PrefilledKV
from epserve.messages.sampling import SamplingParams
from epserve.parallel.comm import all_reduce_max, broadcast_from_leader, gather_objects
from epserve.parallel.context import ParallelContext
from epserve.parallel.spawned import CommandRefused

logger = logging.getLogger(__name__)

RELEASE_NOW_BYTES = 2**30  # a probed engine's weights and KV pool from which they are collected before reloading


class RequestError(CommandRefused):
    """A request the engine refuses; raised identically on every rank, before any collective, so
    the ranks stay usable."""


class LLMEngine:
    """Token-in/token-out engine of one rank; the leader of a DP group owns its scheduler."""

    def __init__(self, config: EngineConfig, ctx: ParallelContext | None = None,
                 spec_margin: float = PROBE_MARGIN) -> None:
        """``spec_margin``: by how much MTP's measured tokens/s at batch 1 must beat plain decoding's for the
        start-up probe to switch it on (where the engine probes: ``spec_probe.probes``)."""
        self.ctx = ctx if ctx is not None else ParallelContext.single(resolve_device(config.device))
        probing, unfit = probes(config), None
        if probing:  # the MTP layer loaded for the start-up probe, which keeps it or loads the engine again without
            try:
                self._load(replace(config, speculative="mtp", num_speculative_tokens=1))
            except OutOfMemoryError as e:  # the default asked for nothing: the plain engine, if it fits
                probing, unfit = False, SpecDecision(False, f"off: the MTP layer does not fit ({e}); --speculative "
                                                            "mtp forces it")
                logger.info("speculative decoding: %s", unfit.reason)
        if not probing:
            self._load(config)
        if self.ctx.device.type == "cpu":  # after loading (the load's temporaries are not kept), before any step
            keep_freed_host_memory()
        self.anybody_unfinished = False  # from the last step's all-reduce
        self.anybody_stopping = False  # likewise: some rank asked the group to drain and stop
        self.anybody_receiving = False  # likewise: some request waits for its prompt's KV from a prefill instance
        self.num_forwards = 0  # steps that ran a forward (the same count on every rank)
        self.step_tokens = 0  # tokens the leader's last step scheduled (the loop's histogram of them)
        # leader: the requests the last step aborted for a reason of their own, and why (a constraint that
        # leaves no token allowed: ``Constraints``); their updates finish as "abort", the loop reports
        # them failed
        self.failed: dict[str, str] = {}
        # whether the engine drafts, why, and the start-up probe's figures where it probed
        self.speculation = self._settle_speculation(spec_margin) if probing else unfit or unprobed(config)

    def _load(self, config: EngineConfig) -> None:
        """The engine's parts for ``config``: the runner (the model, its KV pool and captured decode), the
        sampling pipeline and, on a DP group's leader, the scheduler."""
        self.config = config
        self.runner = ModelRunner(config, self.ctx)
        self.sampling = SamplingPipeline(config, self.runner.model.compute_logits, self.ctx.device)
        self.constraints = self.sampling.constraints  # structured outputs: the step loop's one seam
        self.scheduler = self._new_scheduler()

    def _new_scheduler(self) -> Scheduler | None:
        """A DP group leader's scheduler, empty (None elsewhere)."""
        config = self.config
        if not self.ctx.is_leader:
            return None
        return Scheduler(config.scheduler, config.cache, self.runner.num_blocks, config.max_model_len,
                         config.num_spec_tokens)

    def _settle_speculation(self, margin: float) -> SpecDecision:
        """Probe whether MTP pays (``engine/spec_probe.py``) and leave the engine as it was before the probe,
        drafting or not. On: the proposer drafts by the measured rule; a fresh scheduler (no prefix cache, every
        KV block free), the expert-load and step counters at zero. Off: the probed engine's parts
        released (the MTP layer's weights, its KV cache and draft graphs with them), then loaded again as a plain
        engine's (its KV pool sized without the MTP layer). Logged in one line."""
        decision = run_probe(self, margin)
        runner = self.runner
        if decision.on:
            assert runner.proposer is not None and decision.rule is not None
            runner.proposer.rule = decision.rule
            runner.proposer.steps_without_drafts = 0
            if runner.balancer is not None:
                runner.balancer.reset()
            runner.dispatcher.reset_stats()
            self.scheduler = self._new_scheduler()
        else:
            config = replace(self.config, speculative=None, num_speculative_tokens=0)
            model, held = weakref.ref(runner.model), runner.weight_bytes + sum(c.nbytes for c in runner.kv_caches)
            del runner
            self.runner = self.sampling = self.constraints = self.scheduler = None  # type: ignore[assignment]
            cuda = self.ctx.device.type == "cuda"
            # held by reference cycles: collected now where that memory matters (a full collection costs a tenth
            # of a second in a large process; a small model's waits for the next automatic one)
            if model() is not None and (cuda or held >= RELEASE_NOW_BYTES):
                gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            self._load(config)
        self.num_forwards = self.step_tokens = 0
        self.failed = {}
        logger.info("speculative decoding: %s (the start-up probe took %.2f s)", decision.reason, decision.seconds)
        return decision

    def check_request(self, request: AddRequest) -> AddRequest:
        """The one check of a request, where it enters (the offline command on every rank, the gRPC
        call on a leader): RequestError for a prompt this engine cannot serve (the same answer on every
        rank), else the request as it will run, ready for :meth:`enqueue` (a prefill for a decode
        instance samples one token: the decode instance checks the stop conditions)."""
        vocab = self.config.model.vocab_size
        prompt = request.prompt_token_ids
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        params = request.params
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for word in params.bad_words for t in word if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"bad_words token id {bad} is outside the vocabulary [0, {vocab})")
        if (why := no_token_left(params, vocab, self.config.model.eos_token_ids)) is not None:
            raise RequestError(why)
        if params.structured is not None:
            if not self.constraints.available:
                raise RequestError("structured outputs need the checkpoint's tokenizer (tokenizer.json)")
        if request.kv_transfer == "receive" and (params.prompt_logprobs is not None or params.max_tokens == 0):
            raise RequestError("prompt_logprobs and max_tokens 0 need the prompt computed where the request "
                               "runs: not with prefill/decode disaggregation")
        try:
            check_prompt(request.request_id, len(prompt), request.params.max_tokens, self.config.max_model_len,
                         self.config.cache.block_size, self.runner.num_blocks, self.config.num_spec_tokens)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if request.kv_transfer == "send":
            if not 0 <= request.kv_first_block <= -(-len(prompt) // self.config.cache.block_size):
                raise RequestError(f"first KV block {request.kv_first_block} is past the prompt's blocks")
            request = replace(request, params=replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1),
                                                      prompt_logprobs=None))
        return request

    def enqueue(self, request: AddRequest) -> Request:
        """Queue a request from :meth:`check_request` on this DP group (leader only); its state.
        ValueError only for an id the scheduler already holds."""
        if self.scheduler is None:
            raise RuntimeError("requests go to the leader rank of a DP group")
        state = Request(request.request_id, request.prompt_token_ids, request.params,
                        eos_token_ids=self.config.model.eos_token_ids, kv_transfer=request.kv_transfer,
                        kv_first_block=request.kv_first_block)
        self.scheduler.add_request(state)
        return state

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """:meth:`check_request` then :meth:`enqueue` (leader only); RequestError for a bad request."""
        return self.enqueue(self.check_request(AddRequest(request_id, tuple(prompt_token_ids), params)))

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler is not None and self.scheduler.abort_request(request_id)

    def receive_kv(self, arrival: PrefilledKV) -> None:
        """Decode side (leader): a receiving request's KV and first token; written into its blocks at
        the start of the next step, on every rank of the DP group, before the forward. ``arrival`` comes
        from another instance: checked where it arrives (``engine_server.kv_transport.check_prefilled``),
        so that a malformed one fails its request there, never this engine's step."""
        assert self.scheduler is not None
        self.scheduler.handoff.receive(arrival)

    def take_kv_wanted(self) -> list[KVWanted]:
        """Decode side (leader): the requests whose blocks were allocated since the last call."""
        return self.scheduler.handoff.take_wanted() if self.scheduler is not None else []

    def export_kv(self, request_id: str) -> PrefilledKV:
        """Prefill side (leader, between steps): copy a finished prefill's blocks out and free them."""
        assert self.scheduler is not None
        handoff = self.scheduler.handoff
        request, block_ids = handoff.export_blocks(request_id)
        try:
            data = self.runner.read_kv(block_ids)
        finally:
            handoff.release(request_id)
        logprobs = request.output_logprobs[0] if request.output_logprobs else None
        return PrefilledKV(request_id, request.kv_first_block, data, request.output_token_ids[0], logprobs,
                        request.num_cached_tokens)

    def _take_arrivals(self) -> tuple[list[KVWrite], list[RequestUpdate]]:
        """The arrived KV as block writes for this step, and the first token's update of each."""
        scheduler, writes, updates = self.scheduler, [], []
        assert scheduler is not None
        for write, request in scheduler.handoff.take_arrivals():
            # (a constrained request's first token was drawn under its grammar by the prefill instance)
            self.constraints.accept(request.request_id, request.output_token_ids[:1])
            writes.append(write)
            updates.append(scheduler.start_decoding(request))
        return writes, updates

    def _abort_failed(self) -> None:
        """Abort the requests that cannot go on after this step, alone: a constraint failed them
        (``Constraints.accept``) or their row had no token left to draw (``SamplingPipeline.take_failures``).
        A request sampled this step is reported by this step's update (its token dropped), as "abort",
        with the reason in ``failed``."""
        for rid, why in self.sampling.take_failures().items():
            if self.abort_request(rid):
                self.failed[rid] = why

    def has_unfinished_requests(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_unfinished_requests()

    def expert_loads(self) -> tuple[ExpertLoad, ExpertLoad]:
        """Token copies per (MoE layer, logical expert) and per rank over the whole EP group since
        start-up (or the last reset), and since the last rebalance (what the placement in use saw); one
        collective."""
        layers, total = self.runner.expert_load()
        _, recent = self.runner.expert_load(since_rebalance=True)
        parts: list = gather_objects((total, recent), self.ctx)
        return (ExpertLoad.from_ranks(layers, [p[0].tolist() for p in parts]),
                ExpertLoad.from_ranks(layers, [p[1].tolist() for p in parts]))

    def rebalance_experts(self) -> RebalanceReport | None:
        """Place the experts by the recorded load now (a collective, between steps); None without
        routed experts."""
        return self.runner.balancer.rebalance() if self.runner.balancer is not None else None

    def reset_expert_load(self) -> None:
        if self.runner.balancer is not None:
            self.runner.balancer.reset()

    def step(self, stopping: bool = False) -> list[RequestUpdate]:
        """One lockstep step; every rank must call it (the step loop, :mod:`epserve.engine.loop`, does,
        and times it when profiling). Returns the leader's request updates. ``stopping`` is this rank's
        vote to drain and stop; the step's all-reduce tells every rank (``anybody_stopping``)."""
        scheduler = self.scheduler
        self.failed = {}
        writes, arrived = self._take_arrivals() if scheduler is not None else ([], [])
        if scheduler is not None:
            self._abort_failed()  # (a first token from a prefill instance its grammar refuses)
        output = scheduler.schedule() if scheduler is not None else None
        chunks = list(output.chunks) if output else []  # decodes first
        table = scheduler.kv_manager.table_rows if scheduler is not None else None
        plan = BatchPlan.from_chunks(chunks, self.runner.block_size, table) if chunks else BatchPlan()
        if writes:
            plan = replace(plan, kv_writes=tuple(writes))
        self.step_tokens = plan.num_tokens
        prefilling = plan.num_tokens > plan.num_decode_seqs
        receiving = scheduler.handoff.num_receiving if scheduler is not None else 0
        max_tokens, unfinished, stop, any_prefill, any_writes, any_receiving = all_reduce_max(
            [plan.num_tokens, int(self.has_unfinished_requests()), int(stopping), int(prefilling), int(bool(writes)),
             int(receiving > 0)], self.ctx
        )
        self.anybody_unfinished, self.anybody_stopping = bool(unfinished), bool(stop)
        self.anybody_receiving = bool(any_receiving)
        result, drafts = None, None
        if max_tokens or any_writes:  # (arrived KV is written even when its first token finished the request)
            plan = broadcast_from_leader(plan, self.ctx)
            if plan.kv_writes:
                self.runner.write_kv(plan.kv_writes)
        if max_tokens:
            self.num_forwards += 1
            hidden = self.runner.forward(plan, max_tokens, all_decode=not any_prefill)
            if chunks:
                result = self.runner.profiler.timed("sample", self.sampling.sample, chunks, hidden, plan,
                                                    self.runner.logits)
            if self.runner.proposer is not None:  # every rank: the MTP layer's passes, in lockstep
                drafts = self.runner.propose(chunks, plan, result, hidden, max_tokens, not any_prefill, self.sampling)
            balancer = self.runner.balancer
            if balancer is not None and balancer.record_step():  # every rank at the same step
                balancer.rebalance()
        if scheduler is None:
            return []
        self._abort_failed()
        updates = arrived + scheduler.update(output, result.sampled if result else {},
                                             result.logprobs if result else None, drafts,
                                             result.prompt_logprobs if result else None)
        if not chunks and not updates and scheduler.has_unfinished_requests():
            # Cannot happen while the scheduler keeps its invariants; never spin silently.
            raise RuntimeError(
                f"scheduler stalled: {scheduler.num_running} running, {scheduler.num_waiting} waiting, "
                f"{scheduler.kv_manager.num_free_blocks} free KV blocks"
            )
        for update in updates:
            if update.finished:
                self.sampling.release(update.request_id)
        return updates
