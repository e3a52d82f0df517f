"""Ranks and process groups of one EP deployment, built once at start-up and handed to the model.

Rank ``r`` of the ``DP × TP = EP`` world belongs to DP group ``r // TP`` as TP rank ``r % TP``; TP
rank 0 of each group is its leader (scheduler, KV bookkeeping, sampling). Tensor traffic (dispatch,
combine, TP reduce-scatter / all-gather) runs on the device backend (``nccl`` on CUDA, ``gloo`` on
CPU); small host-side metadata (the step's all-reduce, batch broadcasts) always runs on gloo.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup


@dataclass(frozen=True)
class ParallelContext:
    dp: int
    tp: int
    rank: int
    device: torch.device
    ep_group: ProcessGroup | None = None  # device backend, every rank
    meta_group: ProcessGroup | None = None  # gloo, every rank
    tp_group: ProcessGroup | None = None  # device backend, this DP group's TP ranks
    tp_meta_group: ProcessGroup | None = None  # gloo, this DP group's TP ranks

    @classmethod
    def single(cls, device: torch.device) -> ParallelContext:
        """One process, no torch.distributed: the EP = 1 layout."""
        return cls(dp=1, tp=1, rank=0, device=device)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def ep_size(self) -> int:
        return self.world_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def leader_rank(self) -> int:
        """Global rank of this DP group's leader."""
        return self.dp_rank * self.tp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def device_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel(
    dp: int,
    tp: int,
    rank: int,
    device: torch.device,
    store: dist.Store,
    timeout_s: float = 600.0,
) -> ParallelContext:
    """Join the ``dp*tp`` world through ``store`` and create the groups. Every rank must call it."""
    world = dp * tp
    backend = device_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    ep_group = dist.group.WORLD
    meta_group = ep_group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    tp_group = tp_meta_group = None
    for g in range(dp):  # every rank creates every group, in the same order
        ranks = list(range(g * tp, (g + 1) * tp))
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        meta = group if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
        if rank in ranks:
            tp_group, tp_meta_group = group, meta
    ctx = ParallelContext(dp, tp, rank, device, ep_group, meta_group, tp_group, tp_meta_group)
    logger.info("rank %d/%d joined: dp_rank %d, tp_rank %d, %s on %s", rank, world, ctx.dp_rank, ctx.tp_rank,
                backend, device)
    return ctx


def make_store(host: str, port: int, world_size: int, rank: int, timeout_s: float = 600.0) -> dist.Store:
    """The rendezvous store: under torchrun the agent already serves it, so every rank is a client;
    otherwise rank 0 serves it."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0 and not agent_store,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return dist.PrefixStore(_store_prefix(), store)


def store_client(host: str, port: int, timeout_s: float = 600.0) -> dist.Store:
    """Another connection to the rendezvous store (its own socket, so a blocking wait on one client
    never holds up another's calls); keys as :func:`make_store` sees them."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(_store_prefix(), store)


def _store_prefix() -> str:
    return f"epserve/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
