"""Roofline primitives: FLOPs and bytes from shapes, kernel time, link time.

- GEMM ``[m, k] x [k, n]``: ``2mkn`` FLOPs, ``mk + nk + mn`` elements moved.
- GroupGEMM over ``g`` groups of ``m`` tokens: ``2gmkn`` FLOPs, ``g(mk + nk + mn)`` elements.
- A kernel takes ``floor + max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth)``; the
  achievable bandwidth may depend on the rows each weight is applied to and on the weight's size
  (``HardwareSpec.memory_by_rows``).
- A transfer takes ``latency + max(NVLink bytes / NVLink rate, IB bytes / IB rate)``; both links
  run at once, each at its achievable fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from epserve.planner.hardware import HardwareSpec


@dataclass(frozen=True)
class Work:
    flops: float
    bytes: float

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: its work, the class of kernel (for the achievable fraction), the dtype
    its tensor cores run in (for the peak) and, for GEMMs, the rows each weight is applied to
    (``m``; tokens per expert for a grouped GEMM; 0 = not a weight-streaming kernel), the bytes of
    one weight matrix (one expert's, for a grouped GEMM) and its depth (``k``)."""

    kernel_class: str  # gemm | group_gemm | attention | attention_prefill | other
    work: Work
    dtype: str = "bf16"
    rows: float = 0.0
    matrix_bytes: float = 0.0
    depth: float = 0.0  # K of a GEMM (0: not a GEMM)


@dataclass(frozen=True)
class KernelTime:
    compute_us: float
    memory_us: float
    floor_us: float

    @property
    def time_us(self) -> float:
        return self.floor_us + max(self.compute_us, self.memory_us)

    @property
    def bound(self) -> str:
        """What limits the kernel: ``compute``, ``memory`` or, for tiny kernels, ``latency``."""
        if self.floor_us > max(self.compute_us, self.memory_us):
            return "latency"
        return "compute" if self.compute_us >= self.memory_us else "memory"


def gemm_work(m: float, k: int, n: int, *, in_bytes: float = 2, weight_bytes: float = 2, out_bytes: float = 2) -> Work:
    """``[m, k] x [k, n]``: 2mkn FLOPs; mk input, nk weight and mn output elements."""
    return Work(2 * m * k * n, m * k * in_bytes + n * k * weight_bytes + m * n * out_bytes)


def group_gemm_work(
    g: float, m: float, k: int, n: int, *, in_bytes: float = 2, weight_bytes: float = 2, out_bytes: float = 2
) -> Work:
    """``g`` independent ``[m, k] x [k, n]`` GEMMs (one per expert): 2gmkn FLOPs, g(mk + nk + mn) elements."""
    one = gemm_work(m, k, n, in_bytes=in_bytes, weight_bytes=weight_bytes, out_bytes=out_bytes)
    return Work(g * one.flops, g * one.bytes)


def tokens_per_expert(batch_per_gpu: float, query_len: int, top_k: int, ep: int, n_experts: int) -> float:
    """Mean tokens each expert receives in one decode step: ``batch * query_len * top_k * EP / E``."""
    return batch_per_gpu * query_len * top_k * ep / n_experts


def activated_experts(slots_per_gpu: int, num_slots: int, top_k: int, global_tokens: float) -> float:
    """Expected local experts that receive at least one of ``global_tokens`` tokens, each token
    picking ``top_k`` of ``num_slots`` uniformly: ``slots_per_gpu * (1 - (1 - k/S)^N)``."""
    return slots_per_gpu * (1.0 - (1.0 - top_k / num_slots) ** global_tokens)


def kernel_time(hw: HardwareSpec, kernel: Kernel) -> KernelTime:
    """``floor + max(compute, memory)``; the fractions by the kernel's rows where the hardware has
    efficiency curves (``HardwareSpec.compute_fraction``, ``memory_fraction``)."""
    compute_fraction = hw.compute_fraction(kernel.kernel_class, kernel.rows, kernel.depth)
    compute = kernel.work.flops / (hw.flops_for(kernel.dtype) * compute_fraction) * 1e6
    fraction = hw.memory_fraction(kernel.kernel_class, kernel.rows, kernel.matrix_bytes)
    memory = kernel.work.bytes / (hw.memory_bandwidth * fraction) * 1e6
    return KernelTime(compute, memory, hw.floor_us(kernel.kernel_class))


@dataclass(frozen=True)
class Transfer:
    """An asynchronous transfer: ``wire_us`` holds the link, ``latency_us`` only delays arrival."""

    latency_us: float = 0.0
    wire_us: float = 0.0

    @property
    def time_us(self) -> float:
        return self.latency_us + self.wire_us


def all_to_all(
    hw: HardwareSpec, ep: int, gpus_per_node: int, tokens: float, top_k: int, bytes_per_copy: float,
    dedup_nodes: bool = False, direction: str = "dispatch",
) -> Transfer:
    """One GPU sends each of ``tokens`` tokens to the ranks of its ``top_k`` experts (uniform over
    the ``ep`` ranks; copies for its own rank stay local). Without dedup (decode's low-latency
    kernels) every (token, expert) copy travels: ``(G-1)/EP`` of them over NVLink, ``(EP-G)/EP``
    over InfiniBand. With ``dedup_nodes`` (prefill's high-throughput kernels) a token crosses
    InfiniBand once per remote node, ``(N-1)(1 - (1 - 1/N)^k)`` times for ``N`` nodes, and is
    forwarded over NVLink inside the node. Both links run at once.

    Decode (no dedup) on hardware with ``all_to_all_fits`` for ``direction`` (``dispatch`` or
    ``combine``): each link's wire time at its fitted efficiency, and the arrival no earlier than
    ``max(floor(EP), intercept + wire)`` of the link the transfer crosses (InfiniBand when EP spans nodes)."""
    if ep <= 1:
        return Transfer()
    local = min(gpus_per_node, ep)
    copies = tokens * top_k
    nvlink_copies = copies * (local - 1) / ep
    ib_copies = copies * (ep - local) / ep
    if dedup_nodes and ep > local:
        nodes = ep / local
        ib_copies = tokens * (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)
        nvlink_copies = copies * (local - 1) / local
    link = "ib" if ep > local else "nvlink"
    fits = hw.all_to_all_fits
    if not dedup_nodes and f"{link}_{direction}" in fits:
        nv_fit, ib_fit = fits.get(f"nvlink_{direction}"), fits.get(f"ib_{direction}")
        nv_eff = nv_fit.efficiency if nv_fit else hw.nvlink_efficiency
        ib_eff = ib_fit.efficiency if ib_fit else hw.ib_efficiency
        wire = max(nvlink_copies * bytes_per_copy / (hw.nvlink_bandwidth * nv_eff),
                   ib_copies * bytes_per_copy / (hw.ib_bandwidth * ib_eff)) * 1e6
        fit = fits[f"{link}_{direction}"]
        return Transfer(max(fit.floor_us(ep) - wire, fit.intercept_us), wire)
    nvlink = nvlink_copies * bytes_per_copy / (hw.nvlink_bandwidth * hw.nvlink_efficiency)
    ib = ib_copies * bytes_per_copy / (hw.ib_bandwidth * hw.ib_efficiency)
    latency = hw.ib_latency_us if link == "ib" else hw.nvlink_latency_us
    return Transfer(latency, max(nvlink, ib) * 1e6)


def tp_collective_time_us(hw: HardwareSpec, tp: int, bytes_moved: float) -> float:
    """A reduce-scatter or all-gather inside a TP group (always inside a node, over NVLink)."""
    if tp <= 1:
        return 0.0
    return hw.collective_latency_us + bytes_moved / (hw.nvlink_bandwidth * hw.nvlink_efficiency) * 1e6


IMBALANCE_SAMPLES = 1000  # routings drawn per shape; fixed seed, so a plan is deterministic
IMBALANCE_EXACT_TOKENS = 16  # up to here every token count is drawn; beyond, 4 points per doubling


def busiest_rank_load(ep: int, num_slots: int, top_k: int, global_tokens: float) -> tuple[float, float]:
    """How much more expert work the busiest of ``ep`` ranks gets than the mean rank in one MoE layer,
    under uniform random routing: ``global_tokens`` tokens each pick ``top_k`` distinct slots of
    ``num_slots`` uniformly; rank ``r`` holds ``num_slots / ep`` slots. A layer's collectives make
    every rank wait for the slowest, so the layer costs what the busiest rank costs.

    Returns ``(E[max_r copies_r] / E[copies_r], E[max_r active_r] / E[active_r])``: the expected token
    copies of the rank that receives most, and the expected active experts of the rank that activates
    most, each over the mean rank's; (1, 1) at EP 1. Drawn exactly (``_drawn_load``) at every token
    count up to ``IMBALANCE_EXACT_TOKENS`` and at 4 points per doubling beyond, the excess over 1
    interpolated linearly in log tokens between them (it falls smoothly, roughly as 1/sqrt(tokens))."""
    if ep <= 1 or global_tokens <= 0:
        return 1.0, 1.0
    t = max(float(global_tokens), 1.0)
    if t <= IMBALANCE_EXACT_TOKENS:
        lo = hi = float(math.floor(t))
        if lo < t:
            hi = lo + 1
    else:
        q = 4 * math.log2(t / IMBALANCE_EXACT_TOKENS)
        lo = IMBALANCE_EXACT_TOKENS * 2 ** (math.floor(q) / 4)
        hi = IMBALANCE_EXACT_TOKENS * 2 ** (math.ceil(q) / 4)
    a, b = _drawn_load(ep, num_slots, top_k, round(lo)), _drawn_load(ep, num_slots, top_k, round(hi))
    if hi == lo:
        return a
    w = math.log(t / lo) / math.log(hi / lo)
    return a[0] + w * (b[0] - a[0]), a[1] + w * (b[1] - a[1])


@cache
def _drawn_load(ep: int, num_slots: int, top_k: int, global_tokens: int) -> tuple[float, float]:
    """``busiest_rank_load`` from ``IMBALANCE_SAMPLES`` exact draws of the per-slot counts, seed 0:
    slot by slot, a token still needing ``j`` of its picks among the ``s`` remaining slots takes this
    one with probability ``j / s``, so each slot's count is a sum of binomials over the tokens
    grouped by ``j`` (the cost does not grow with the token count)."""
    import numpy as np

    rng = np.random.default_rng(0)
    n = np.zeros((IMBALANCE_SAMPLES, top_k + 1), dtype=np.int64)  # tokens still needing j picks
    n[:, top_k] = global_tokens
    picks = np.arange(1, top_k + 1)
    counts = np.empty((IMBALANCE_SAMPLES, num_slots), dtype=np.int64)
    for slot in range(num_slots):
        took = rng.binomial(n[:, 1:], np.minimum(picks / (num_slots - slot), 1.0))
        counts[:, slot] = took.sum(1)
        n[:, 1:] -= took
        n[:, :-1] += took
    per_rank = counts.reshape(IMBALANCE_SAMPLES, ep, num_slots // ep)
    copies = per_rank.sum(2)
    active = (per_rank > 0).sum(2)
    return float(copies.max(1).mean() / copies.mean()), float(active.max(1).mean() / active.mean())
