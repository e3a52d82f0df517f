"""Ranks and process groups of one EP deployment, built once at start-up and handed to the model.

Rank ``r`` of the ``DP × TP = EP`` world belongs to DP group ``r // TP`` as TP rank ``r % TP``; TP
rank 0 of each group is its leader (scheduler, KV bookkeeping, sampling). Tensor traffic (dispatch,
combine, TP reduce-scatter / all-gather) runs on the device backend (``nccl`` on CUDA, ``gloo`` on
CPU); small host-side metadata (the step's all-reduce, batch broadcasts) always runs on gloo.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.parallel.addresses import RendezvousError, store_listens_everywhere

logger = logging.getLogger(__name__)

ProcessGroup = dist.ProcessGroup
Store = dist.Store


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


def serves_store(rank: int) -> bool:
    """Whether this rank serves the rendezvous store (rank 0, unless torchrun's agent serves it)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def make_store(host: str, port: int, world_size: int, rank: int, timeout_s: float = 600.0,
               multi_host: bool = False) -> dist.Store:
    """The rendezvous store: under torchrun the agent already serves it, so every rank is a client;
    otherwise rank 0 serves it, listening on ``host`` only (loopback on a single host; the master
    address across hosts), not on every interface. Exception: a world across hosts whose master name
    resolves to loopback on the master's own host (``/etc/hosts``) listens on every interface, for
    the peers reach it by that name at another address."""
    is_master = serves_store(rank)
    listener = None
    if is_master and not store_listens_everywhere(host, multi_host):
        listener = _listen_on(host, port)
    elif is_master:
        logger.info("rendezvous store: %s is loopback on this host but the world spans hosts; "
                    "listening on every interface", host)
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.fileno() if listener is not None else None,
    )
    if listener is not None:
        _LISTENERS.append(listener)  # the store serves on this socket's descriptor for the process's life
    return dist.PrefixStore(_store_prefix(), store)


_LISTENERS: list[socket.socket] = []


def wait_for_ranks(store: dist.Store, world_size: int, timeout_s: float, where: str) -> None:
    """Every rank checks in at the store, then waits (at most ``timeout_s``) until all have:
    RendezvousError in one line naming how many came, instead of a gloo stack per rank."""
    arrived = store.add("rendezvous/arrived", 1)
    deadline = time.monotonic() + timeout_s
    while arrived < world_size:
        if time.monotonic() >= deadline:
            raise RendezvousError(f"only {arrived} of {world_size} ranks reached the rendezvous at {where} "
                                  f"within {timeout_s:g} s")
        time.sleep(0.05)
        arrived = store.add("rendezvous/arrived", 0)


def _listen_on(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host:port`` for the store to serve on; None (the store then listens on
    every interface, as torch does by default) when ``host`` is not an address of this machine, as
    behind NAT or a container's service name."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        return socket.create_server(address[:2], family=family, backlog=1024)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise RuntimeError(f"rendezvous store: cannot listen on {host}:{port}: the port is in use") from None
        logger.warning("rendezvous store: cannot listen on %s:%d only (%s); listening on every interface",
                       host, port, e)
        return None


def store_client(host: str, port: int, timeout_s: float = 600.0) -> dist.Store:
    """Another connection to the rendezvous store (its own socket, so a blocking wait on one client
    never holds up another's calls); keys as :func:`make_store` sees them."""
    store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(_store_prefix(), store)


def _store_prefix() -> str:
    return f"epserve/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def set_collective_timeout(ctx: ParallelContext, timeout_s: float) -> None:
    """From now on a collective of this rank's groups that waits longer than ``timeout_s`` raises (a
    peer hung or died). Start-up runs under the longer ``init_parallel`` timeout: loading may keep
    one rank from a collective for minutes."""
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if not ctx.distributed or set_timeout is None:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = {id(g): g for g in (ctx.ep_group, ctx.meta_group, ctx.tp_group, ctx.tp_meta_group) if g is not None}
    for group in groups.values():
        set_timeout(timeout, group)


def shutdown_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
