"""What one rank does for the offline API, the same in every process layout.

``generate`` is SPMD: every rank receives the whole request list, checks it identically (so a bad
request is refused everywhere before any collective), spreads it over the DP groups by load with the
same deterministic rule, and steps in lockstep until no group has work; the leaders' results are
then gathered so every rank returns all of them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from epserve.config import EngineConfig
from epserve.engine.engine import LLMEngine
from epserve.engine.profiler import StepRecord
from epserve.engine.request import SamplingParams
from epserve.engine.runner import resolve_device
from epserve.engine.sampler import TokenLogprobs
from epserve.moe.stats import ExpertLoad
from epserve.parallel.comm import gather_objects
from epserve.parallel.context import ParallelContext, init_parallel, make_store, shutdown_parallel
from epserve.parallel.launch import (
    RankInfo,
    RankProcesses,
    die_with_parent,
    free_port,
    pin_to_cores,
    pinning_enabled,
    threads_per_rank,
)

if TYPE_CHECKING:
    from epserve.serve.engine_server import ServeOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OfflineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass
class OfflineResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None


def assign_dp_groups(requests: list[OfflineRequest], dp: int) -> list[int]:
    """Each request to the DP group with the least work so far (prompt + max new tokens), in order;
    deterministic, so every rank computes the same assignment."""
    load = [0] * dp
    groups = []
    for r in requests:
        g = min(range(dp), key=lambda i: (load[i], i))
        load[g] += len(r.prompt_token_ids) + r.params.max_tokens
        groups.append(g)
    return groups


class EngineWorker:
    """One rank: its engine and the offline commands the LLM front end sends to every rank."""

    def __init__(
        self, config: EngineConfig, ctx: ParallelContext | None = None, rendezvous: tuple[str, int] | None = None
    ) -> None:
        self.engine = LLMEngine(config, ctx)
        self.ctx = self.engine.ctx
        self.rendezvous = rendezvous  # (host, port) of the store the ranks met through; None in one process

    @property
    def num_blocks(self) -> int:
        return self.engine.runner.num_blocks

    def generate(self, requests: list[OfflineRequest], use_tqdm: bool = False) -> dict[str, OfflineResult]:
        engine = self.engine
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise _refused(ValueError("request ids must be unique"))
        for r in requests:
            engine.check_request(r.request_id, r.prompt_token_ids, r.params)
        groups = assign_dp_groups(requests, self.ctx.dp)
        mine = [r for r, g in zip(requests, groups) if g == self.ctx.dp_rank] if self.ctx.is_leader else []
        results = {r.request_id: OfflineResult() for r in mine}
        added = {}
        bar = tqdm(total=len(mine), desc="Generating", disable=not (use_tqdm and self.ctx.rank == 0))
        try:
            for r in mine:
                added[r.request_id] = engine.add_request(r.request_id, r.prompt_token_ids, r.params)
            while True:
                for update in engine.step():
                    out = results.get(update.request_id)
                    if out is None:  # e.g. the abort report of an earlier, failed call
                        continue
                    out.token_ids.extend(update.new_token_ids)
                    if update.finished:
                        out.finish_reason = update.finish_reason
                        bar.update(1)
                if not engine.anybody_unfinished:
                    break
        except BaseException:
            for rid in added:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        for rid, request in added.items():
            out = results[rid]
            out.num_cached_tokens = request.num_cached_tokens
            if request.sampling_params.logprobs is not None:
                out.logprobs = list(request.output_logprobs)  # type: ignore[arg-type]
        merged: dict[str, OfflineResult] = {}
        for part in gather_objects(results, self.ctx):
            merged.update(part)  # type: ignore[arg-type]
        return merged

    def expert_load(self) -> ExpertLoad:
        runner = self.engine.runner
        loads = gather_objects(runner.expert_load(), self.ctx)
        return ExpertLoad.from_ranks(self.engine.config.model.moe_layer_ids, loads, runner.placement)  # type: ignore[arg-type]

    def set_overlap(self, mode: str, threshold: int | None = None) -> None:
        """``mode`` and ``threshold`` as validated by the front end (ParallelConfig)."""
        runner = self.engine.runner
        runner.overlap = mode
        if threshold is not None:
            runner.microbatch_threshold = threshold

    def reset_comm_stats(self) -> None:
        self.engine.runner.dispatcher.reset_stats()

    def comm_bytes(self) -> list[dict[str, int]]:
        """Bytes each rank's dispatcher sent to other ranks, in rank order."""
        return gather_objects(dict(self.engine.runner.dispatcher.comm_bytes), self.ctx)  # type: ignore[return-value]

    def set_profiling(self, enabled: bool) -> None:
        self.engine.runner.set_profiling(enabled)

    def profile(self) -> list[list[StepRecord]]:
        """Every rank's step records since profiling was enabled, in rank order."""
        profiler = self.engine.runner.profiler
        steps = [] if profiler is None else [
            StepRecord(r.num_tokens, r.num_seqs, r.is_decode, r.overlap, dict(r.seconds)) for r in profiler.steps
        ]
        return gather_objects(steps, self.ctx)  # type: ignore[return-value]

    def serve(self, options: ServeOptions) -> None:
        """Serve online until every rank is told to stop (SIGTERM/SIGINT on any rank) and has
        drained: leaders run the gRPC engine service, all ranks step in lockstep."""
        from epserve.serve.engine_server import EngineServer

        EngineServer(self, options).serve()

    def close(self) -> None:
        shutdown_parallel()


def _refused(e: Exception) -> Exception:
    e.recoverable = True  # type: ignore[attr-defined]
    return e


def start_rank(info: RankInfo, config: EngineConfig, log_level: int = logging.WARNING) -> EngineWorker:
    """Entry of a rank process (spawned, or this process under torchrun): threads, device, groups."""
    die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{info.rank} %(name)s: %(message)s")
    pc = config.parallel
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
    else:
        torch.set_num_threads(int(os.environ.get("EPSERVE_THREADS_PER_RANK", threads_per_rank(info.local_world_size))))
        if pinning_enabled():
            pin_to_cores(info.local_rank, info.local_world_size)
    store = make_store(info.master_addr, info.master_port, pc.world_size, info.rank, pc.timeout_s)
    ctx = init_parallel(pc.dp, pc.tp, info.rank, device, store, pc.timeout_s)
    return EngineWorker(config, ctx, (info.master_addr, info.master_port))


def join_torchrun(config: EngineConfig, info: RankInfo, world: int) -> EngineWorker:
    """This process as rank ``info.rank`` of a torchrun world of ``world`` processes."""
    if world != config.parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks but dp*tp = {config.parallel.world_size}")
    return start_rank(info, config, logging.getLogger().getEffectiveLevel())


def spawn_ranks(config: EngineConfig) -> RankProcesses:
    """This host's share of the world's ranks as spawned processes (``RankProcesses.infos`` says
    where each sits and where they meet)."""
    pc = config.parallel
    port = pc.master_port if pc.master_port is not None else free_port()
    local = pc.local_world_size
    infos = [RankInfo(pc.node_rank * local + i, i, local, pc.master_addr, port) for i in range(local)]
    logger.info("starting %d rank processes (dp=%d, tp=%d, node %d of %d)", local, pc.dp, pc.tp, pc.node_rank,
                pc.nnodes)
    return RankProcesses(start_rank, infos, (config, logging.getLogger().getEffectiveLevel()))
