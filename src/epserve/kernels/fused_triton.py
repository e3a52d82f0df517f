"""The small fused ops of a decode step as Triton kernels: the CUDA twins of ``cpu_ops*.c``'s (semantics and
torch references: ``kernels.fused``).

- ``_rms_norm_kernel``, grid ``(cdiv(T, BT),)``: ``BT`` rows of x [T, D] per program (one on the GPU), each
  row one power-of-two tile: the mean of squares, ``1 / sqrt(mean + eps)`` (IEEE division and square root,
  as ``rms_norm_ref``'s fp32 ops on the CPU round), ``h = x * inv`` rounded to x's dtype, then
  ``weight * h`` rounded to the promoted dtype of x and the weight.
- ``_rope_kernel``, grid ``(T, cdiv(h, BLOCK_H))``: the last ``2 * HALF`` columns of ``BLOCK_H`` heads of
  one token, rotated in place (a barrier between the loads and the stores: a column is read by one
  thread and written by another), the output de-interleaved ``[evens', odds']`` as ``rope_ref``'s.
- ``_append_latent_kernel``, grid ``(cdiv(T, BT),)``: ``[RMSNorm(c_kv) | rope(k_pe)]`` of ``BT`` latent rows,
  written in the cache's dtype to the cache rows ``slots`` (read on the device; a slot outside the cache
  is not written: nothing can be raised from inside a CUDA graph).

Rounding follows the references' torch ops one by one: every bf16 product, difference and sum is done in
fp32 and rounded to bf16 (ties to even), fp32 ones round once (no FMA contraction:
``enable_fp_fusion=False``); the norm's ``1 / sqrt`` is IEEE's, as torch's ``rsqrt`` on the CPU (on CUDA
torch's is approximate). The rotary part is thus bit-exact; the norm can differ from the CPU reference only
by its mean's order of summation (a tree here, torch's vectorised order): an ulp or so of the mean in some
rows (a fifth of random fp32 rows), which moves their fp32 elements by a few ulps (at most 5 seen) and bf16
ones almost never (by one ulp: none in 1280 random rows). Triton's interpreter casts fp32 to bf16 by
truncation, so on CPU tensors (``EMULATE``) the rounding to bf16 is done on the bits.

Shapes only decide the grid and no value is read on the host, so every launch can be captured in a CUDA
graph. The launchers take CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run
them); ``kernels.fused`` checks what they take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_OPTS = {"enable_fp_fusion": False}  # x1 * cos - x2 * sin: two roundings, as torch's ops, not an FMA
INTERPRET_TILE = 1 << 16  # under the interpreter, rows per program up to this many padded elements ...
MAX_ROWS = 64  # ... and at most this many (a program costs about the same whatever its size there)


@triton.jit
def _bf16(x, EMULATE: tl.constexpr):
    """fp32 ``x`` rounded to the nearest bf16, ties to even (``EMULATE``: on the bits, for the interpreter)."""
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _as(x, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``x`` as its dtype holds it: rounded to bf16 (kept as fp32) when ``BF16``, else unchanged."""
    if BF16:
        return _bf16(x, EMULATE).to(tl.float32)
    return x


@triton.jit
def _norm(x, w, eps, D: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr, EMULATE: tl.constexpr):
    """``rms_norm_ref`` of fp32 rows x [BT, BLOCK_D] (0 past D) with the fp32 weight w [BLOCK_D]."""
    mean = tl.math.div_rn(tl.sum(x * x, axis=1), tl.full((x.shape[0],), D, tl.float32))
    inv = tl.math.div_rn(tl.full(mean.shape, 1.0, tl.float32), tl.sqrt_rn(mean + eps))
    h = _as(x * inv[:, None], X_BF16, EMULATE)
    return _as(w[None, :] * h, OUT_BF16, EMULATE)


@triton.jit
def _rotate(x1, x2, c, s, BF16: tl.constexpr, EMULATE: tl.constexpr):
    """``rope_ref``'s pair ``(x1 cos - x2 sin, x2 cos + x1 sin)``, each op rounded to the compute dtype."""
    o1 = _as(_as(x1 * c, BF16, EMULATE) - _as(x2 * s, BF16, EMULATE), BF16, EMULATE)
    o2 = _as(_as(x2 * c, BF16, EMULATE) + _as(x1 * s, BF16, EMULATE), BF16, EMULATE)
    return o1, o2


@triton.jit
def _pairs(base, i, INTERLEAVE: tl.constexpr, HALF: tl.constexpr):
    """The addresses of the pairs ``(x1, x2)``: ``(2i, 2i + 1)`` interleaved, else ``(i, HALF + i)``."""
    if INTERLEAVE:
        return base + 2 * i, base + 2 * i + 1
    return base + i, base + HALF + i


@triton.jit(do_not_specialize=["T"])  # one compiled variant for every row count (CUDA graphs)
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, T, stride_x, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BT: tl.constexpr, X_BF16: tl.constexpr, OUT_BF16: tl.constexpr,
    EMULATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    cols = tl.arange(0, BLOCK_D)
    c_mask = cols < D
    mask = (rows < T)[:, None] & c_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
    y = _norm(x, w, eps, D, X_BF16, OUT_BF16, EMULATE)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, cos_ptr, sin_ptr, num_heads, stride_qt, stride_qh, stride_ct, stride_cc, stride_st, stride_sc,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVE: tl.constexpr, BF16: tl.constexpr, EMULATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    mask = (heads < num_heads)[:, None] & i_mask[None, :]
    c = tl.load(cos_ptr + t * stride_ct + i * stride_cc, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + i * stride_sc, mask=i_mask, other=0.0).to(tl.float32)[None, :]
    base = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh + (D - 2 * HALF)  # [BLOCK_H, 1]
    p1, p2 = _pairs(base, i[None, :], INTERLEAVE, HALF)
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, BF16, EMULATE)
    tl.debug_barrier()  # in place: every thread has read its columns before any is overwritten
    tl.store(base + i[None, :], o1.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + i[None, :], o2.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _append_latent_kernel(
    latent_ptr, w_ptr, cos_ptr, sin_ptr, slots_ptr, cache_ptr, T, rows_in_cache, eps,
    stride_l, stride_ct, stride_cc, stride_st, stride_sc, stride_cache,
    R: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BT: tl.constexpr,
    INTERLEAVE: tl.constexpr, X_BF16: tl.constexpr, NORM_BF16: tl.constexpr, ROPE_BF16: tl.constexpr,
    CACHE_BF16: tl.constexpr, EMULATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    t_mask = rows < T
    slot = tl.load(slots_ptr + rows, mask=t_mask, other=-1).to(tl.int64)
    ok = t_mask & (slot >= 0) & (slot < rows_in_cache)  # a slot outside the cache: nothing written
    src = latent_ptr + rows[:, None] * stride_l  # [BT, 1]
    dst = cache_ptr + tl.where(ok, slot, 0)[:, None] * stride_cache
    out_ty = cache_ptr.dtype.element_ty

    cols = tl.arange(0, BLOCK_R)
    r_mask = cols < R
    x = tl.load(src + cols[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=r_mask, other=0.0).to(tl.float32)
    y = _as(_norm(x, w, eps, R, X_BF16, NORM_BF16, EMULATE), CACHE_BF16, EMULATE)
    tl.store(dst + cols[None, :], y.to(out_ty), mask=ok[:, None] & r_mask[None, :])

    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + rows[:, None] * stride_ct + i[None, :] * stride_cc, mask=t_mask[:, None] & i_mask[None, :],
                other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + rows[:, None] * stride_st + i[None, :] * stride_sc, mask=t_mask[:, None] & i_mask[None, :],
                other=0.0).to(tl.float32)
    p1, p2 = _pairs(src + R, i[None, :], INTERLEAVE, HALF)
    pe_mask = t_mask[:, None] & i_mask[None, :]
    x1 = tl.load(p1, mask=pe_mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=pe_mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, ROPE_BF16, EMULATE)
    out_mask = ok[:, None] & i_mask[None, :]
    tl.store(dst + R + i[None, :], _as(o1, CACHE_BF16, EMULATE).to(out_ty), mask=out_mask)
    tl.store(dst + R + HALF + i[None, :], _as(o2, CACHE_BF16, EMULATE).to(out_ty), mask=out_mask)


def _rows_per_program(t: int, tile: int, on_cuda: bool, rows: int | None) -> int:
    """One row per program on the GPU; under the interpreter a block of rows (fewer, larger programs)."""
    bt = rows if rows is not None else 1 if on_cuda else max(1, min(MAX_ROWS, INTERPRET_TILE // tile))
    if bt < 1 or bt & (bt - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {bt}")
    return min(bt, triton.next_power_of_2(max(t, 1)))


def _warps(elements: int) -> int:
    return max(1, min(8, elements // 1024))  # ~32 values a thread at DeepSeek-V3's 7168


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    rows_per_program: int | None = None) -> torch.Tensor:
    """``rms_norm_ref`` of x [..., D] (bf16/fp32; any rows, copied when the last dim is strided) with the
    weight [D] (bf16/fp32) -> a new contiguous [..., D] in their promoted dtype."""
    d = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, d)
    if rows.shape[0] and d > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    t = rows.shape[0]
    if t == 0 or d == 0:
        return out
    block_d = triton.next_power_of_2(d)
    bt = _rows_per_program(t, block_d, x.is_cuda, rows_per_program)
    _rms_norm_kernel[(triton.cdiv(t, bt),)](
        rows, weight, out, t, rows.stride(0), eps, D=d, BLOCK_D=block_d, BT=bt, X_BF16=x.dtype == torch.bfloat16,
        OUT_BF16=out.dtype == torch.bfloat16, EMULATE=not x.is_cuda, num_warps=_warps(bt * block_d), **_OPTS,
    )
    return out


def rope_heads_triton(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, rope_dim: int,
                      heads_per_program: int | None = None) -> torch.Tensor:
    """Rotates the last ``rope_dim`` columns of each head of q [T, h, D] (contiguous) in place by cos/sin
    [T, rope_dim / 2] (``rope_ref``, computed in the promoted dtype, which must be q's); returns q.
    ``heads_per_program`` (a power of two) overrides the block of heads chosen per device (tests)."""
    t, h, d = q.shape
    half = rope_dim // 2
    block_h = heads_per_program or min(triton.next_power_of_2(max(h, 1)), 16 if q.is_cuda else 128)
    if block_h & (block_h - 1):
        raise ValueError(f"heads_per_program must be a power of two, got {block_h}")
    if t == 0 or h == 0:
        return q
    block_half = triton.next_power_of_2(half)
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        q, cos, sin, h, q.stride(0), q.stride(1), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        D=d, HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, INTERLEAVE=bool(interleave),
        BF16=q.dtype == torch.bfloat16, EMULATE=not q.is_cuda, num_warps=_warps(block_h * block_half * 4), **_OPTS,
    )
    return q


def append_latent_triton(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor, interleave: bool, slots: torch.Tensor, flat_cache: torch.Tensor,
                         kv_lora_rank: int, rows_per_program: int | None = None) -> None:
    """Rows ``[RMSNorm(c_kv) | rope(k_pe)]`` of latent [T, r + rope] (last dim contiguous) written in
    ``flat_cache``'s dtype to its rows ``slots`` [T] (int32/int64, on the device; any outside the cache
    are skipped); ``flat_cache`` [rows, r + rope] has a contiguous last dim."""
    t = latent.shape[0]
    if t == 0:
        return
    half = (latent.shape[1] - kv_lora_rank) // 2
    block_r, block_half = triton.next_power_of_2(kv_lora_rank), triton.next_power_of_2(half)
    bt = _rows_per_program(t, block_r + 2 * block_half, latent.is_cuda, rows_per_program)
    bf16 = torch.bfloat16
    _append_latent_kernel[(triton.cdiv(t, bt),)](
        latent, norm_weight.contiguous(), cos, sin, slots, flat_cache, t, flat_cache.shape[0], eps,
        latent.stride(0), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), flat_cache.stride(0),
        R=kv_lora_rank, BLOCK_R=block_r, HALF=half, BLOCK_HALF=block_half, BT=bt, INTERLEAVE=bool(interleave),
        X_BF16=latent.dtype == bf16, NORM_BF16=torch.promote_types(latent.dtype, norm_weight.dtype) == bf16,
        ROPE_BF16=torch.promote_types(torch.promote_types(latent.dtype, cos.dtype), sin.dtype) == bf16,
        CACHE_BF16=flat_cache.dtype == bf16, EMULATE=not latent.is_cuda, num_warps=_warps(bt * block_r), **_OPTS,
    )
