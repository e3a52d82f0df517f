"""One rank: its engine, the offline commands the ``LLM`` front end sends it, and how rank processes
start.

The commands are small frozen dataclasses, the same in every process layout: ``LLM`` hands them to
:meth:`EngineWorker.handle` in this process (one rank, or torchrun) or sends them to spawned ranks
(``RankProcesses.call``). ``Generate`` is SPMD: every rank receives the whole request list, checks it
identically (so a bad request is refused everywhere before any collective), spreads it over the DP
groups by load with the same deterministic rule, and runs the step loop (:mod:`epserve.engine.loop`)
until no group has work, each leader's :class:`OfflineFrontend` feeding it its share and collecting
what it delivers; the leaders' results are then gathered so every rank returns all of them.

A rank process runs an *entry* function (``start_rank`` for the offline API; the serving layer
passes its own to :func:`spawn_ranks`), so this module knows nothing of what sits above it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from tqdm import tqdm

from epserve.config import EngineConfig, OverlapSetting, ParallelConfig
from epserve.engine.engine import LLMEngine, RequestError
from epserve.engine.loop import EngineLoop
from epserve.engine.profiler import StepRecord
from epserve.engine.runner import resolve_device
from epserve.engine.spec_decode import merge_stats
from epserve.env import collectives_on, pinning_enabled
from epserve.kernels import cpu_threads
from epserve.messages.commands import (
    Generate,
    GetCacheInfo,
    GetCommBytes,
    GetExpertLoad,
    GetProfile,
    GetSpeculativeStats,
    OfflineResult,
    RebalanceExperts,
    ResetCommStats,
    ResetExpertLoad,
    SetOverlap,
    SetProfiling,
    WorkerCommand,
)
from epserve.messages.engine import AddRequest, GeneratedTokens, LoopOutput, RequestFailed
from epserve.messages.sampling import TokenLogprobs
from epserve.parallel.addresses import facing_peers, wait_reachable
from epserve.parallel.comm import gather_objects
from epserve.parallel.context import (
    ParallelContext,
    Store,
    init_parallel,
    make_store,
    serves_store,
    shutdown_parallel,
    wait_for_ranks,
)
from epserve.parallel.launch import RankProcesses, free_port, pin_to_cores, threads_per_rank
from epserve.parallel.process import die_with_parent
from epserve.parallel.spawned import RankHandler, RankInfo

logger = logging.getLogger(__name__)


def assign_dp_groups(requests: list[AddRequest], dp: int) -> list[int]:
    """Each request to the DP group with the least work so far (prompt + max new tokens), in order;
    deterministic, so every rank computes the same assignment."""
    load = [0] * dp
    groups = []
    for r in requests:
        g = min(range(dp), key=lambda i: (load[i], i))
        load[g] += len(r.prompt_token_ids) + r.params.max_tokens
        groups.append(g)
    return groups


class OfflineFrontend:
    """The step loop's frontend for one ``Generate`` call on a leader: what the loop delivers for this
    call's requests, collected into their results (a request of an earlier, failed call is ignored)."""

    def __init__(self, requests: list[AddRequest], bar: tqdm) -> None:
        self.bar = bar
        self.token_ids: dict[str, list[int]] = {r.request_id: [] for r in requests}
        self.logprobs: dict[str, list[TokenLogprobs] | None] = {
            r.request_id: [] if r.params.logprobs is not None else None for r in requests}
        self.prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self.last: dict[str, GeneratedTokens] = {}  # each finished request's last message
        self.failure: str | None = None  # the first request that did not run, why

    def deliver(self, outputs: list[LoopOutput]) -> None:
        token_ids = self.token_ids
        for out in outputs:
            if isinstance(out, GeneratedTokens):
                tokens = token_ids.get(out.request_id)
                if tokens is None:
                    continue
                tokens.extend(out.token_ids)
                if out.logprobs:
                    self.logprobs[out.request_id].extend(out.logprobs)  # type: ignore[union-attr]
                if out.prompt_logprobs:
                    self.prompt_logprobs[out.request_id] = [None, *out.prompt_logprobs]
                if out.finish_reason is not None:
                    self.last[out.request_id] = out
                    self.bar.update(1)
            elif isinstance(out, RequestFailed) and self.failure is None:
                self.failure = f"request {out.request_id!r}: {out.message}"

    def set_draining(self) -> None:
        pass  # offline ranks never vote to stop

    def results(self) -> dict[str, OfflineResult]:
        out = {}
        for rid, tokens in self.token_ids.items():
            last = self.last.get(rid)
            out[rid] = OfflineResult(tokens, last.finish_reason if last else None,
                                     last.num_cached_tokens if last else 0, self.logprobs[rid],
                                     self.prompt_logprobs.get(rid))
        return out


class EngineWorker:
    """One rank: its engine and the offline commands (:data:`WorkerCommand`)."""

    def __init__(
        self, config: EngineConfig, ctx: ParallelContext | None = None, rendezvous: tuple[str, int] | None = None
    ) -> None:
        self.engine = LLMEngine(config, ctx)
        self.ctx = self.engine.ctx
        self.rendezvous = rendezvous  # (host, port) of the store the ranks met through; None in one process

    def handle(self, command: WorkerCommand) -> object:
        """Run one command (the same on every rank)."""
        match command:
            case Generate(requests, use_tqdm):
                return self.generate(list(requests), use_tqdm)
            case GetExpertLoad():
                return self.engine.expert_loads()[0]
            case RebalanceExperts():
                return self.engine.rebalance_experts()
            case ResetExpertLoad():
                return self.engine.reset_expert_load()
            case SetOverlap(mode, threshold):
                return self.set_overlap(mode, threshold)
            case ResetCommStats():
                return self.engine.runner.dispatcher.reset_stats()
            case GetCommBytes():
                return self.comm_bytes()
            case SetProfiling(enabled):
                return self.engine.runner.set_profiling(enabled)
            case GetProfile():
                return self.profile()
            case GetCacheInfo():
                return self.engine.runner.cache_info()
            case GetSpeculativeStats():
                return self.speculative_stats()
        raise TypeError(f"unknown command {command!r}")

    def generate(self, requests: list[AddRequest], use_tqdm: bool = False) -> dict[str, OfflineResult]:
        """The ``Generate`` command (every rank, the same list): each request's result, on every rank.
        An exception aborts the requests this call added (the loop does) and is raised."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise RequestError("request ids must be unique")
        checked = [self.engine.check_request(r) for r in requests]
        groups = assign_dp_groups(requests, self.ctx.dp)
        mine = [r for r, g in zip(checked, groups) if g == self.ctx.dp_rank] if self.ctx.is_leader else []
        loop = EngineLoop(self.engine)
        frontend = OfflineFrontend(mine, tqdm(total=len(mine), desc="Generating",
                                              disable=not (use_tqdm and self.ctx.rank == 0)))
        for request in mine:
            loop.submit(request, ring=False)  # taken by the loop's first pass (an offline loop never sleeps)
        try:
            loop.run(frontend, until_idle=True)
        finally:
            frontend.bar.close()
        merged: dict[str, OfflineResult] = {}
        failures = []
        for results, failure in gather_objects((frontend.results(), frontend.failure), self.ctx):
            merged.update(results)  # type: ignore[arg-type]
            failures += [failure] if failure is not None else []
        if failures:  # cannot happen for ids that are unique and new to the scheduler; every rank alike
            raise RequestError(failures[0])
        return merged

    def speculative_stats(self) -> dict[str, object] | None:
        """Draft acceptance summed over the DP groups (a collective); None without speculative decoding."""
        stats = self.engine.sampling.speculative_stats() if self.ctx.is_leader else None
        parts = [p for p in gather_objects(stats, self.ctx) if p is not None]
        return merge_stats(parts) if parts else None  # type: ignore[arg-type]

    def set_overlap(self, mode: OverlapSetting, threshold: int | None = None) -> None:
        runner = self.engine.runner
        runner.overlap = mode
        if threshold is not None:
            runner.microbatch_threshold = threshold

    def comm_bytes(self) -> list[dict[str, int]]:
        """Bytes each rank's dispatcher sent to other ranks, in rank order."""
        return gather_objects(dict(self.engine.runner.dispatcher.comm_bytes), self.ctx)  # type: ignore[return-value]

    def profile(self) -> list[list[StepRecord]]:
        """Every rank's step records since profiling was enabled, in rank order."""
        steps = [StepRecord(r.num_tokens, r.num_seqs, r.is_decode, r.overlap, dict(r.seconds))
                 for r in self.engine.runner.profiler.steps]
        return gather_objects(steps, self.ctx)  # type: ignore[return-value]

    def close(self) -> None:
        """Leave the world: the CPU threads' monitor stopped, the process groups destroyed (gloo's threads end
        with the groups' last reference: ``LLM.shutdown`` drops this worker for that)."""
        cpu_threads.stop()
        shutdown_parallel()


def start_rank(info: RankInfo, config: EngineConfig, log_level: int = logging.WARNING) -> EngineWorker:
    """Entry of a rank process (spawned, or this process under torchrun): threads, device, groups;
    returns its worker, which runs the offline commands."""
    die_with_parent()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s rank{info.rank} %(name)s: %(message)s")
    pc = config.parallel
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
    else:
        torch.set_num_threads(threads_per_rank(info.local_world_size))
        if pinning_enabled():
            pin_to_cores(info.local_rank, info.local_world_size)
    store = _rendezvous(info, pc)
    ctx = init_parallel(pc.dp, pc.tp, info.rank, device, store, pc.timeout_s)
    return EngineWorker(config, ctx, (info.master_addr, info.master_port))


def _rendezvous(info: RankInfo, pc: ParallelConfig) -> Store:
    """Bind gloo/NCCL to the interface that faces the peers (parallel/addresses.py: ``lo`` for a
    loopback world, else the route to the master or ``--node-ip``; the user's *_SOCKET_IFNAME win),
    reach the store within the rendezvous timeout and wait for every rank: a peer that cannot be
    reached fails here in one line, not in gloo."""
    addr, port = info.master_addr, info.master_port
    multi_host = pc.nnodes > 1 or info.local_world_size < pc.world_size
    peer = facing_peers(addr, multi_host, pc.node_ip)
    collectives_on(peer.interface)
    logger.info("rank %d: peers meet this host at %s (%s)", info.rank, peer.describe(), peer.reason)
    if not serves_store(info.rank):
        wait_reachable(addr, port, pc.rendezvous_timeout_s, peer)
    store = make_store(addr, port, pc.world_size, info.rank, pc.timeout_s, multi_host=multi_host)
    wait_for_ranks(store, pc.world_size, pc.timeout_s, f"{addr}:{port}")
    return store


def join_torchrun(config: EngineConfig, info: RankInfo, world: int) -> EngineWorker:
    """This process as rank ``info.rank`` of a torchrun world of ``world`` processes."""
    if world != config.parallel.world_size:
        raise ValueError(f"torchrun started {world} ranks but dp*tp = {config.parallel.world_size}")
    return start_rank(info, config, logging.getLogger().getEffectiveLevel())


RankEntry = Callable[..., RankHandler]  # entry(info, config, log_level, *args) -> the rank's handler


def spawn_ranks(config: EngineConfig, entry: RankEntry = start_rank, args: tuple = (),
                wait: bool = True) -> RankProcesses:
    """This host's share of the world's ranks as spawned processes, each running
    ``entry(info, config, log_level, *args)`` (default: an offline :class:`EngineWorker`);
    ``RankProcesses.infos`` says where each sits and where they meet. ``wait=False``: return as soon
    as the processes run (``RankProcesses.wait_started`` waits for their entries)."""
    pc = config.parallel
    port = pc.master_port if pc.master_port is not None else free_port()
    local = pc.local_world_size
    infos = [RankInfo(pc.node_rank * local + i, i, local, pc.master_addr, port) for i in range(local)]
    logger.info("starting %d rank processes (dp=%d, tp=%d, node %d of %d)", local, pc.dp, pc.tp, pc.node_rank,
                pc.nnodes)
    # CPU ranks fork from a server that imported torch and the engine once (seconds saved per rank);
    # CUDA ranks are spawned fresh, so none inherits a CUDA driver from a parent.
    start = "spawn" if config.device.startswith("cuda") else "forkserver"
    # all the world's ranks here (one host): they get a secret of their own that keys the doorbell beside the
    # engine token (parallel/launch.py)
    return RankProcesses(entry, infos, (config, logging.getLogger().getEffectiveLevel(), *args), start, wait,
                         whole_world=local == pc.world_size)
