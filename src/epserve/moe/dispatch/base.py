"""The dispatcher contract: move tokens to the ranks owning their experts and back.

``dispatch(x[T,H], topk_ids[T,K], topk_weights[T,K]) -> (ExpertInput, handle)``: received tokens
grouped by local expert plus the count per local expert. ``combine(y, handle) -> out[T,H]``: the
routing-weighted sum of expert outputs in the original token order. The split halves
(``dispatch_send``/``dispatch_recv``, ``combine_send``/``combine_recv``) are the overlap points: work
placed between a send and its receive (the shared expert, the other micro-batch) hides the transfer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from epserve.moe.dispatch.payload import Payload


@dataclass(frozen=True)
class ExpertInput:
    """Tokens for this rank's experts, grouped by local expert slot. ``hidden_states`` may end with
    padding rows past ``sum(num_tokens_per_expert)`` (a fixed-shape backend's): zero rows whose expert
    outputs are zero, or, ``masked``, rows never written whose expert outputs are never written either
    (the GEMMs skip them; the backend's combine never reads them). The counts stay on the device: reading
    them on the host (``counts_list``) is a sync that only a backend that already made one
    (``host_counts``) gets for free. ``rows_per_expert``: the real rows a slot is expected to get this step
    (host arithmetic from the step's token count, no sync), from which the GEMMs pick their row tile."""

    hidden_states: torch.Tensor  # [N, H], rows of local slot 0 first, then slot 1, …, then padding
    num_tokens_per_expert: torch.Tensor  # [num_local_slots] int64, on the device of hidden_states
    host_counts: tuple[int, ...] | None = None  # the same counts, when the backend has them on the host
    # With an FP8 payload (``--dispatch-dtype fp8``): ``hidden_states`` is float8 e4m3 and ``scales`` its
    # fp32 scale per row and 128 columns [N, H/128], the activation quantization of the FP8 expert GEMM.
    # With an NVFP4 payload (``--dispatch-dtype nvfp4``): ``hidden_states`` is uint8 [N, H/2] (two e2m1 codes
    # a byte), ``scales`` float8_e4m3fn [N, H/16] and ``global_scale`` fp32 [N], one per row (payload.py).
    scales: torch.Tensor | None = None
    masked: bool = False
    rows_per_expert: float | None = None
    global_scale: torch.Tensor | None = None

    def counts_list(self) -> tuple[int, ...]:
        """Rows per local slot on the host (a device sync unless ``host_counts``)."""
        return self.host_counts if self.host_counts is not None else tuple(self.num_tokens_per_expert.tolist())


class DispatchHandle:
    """Backend-specific state carried from dispatch to combine (each backend subclasses it as a
    frozen dataclass)."""


class Dispatcher(ABC):
    """One backend per file; chosen once at start-up; model code never branches on it."""

    name: str
    comm_bytes: dict[str, int]  # bytes this rank sent to other ranks since reset_stats, per phase

    def reset_stats(self) -> None:
        """Zero ``comm_bytes`` (``dispatch``, ``combine``); backends call it from ``__init__``."""
        self.comm_bytes = {"dispatch": 0, "combine": 0}

    def workspace_bytes(self) -> int:
        """Device memory this dispatcher holds beside the weights and the KV cache (symmetric buffers
        allocated at start-up), for the memory plan; 0 for backends that allocate per step."""
        return 0

    def begin_step(self, max_tokens_per_rank: int) -> None:  # noqa: B027 - an optional hook
        """Called by the runner once per step, before the forward, with the global maximum number of
        tokens any rank feeds into one MoE layer this step, from the step's all-reduce. Backends with
        fixed-size buffers size them from it; the default ignores it."""

    @abstractmethod
    def dispatch_send(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        real_rows: torch.Tensor | None = None,
    ) -> DispatchHandle:
        """Start sending; ``topk_ids`` are physical expert slots. Returns the in-flight handle. ``real_rows``
        [T] bool: False at a captured bucket's padding rows (None: every row real). A backend that can leaves
        their copies unsent, so no rank computes or counts them (``padded``, ``symm_mem``); ``local`` sends them
        as any row (its one rank counts the real rows' copies itself: ``model/moe.py``), ``all_to_all`` never
        meets them (it runs eagerly)."""

    @abstractmethod
    def dispatch_recv(self, handle: DispatchHandle) -> tuple[ExpertInput, DispatchHandle]:
        """Wait for the tokens; returns them grouped by local expert and the handle for combine."""

    @abstractmethod
    def combine_send(self, y: torch.Tensor, handle: DispatchHandle) -> DispatchHandle:
        """Start returning expert outputs ``y`` ([N, H], same order as ``ExpertInput``)."""

    @abstractmethod
    def combine_recv(self, handle: DispatchHandle) -> torch.Tensor:
        """Wait for the outputs; returns ``[T, H]``, weighted and summed over each token's top-k."""

    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
        real_rows: torch.Tensor | None = None,
    ) -> tuple[ExpertInput, DispatchHandle]:
        return self.dispatch_recv(self.dispatch_send(x, topk_ids, topk_weights, real_rows))

    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self.combine_recv(self.combine_send(y, handle))


class GroupDispatcher(Dispatcher):
    """A dispatcher over the ranks of an expert-parallel process group (``all_to_all``, ``padded``): this
    rank's ``num_local_slots`` expert slots, its place in ``group``, and the row format it sends (``fp8``,
    ``nvfp4``: ``payload.py``)."""

    def __init__(self, num_local_slots: int, group: dist.ProcessGroup, fp8: bool = False, *,
                 nvfp4: bool = False) -> None:
        self.num_local_slots = num_local_slots
        self.payload = Payload(fp8, nvfp4)
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.reset_stats()
