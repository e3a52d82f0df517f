"""Offline API: ``LLM(path, dp=2, tp=1).generate(prompts, SamplingParams(...))``.

One process for EP = 1. For more ranks, ``LLM`` spawns ``dp*tp`` rank processes on this host (or
``dp*tp/nnodes`` of them per host with ``nnodes``, every host running the same program) and drives
them; under ``torchrun`` this process is itself one rank and every rank runs the same program.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from epserve.config import OverlapSetting
from epserve.engine.balancer import RebalanceReport
from epserve.engine.engine import LLMEngine
from epserve.engine.options import EngineOptions, build_engine_config
from epserve.engine.profiler import StepRecord
from epserve.engine.spec_probe import unprobed
from epserve.engine.worker import EngineWorker, join_torchrun, spawn_ranks
from epserve.messages.commands import (
    Generate,
    GetCacheInfo,
    GetCommBytes,
    GetExpertLoad,
    GetProfile,
    GetSpeculativeStats,
    RebalanceExperts,
    ResetCommStats,
    ResetExpertLoad,
    SetOverlap,
    SetProfiling,
    WorkerCommand,
)
from epserve.messages.engine import AddRequest
from epserve.messages.expert_load import ExpertLoad
from epserve.messages.sampling import SamplingParams, TokenLogprobs
from epserve.parallel.launch import RankFailure, RankProcesses, torchrun_rank
from epserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # asked for: None, then one per prompt token


class LLM:
    """An engine with a tokenizer. ``model=None`` uses the built-in tiny checkpoint."""

    def __init__(
        self, model: str | Path | None = None, dtype: str = EngineOptions.dtype, device: str = EngineOptions.device,
        **options: Any,
    ) -> None:
        """``options``: the fields of ``EngineOptions`` (engine/options.py: ``block_size``, ``num_blocks``,
        ``max_num_seqs``, ``max_model_len``, ``dp``, ``tp``, ``dispatch``, ``overlap``, ``quantization``,
        ``kv_cache_dtype``, ...), as :func:`build_engine_config` takes them; TypeError naming any other."""
        self.config = build_engine_config(model, dtype, device, **options)
        path = self.config.model_path
        parallel = self.config.parallel
        self.tokenizer = load_tokenizer(path)
        self._ids = itertools.count()
        self._worker: EngineWorker | None = None
        self._ranks: RankProcesses | None = None
        self.rank = 0  # this process's rank in the world (0 unless under torchrun)
        torchrun = torchrun_rank()
        if parallel.world_size == 1 and (torchrun is None or torchrun[1] == 1):
            self._worker = EngineWorker(self.config)
        elif torchrun is not None:
            info, world = torchrun
            self.rank = info.rank
            try:
                self._worker = join_torchrun(self.config, info, world)
            except RuntimeError as e:  # a start-up collective failed: a peer is gone (as in _call)
                if isinstance(e, RankFailure):
                    raise
                raise RankFailure(f"rank {self.rank} failed while starting: {str(e).splitlines()[0]}") from e
            atexit.register(self.shutdown)  # (the groups' threads must end before the interpreter finalizes)
        else:
            self.rank = parallel.node_rank * parallel.local_world_size
            self._ranks = spawn_ranks(self.config)
            atexit.register(self.shutdown)

    # ---- properties -------------------------------------------------------------------------
    @property
    def engine(self) -> LLMEngine | None:
        """This process's engine when it is a rank itself (one process, or torchrun); else None."""
        return self._worker.engine if self._worker is not None else None

    @property
    def is_main_process(self) -> bool:
        """Whether this process should print results (rank 0, or the front end of spawned ranks)."""
        return self.rank == 0

    def _call(self, command: WorkerCommand) -> Any:
        """Run ``command`` on every rank: this process's own worker, or the spawned ranks."""
        if self._worker is not None:
            try:
                return self._worker.handle(command)
            except RuntimeError as e:  # under torchrun a failed collective means a peer is gone
                if not self._worker.ctx.distributed or isinstance(e, RankFailure):
                    raise
                raise RankFailure(f"rank {self.rank} failed: {str(e).splitlines()[0]}") from e
        if self._ranks is None:
            raise RankFailure("this rank has left the world (shut down)")
        return self._ranks.call(command)

    # ---- API ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        outputs = []
        requests = []
        for prompt, p in zip(prompts, params_list):
            rid = str(next(self._ids))
            token_ids = self._encode(prompt)
            outputs.append(RequestOutput(rid, prompt if isinstance(prompt, str) else None, token_ids))
            requests.append(AddRequest(rid, tuple(token_ids), p))
        results = self._call(Generate(tuple(requests), use_tqdm))
        for out in outputs:
            res = results[out.request_id]
            out.token_ids = res.token_ids
            out.finish_reason = res.finish_reason
            out.num_cached_tokens = res.num_cached_tokens
            out.logprobs = res.logprobs
            out.prompt_logprobs = res.prompt_logprobs
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(out.token_ids)
        return outputs

    def cache_info(self) -> dict[str, int | str]:
        """The paged KV cache: ``num_blocks``, ``block_size``, ``bytes_per_token`` (all layers, one
        rank) and ``kv_cache_dtype``; every rank holds the same pool."""
        return self._call(GetCacheInfo())

    def speculative_stats(self) -> dict[str, object] | None:
        """Draft acceptance since start-up, over every DP group: ``num_drafts`` (decodes that verified
        drafts), ``num_draft_tokens``, ``num_accepted_tokens``, ``acceptance_rate`` and
        ``accepted_per_position`` (how often draft ``j`` was accepted); None without speculative decoding
        (whether the engine drafts and why: :meth:`speculative_decision`)."""
        return self._call(GetSpeculativeStats())

    def speculative_decision(self) -> dict[str, object]:
        """Whether the engine drafts with MTP and why (``mtp``, ``reason``: one line, as logged at start-up), and
        where it decided by its start-up probe (``engine/spec_probe.py``) the figures: ``acceptance``, ``speeds``
        (each batch timed: plain and MTP decode tokens/s, their ratio, a drafting step's cost in plain steps), the
        rule it drafts by (``max_requests``, ``break_even_acceptance``) and ``probe_seconds``."""
        if self.engine is not None:
            return self.engine.speculation.as_dict()
        return unprobed(self.config).as_dict()  # (spawned ranks: the options decide, no probe)

    def expert_load(self) -> ExpertLoad:
        """Tokens per (MoE layer, logical expert) and per rank since start-up, and the imbalance."""
        return self._call(GetExpertLoad())

    def rebalance_experts(self) -> RebalanceReport | None:
        """Place the experts by the load recorded so far (the EPLB window with ``enable_eplb``, else
        since start-up or :meth:`reset_expert_load`), moving the weights that change rank; what moved
        and the imbalance before and after. None for a model without routed experts."""
        return self._call(RebalanceExperts())

    def reset_expert_load(self) -> None:
        """Clear the expert-load statistics (and the EPLB window)."""
        self._call(ResetExpertLoad())

    def set_overlap(self, mode: OverlapSetting, microbatch_threshold: int | None = None) -> None:
        """Switch the overlap mode (``none``, ``dispatch``, ``microbatch``, ``auto``) between calls."""
        threshold = self.config.parallel.microbatch_threshold if microbatch_threshold is None else microbatch_threshold
        parallel = replace(self.config.parallel, overlap=mode, microbatch_threshold=threshold)
        self.config = replace(self.config, parallel=parallel)  # ConfigError for a bad mode or threshold
        self._call(SetOverlap(parallel.overlap, microbatch_threshold))

    def comm_bytes(self) -> list[dict[str, int]]:
        """Bytes each rank's dispatcher sent to other ranks (``dispatch``, ``combine``) since the
        last :meth:`reset_comm_stats`, in rank order."""
        return self._call(GetCommBytes())

    def reset_comm_stats(self) -> None:
        self._call(ResetCommStats())

    def set_profiling(self, enabled: bool) -> None:
        """Record every op's wall time per step on every rank (benchmarks; costs a little)."""
        self._call(SetProfiling(enabled))

    def profile(self) -> list[list[StepRecord]]:
        """Each rank's per-step op times since profiling was enabled, in rank order."""
        return self._call(GetProfile())

    def shutdown(self) -> None:
        """Stop the rank processes; as a torchrun rank, leave the world (nothing to do for a one-process
        engine). Idempotent.

        A torchrun rank's process groups keep gloo's threads alive until their last reference goes. Left
        to the interpreter's finalization, they outlive the point after which a thread that takes the GIL
        is ended on the spot; one still releasing the last collective's tensors (which need the GIL) then
        aborts the process ("terminate called without an active exception"). So the worker closes the
        groups and is dropped, and the collection that follows joins those threads here."""
        if self._ranks is not None:
            self._ranks.close()
            atexit.unregister(self.shutdown)
        elif self._worker is not None and self._worker.ctx.distributed:
            worker, self._worker = self._worker, None
            atexit.unregister(self.shutdown)
            worker.close()
            del worker
            gc.collect()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass token-id prompts")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids")
        return list(prompt)

