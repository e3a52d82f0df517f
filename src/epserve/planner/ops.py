"""Price every named operation of ``epserve.parallel.stages`` for one (micro-)batch on one GPU.

Token counts per GPU (docs/parallelism.md, "Sharding"; docs/planner.md, "Layout and token counts"):
attention runs all ``T_attn = requests * tp * q`` tokens of the DP group (``requests * tp``, a whole
number, even when ``requests`` per GPU is a fraction) with ``heads / tp`` heads; after the
reduce-scatter each TP rank owns a contiguous ``ceil(T_attn / tp)`` of them (the engine's chunk; the
last ranks fewer), priced for the rank that owns the most: ``T_moe``, which it routes, dispatches and
runs through the FFNs. Routing is uniform unless a measured load (``skew.LayerLoad``) is given: the mean
rank receives ``T_attn * dp * top_k / ep`` (token, expert) copies (``T_moe * top_k`` when the batch per
GPU is whole); the experts op is priced for the busiest rank (``cost.busiest_rank_load``; times the
load's busiest-rank share, its active experts from the load), which every rank waits for at the layer's
collectives, and so are the transfers a measured load skews (the busiest rank receives and sends back
the most).

An op that runs (has a kernel or a collective) also holds the stream for the host's cost of issuing
it, ``op_overhead_us + op_overhead_per_token_us x tokens`` (``T_attn`` for the attention half and
the head, ``T_moe`` for the FFN half); a skipped op (a TP collective at TP 1) costs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from epserve.config import ModelConfig
from epserve.parallel.stages import Op, Phase, ffn_op_names
from epserve.planner.cost import (
    Kernel,
    Transfer,
    Work,
    activated_experts,
    all_to_all,
    busiest_rank_load,
    gemm_work,
    group_gemm_work,
    kernel_time,
    tp_collective_time_us,
)
from epserve.planner.deployment import ACT_BYTES, KV_BYTES, WEIGHT_BYTES, Deployment, num_expert_slots
from epserve.planner.hardware import HardwareSpec
from epserve.planner.skew import LayerLoad


@dataclass(frozen=True)
class BatchShape:
    """One (micro-)batch on one GPU. Decode: ``query_len = 1 + drafts`` over ``kv_len`` cached
    tokens. Prefill: ``query_len`` is the prompt length and nothing is cached yet."""

    requests: int
    query_len: int
    kv_len: int
    phase: Phase = "decode"
    # DP groups whose tokens of this shape enter the MoE layer (None: every group's): a prefill chunk
    # that some groups carry beside their decode while the others only decode
    moe_groups: float | None = None


@dataclass(frozen=True)
class PricedOp:
    name: str
    kind: str
    compute_us: float  # time the op holds the compute stream
    transfer: Transfer  # send ops: the transfer it starts
    flops: float
    bytes: float
    bound: str  # compute | memory | latency | link | overhead | skipped
    num_kernels: int
    overhead_us: float = 0.0  # part of compute_us spent issuing the op (host side)


@dataclass(frozen=True)
class _Price:
    kernels: tuple[Kernel, ...] = ()
    sync_us: float = 0.0  # blocking collective on the compute stream
    transfer: Transfer = Transfer()  # asynchronous transfer started by a send op


class _Ctx:
    """Dimensions shared by the pricers of one batch shape."""

    def __init__(
        self, model: ModelConfig, hw: HardwareSpec, d: Deployment, shape: BatchShape, load: LayerLoad | None = None
    ) -> None:
        self.model, self.hw, self.d, self.shape, self.load = model, hw, d, shape, load
        self.h = model.hidden_size
        self.heads = model.num_attention_heads // d.tp
        k = model.num_experts_per_tok
        self.group = round(shape.requests * d.tp)  # the DP group's requests in this (micro-)batch
        self.t_attn = self.group * shape.query_len
        self.t_moe = -(-self.t_attn // d.tp)  # the TP rank that owns the most after the reduce-scatter
        self.pairs = self.t_moe * k  # (token, expert) copies it sends
        groups = d.dp if shape.moe_groups is None else min(shape.moe_groups, d.dp)
        self.global_tokens = self.t_attn * groups  # tokens of the whole EP group in the MoE layer
        self.recv_x = load.imbalance if load is not None else 1.0  # busiest rank's copies / mean, measured
        self.recv_pairs = self.global_tokens * k / d.ep * self.recv_x  # copies the busiest rank receives
        self.compute_dtype = hw.compute_dtype(d.weight_dtype)  # the MLPs' and experts'
        self.w = WEIGHT_BYTES[d.weight_dtype]
        self.a = ACT_BYTES[self.compute_dtype]
        self.attn_compute_dtype = hw.compute_dtype(d.attn_dtype)  # attention's projections'
        self.attn_w = WEIGHT_BYTES[d.attn_dtype]
        self.slots = num_expert_slots(model, d)

    def gemm(self, m: float, k: int, n: int, groups: float = 1) -> Kernel:
        """A GEMM of the attention projections' (and MTP's eh_proj's) weight dtype."""
        w, compute = self.attn_w, self.attn_compute_dtype
        work = group_gemm_work(groups, m, k, n, in_bytes=ACT_BYTES[compute], weight_bytes=w, out_bytes=2)
        return Kernel(self.hw.kernel_class("gemm", self.d.attn_dtype), work, compute, rows=m, matrix_bytes=k * n * w,
                      depth=k)

    def elementwise(self, bytes_moved: float) -> Kernel:
        return Kernel("other", Work(0.0, bytes_moved))

    def swiglu(self, tokens: float, k: int, inter: int, groups: float = 1, cls: str = "gemm") -> tuple[Kernel, ...]:
        """gate_up GEMM -> silu(gate) * up (+ quantize) -> down GEMM, over ``groups`` experts."""
        m = tokens / groups if groups else 0.0
        kw = {"in_bytes": self.a, "weight_bytes": self.w, "out_bytes": 2}
        up = group_gemm_work(groups, m, k, 2 * inter, **kw)
        down = group_gemm_work(groups, m, inter, k, **kw)
        act = self.elementwise(tokens * inter * (2 * 2 + self.a))
        cls = self.hw.kernel_class(cls, self.d.weight_dtype)
        return (Kernel(cls, up, self.compute_dtype, rows=m, matrix_bytes=2 * inter * k * self.w, depth=k), act,
                Kernel(cls, down, self.compute_dtype, rows=m, matrix_bytes=inter * k * self.w, depth=inter))


# ---- one pricer per op name ------------------------------------------------------------------------
def _input_norm(c: _Ctx) -> _Price:  # residual add + RMSNorm: read x and residual, write both
    return _Price((c.elementwise(4 * c.t_attn * c.h * 2),))


def _qkv_a_proj(c: _Ctx) -> _Price:  # [H] -> [q_lora_rank + kv_lora_rank + qk_rope_head_dim], one GEMM
    return _Price((c.gemm(c.t_attn, c.h, (c.model.q_lora_rank or 0) + c.model.kv_cache_dim),))


def _q_b_proj(c: _Ctx) -> _Price:
    m, n = c.model, c.heads * c.model.qk_head_dim
    if m.q_lora_rank:
        norm = c.elementwise(2 * c.t_attn * m.q_lora_rank * 2)
        return _Price((norm, c.gemm(c.t_attn, m.q_lora_rank, n)))
    return _Price((c.gemm(c.t_attn, c.h, n),))


def _append_kv(c: _Ctx) -> _Price:  # kv_a_layernorm; rotary on q and k; write the latent cache
    m = c.model
    norm = c.elementwise(2 * c.t_attn * m.kv_cache_dim * 2)
    rope_bytes = 2 * (c.heads + 1) * m.qk_rope_head_dim * 2 + m.kv_cache_dim * KV_BYTES[c.d.kv_dtype]
    rope = c.elementwise(c.t_attn * rope_bytes)
    return _Price((norm, rope))


def _q_absorb(c: _Ctx) -> _Price:  # per head: [T, qk_nope] x [qk_nope, kv_lora]
    return _Price((c.gemm(c.t_attn, c.model.qk_nope_head_dim, c.model.kv_lora_rank, groups=c.heads),))


def _v_absorb(c: _Ctx) -> _Price:  # per head: [T, kv_lora] x [kv_lora, v_head]
    return _Price((c.gemm(c.t_attn, c.model.kv_lora_rank, c.model.v_head_dim, groups=c.heads),))


def _kv_b_proj(c: _Ctx) -> _Price:  # prefill: latent -> per-head K_nope and V
    m = c.model
    return _Price((c.gemm(c.t_attn, m.kv_lora_rank, c.heads * (m.qk_nope_head_dim + m.v_head_dim)),))


def _attention_core(c: _Ctx) -> _Price:
    m, s = c.model, c.shape
    if s.phase == "decode":  # absorbed MLA = MQA over the latent cache, read once per request
        requests = c.group
        flops = 2 * c.t_attn * c.heads * s.kv_len * (m.kv_cache_dim + m.kv_lora_rank)
        cache = requests * s.kv_len * m.kv_cache_dim * KV_BYTES[c.d.kv_dtype]
        io = c.t_attn * c.heads * (m.kv_cache_dim + m.kv_lora_rank) * 2
        return _Price((Kernel("attention", Work(flops, cache + io)),))
    # prefill: causal MHA, QK^T over qk_head_dim and PV over v_head_dim, half the square each
    per_head = s.query_len * s.query_len * (m.qk_head_dim + m.v_head_dim)
    flops = c.group * c.heads * per_head
    io = c.t_attn * c.heads * (3 * m.qk_head_dim + m.v_head_dim) * 2
    return _Price((Kernel("attention_prefill", Work(flops, io)),))


def _o_proj(c: _Ctx) -> _Price:
    return _Price((c.gemm(c.t_attn, c.heads * c.model.v_head_dim, c.h),))


def _attn_reduce_scatter(c: _Ctx) -> _Price:  # the tokens padded to TP chunks of T_moe
    return _Price(sync_us=tp_collective_time_us(c.hw, c.d.tp, c.t_moe * c.h * 2 * (c.d.tp - 1)))


def _ffn_all_gather(c: _Ctx) -> _Price:
    return _Price(sync_us=tp_collective_time_us(c.hw, c.d.tp, c.t_moe * c.h * 2 * (c.d.tp - 1)))


def _post_norm(c: _Ctx) -> _Price:
    return _Price((c.elementwise(4 * c.t_moe * c.h * 2),))


def _gate(c: _Ctx) -> _Price:  # BF16 router GEMM, then sigmoid/softmax, group-limited top-k
    e = c.model.n_routed_experts
    logits = Kernel("gemm", gemm_work(c.t_moe, c.h, e, in_bytes=2, weight_bytes=2, out_bytes=4), rows=c.t_moe,
                    matrix_bytes=c.h * e * 2, depth=c.h)
    return _Price((logits, c.elementwise(c.t_moe * e * 4 * 2)))


def _all_to_all(c: _Ctx, bytes_per_copy: float, direction: str = "dispatch") -> Transfer:
    """``all_to_all`` sends each (token, expert) copy; ``padded`` sends every other rank a fixed buffer
    of ``tokens x min(top_k, slots per rank)`` rows whatever the routing (capacity from the step's
    maximum, here the balanced mean): as if each token had ``EP x min(top_k, slots per rank)`` copies.
    ``all_to_all`` moves what the busiest rank sends or receives, whichever is more (the mean rank
    receives what a rank sends unless a measured load is skewed or the batch per GPU is a fraction)."""
    k = c.model.num_experts_per_tok
    if c.d.dispatch == "padded":
        copies_per_token = c.d.ep * min(k, c.slots // c.d.ep)
        return all_to_all(c.hw, c.d.ep, c.d.gpus_per_node, c.t_moe, copies_per_token, bytes_per_copy,
                          direction=direction)
    tokens = max(c.t_moe, c.recv_pairs / k)
    return all_to_all(c.hw, c.d.ep, c.d.gpus_per_node, tokens, k, bytes_per_copy, c.shape.phase == "prefill",
                      direction)


def _dispatch_send(c: _Ctx) -> _Price:
    """Quantize (FP8 when the experts run in FP8) and send each copy; with EP > 1 the rows' transfer
    is preceded by a blocking exchange (``dispatch_handshake_us``): per-slot counts for
    ``all_to_all``, each row's destination slot for ``padded``."""
    xfer = _all_to_all(c, c.h * c.a)
    handshake = c.hw.dispatch_handshake_us if c.d.ep > 1 else 0.0
    return _Price((c.elementwise(c.t_moe * c.h * 2 + c.pairs * c.h * c.a),), sync_us=handshake, transfer=xfer)


def _recv_hook(c: _Ctx) -> _Price:  # wait for the transfer's completion flags
    return _Price((c.elementwise(0.0),))


def _shared_expert(c: _Ctx) -> _Price:
    if not c.model.n_shared_experts:
        return _Price()
    return _Price(c.swiglu(c.t_moe, c.h, c.model.n_shared_experts * c.model.moe_intermediate_size))


def _experts(c: _Ctx) -> _Price:
    """The busiest rank's GroupGEMM: the mean rank's copies and active experts (or, with a measured
    load, the busiest rank's share of the copies and its expected active experts) scaled by the
    expected excess of the busiest rank under uniform routing (the layer's collectives wait for it)."""
    m, d = c.model, c.d
    k, per_rank = m.num_experts_per_tok, c.slots // d.ep
    if c.load is None:
        groups = activated_experts(per_rank, c.slots, k, c.global_tokens)
    else:
        groups = c.load.busiest_active(k, c.global_tokens)
    copies_x, active_x = busiest_rank_load(d.ep, c.slots, k, c.global_tokens)
    groups = min(groups * active_x, per_rank)
    return _Price(c.swiglu(c.recv_pairs * copies_x, c.h, m.moe_intermediate_size, groups=groups, cls="group_gemm"))


def _combine_send(c: _Ctx) -> _Price:  # BF16 expert outputs back to their tokens' ranks
    return _Price((c.elementwise(c.recv_pairs * c.h * 2),), transfer=_all_to_all(c, c.h * 2, "combine"))


def _combine_recv(c: _Ctx) -> _Price:  # weighted sum of the top-k results per token
    return _Price((c.elementwise(c.pairs * c.h * 2 + c.t_moe * c.h * 2),))


def _mlp(c: _Ctx) -> _Price:
    return _Price(c.swiglu(c.t_moe, c.h, c.model.intermediate_size))


def _embed(c: _Ctx) -> _Price:
    return _Price((c.elementwise(2 * c.t_attn * c.h * 2),))


def _final_norm(c: _Ctx) -> _Price:
    return _Price((c.elementwise(3 * c.t_attn * c.h * 2),))


def _lm_head_tokens(c: _Ctx) -> int:  # prefill only needs logits at each prompt's last position
    return c.t_attn if c.shape.phase == "decode" else c.group


def _lm_head(c: _Ctx) -> _Price:  # vocabulary-parallel over TP, BF16
    vocab = math.ceil(c.model.vocab_size / c.d.tp)
    tokens = _lm_head_tokens(c)
    return _Price((Kernel("gemm", gemm_work(tokens, c.h, vocab, out_bytes=4), rows=tokens, matrix_bytes=c.h * vocab * 2,
                          depth=c.h),))


def _sample(c: _Ctx) -> _Price:
    return _Price((c.elementwise(_lm_head_tokens(c) * math.ceil(c.model.vocab_size / c.d.tp) * 4),))


def _eh_proj(c: _Ctx) -> _Price:  # MTP: enorm, hnorm, concat, [2H] -> [H]
    return _Price((c.elementwise(4 * c.t_attn * c.h * 2), c.gemm(c.t_attn, 2 * c.h, c.h)))


FFN_OPS = ffn_op_names()  # ops on the T_moe tokens a TP rank owns after the reduce-scatter
LOAD_OPS = ("dispatch_send", "experts", "combine_send")  # the ops a measured expert load changes

PRICERS: dict[str, Callable[[_Ctx], _Price]] = {
    "input_norm": _input_norm,
    "qkv_a_proj": _qkv_a_proj,
    "q_b_proj": _q_b_proj,
    "append_kv": _append_kv,
    "q_absorb": _q_absorb,
    "kv_b_proj": _kv_b_proj,
    "attention_core": _attention_core,
    "v_absorb": _v_absorb,
    "o_proj": _o_proj,
    "attn_reduce_scatter": _attn_reduce_scatter,
    "post_norm": _post_norm,
    "gate": _gate,
    "dispatch_send": _dispatch_send,
    "dispatch_recv": _recv_hook,
    "shared_expert": _shared_expert,
    "experts": _experts,
    "combine_send": _combine_send,
    "combine_recv": _combine_recv,
    "mlp": _mlp,
    "ffn_all_gather": _ffn_all_gather,
    "embed": _embed,
    "final_norm": _final_norm,
    "lm_head": _lm_head,
    "sample": _sample,
    "eh_proj": _eh_proj,
}


def op_kernels(model: ModelConfig, hw: HardwareSpec, d: Deployment, shape: BatchShape, name: str) -> tuple[Kernel, ...]:
    """The kernels one op launches (for roofline plots)."""
    return PRICERS[name](_Ctx(model, hw, d, shape)).kernels


def price_ops(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, shape: BatchShape, ops: Iterable[Op],
    load: LayerLoad | None = None,
) -> dict[str, PricedOp]:
    """Time each op of ``ops`` (taken from a stage list) for this batch shape on one GPU; ``load``: the
    layer's measured expert load (None: uniform routing)."""
    ctx = _Ctx(model, hw, d, shape, load)
    priced: dict[str, PricedOp] = {}
    for op in ops:
        if op.name in priced:
            continue
        if op.name not in PRICERS:
            raise KeyError(f"the planner has no cost model for stage op {op.name!r}")
        price = PRICERS[op.name](ctx)
        times = [kernel_time(hw, k) for k in price.kernels]
        runs = bool(times) or price.sync_us > 0
        tokens = ctx.t_moe if op.name in FFN_OPS else ctx.t_attn
        overhead = hw.op_overhead_us + hw.op_overhead_per_token_us * tokens if runs else 0.0
        device = sum(t.time_us for t in times) + price.sync_us
        compute = device + overhead
        if price.sync_us > 0 and price.sync_us >= device - price.sync_us:
            bound = "link"
        elif times:
            bound = max(times, key=lambda t: t.time_us).bound
        else:
            bound = "skipped"
        if runs and overhead > device:
            bound = "overhead"
        priced[op.name] = PricedOp(
            name=op.name,
            kind=op.kind,
            compute_us=compute,
            transfer=price.transfer,
            flops=sum(k.work.flops for k in price.kernels),
            bytes=sum(k.work.bytes for k in price.kernels),
            bound=bound,
            num_kernels=len(price.kernels),
            overhead_us=overhead,
        )
    return priced
