"""Triton split-K ("flash-decoding") kernels for paged MLA decode (see ``kernels.mla_decode`` for the
layout and the torch reference): the ``mla_decode`` op's CUDA kernels for fewer than
``WIDE_MIN_HEADS`` heads (and for fp32 caches); ``kernels.mla_decode_wide`` takes many heads with the
same launcher and merge pass (``run_split_k``).

- ``_split_kernel``, grid ``(cdiv(h, BLOCK_H), num_splits, B)`` (head blocks vary fastest, so the
  programs sharing a stretch of one sequence's cache run together and the later ones hit L2): program
  (head block, split, b) takes the ``split``-th of ``num_splits`` equal runs of ``BLOCK_N``-token tiles
  of sequence b (its length read on the device; runs past it are empty) for ``BLOCK_H`` heads. MQA:
  every head shares the latent rows, so each tile is loaded once for all of them: token t's row comes
  from cache block ``block_tables[b, t // block_size]``, slot ``t % block_size``. Scores are
  ``q_nope . c_kv + q_pe . k_pe`` (two dots: the ``r`` latent columns and the rope columns, each a
  power-of-two tile) and the tile's ``c_kv`` is reused as V; an online softmax (base 2, log2(e)
  folded into the scale) keeps the running max, sum and ``[BLOCK_H, r]`` accumulator. It writes the
  split's normalized output and log-sum-exp; with one split it writes the final output instead.
- ``_merge_kernel``, grid ``(cdiv(h, BLOCK_H), B)``: weights each split by ``exp2(lse - max lse)``
  and normalizes; sequences with no tokens (all splits empty) get zeros.

``num_splits`` is a runtime argument (one compiled kernel serves every split count); the compiled
variants differ only in block size, dims, cache dtype, scale or not, and one split or several. At
DeepSeek-V3's dims (BLOCK_H 16, BLOCK_N 32, r 512 + rope 64, 8 warps) the split kernel takes 155
(bf16, fp16) / 228 (FP8) registers on SM90 without spills (Triton 3.9, cuobjdump ``-res-usage``).

Precision: bf16 and FP8 caches run the dots on bf16 tensor cores, fp16 caches on fp16 ones (``HALF``).
FP8 rows are converted exactly to bf16 and ``kv_scale`` is applied to the scores and the output (it is
a scalar), not per element. The fp32 query is split into ``hi + lo`` 16-bit halves (two dots), so scores
keep ~16 (bf16) or ~22 (fp16) mantissa bits; a bf16-rounded query would err by up to 2^-8 of ``sum |q_i
k_i|``, which the softmax exponentiates. An fp16 cache's query must fit fp16's range. P is rounded to 16
bits for the P.V dot (the FlashAttention convention: relative error up to 2^-8 per weight for bf16,
|o - o_exact| about 2^-9 max|v| in practice, the tolerance the tests hold it to). An fp32 cache runs both
dots in IEEE fp32 (FMAs, no tensor cores). Triton's interpreter multiplies bf16 dot operands as raw bits,
so on CPU tensors (``EMULATE``) the 16-bit dots run in fp32 on the same values (the same exact products).

The grid derives from shapes only and no value is read on the host, so the launch can be captured in
a CUDA graph. The wrappers take CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run them) and
CUDA tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from epserve.kernels.mla_decode import BLOCK_H, TARGET_PROGRAMS, check_decode, default_num_splits

BLOCK_N = 32  # tokens per tile (any block_size works: rows are addressed per token)
LOG2E = math.log2(math.e)
# fp32 FMA fusion on, explicitly (Triton 3.10 changes the default); as in ``kernels.fp8_triton``
_OPTS = {"enable_fp_fusion": True}


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot needs every dim >= 16


@triton.jit
def _dot(a, b, acc, EMULATE: tl.constexpr):
    """``acc + a @ b`` for bf16 (or fp16) a, b (``EMULATE``: as fp32, for the interpreter)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _to_dot(x, HALF: tl.constexpr):
    """``x`` in the dots' 16-bit type: fp16 for an fp16 cache (``HALF``), else bf16."""
    if HALF:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _split_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, scale_ptr, o_ptr, lse_ptr, num_heads, num_splits, qk_scale,
    stride_qb, stride_qh, stride_kvb, stride_kvt, stride_tb, stride_ob, stride_oh, stride_os, stride_lb,
    stride_lh,
    PAGE: tl.constexpr, R: tl.constexpr, PE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr, KV_F32: tl.constexpr,
    HALF: tl.constexpr, FINAL: tl.constexpr, EMULATE: tl.constexpr,
):
    hb, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    cols, pe_cols = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_PE)
    r_mask, pe_mask = cols < R, pe_cols < PE
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q = tl.load(q_rows + cols[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    q_pe = tl.load(q_rows + R + pe_cols[None, :], mask=h_mask[:, None] & pe_mask[None, :], other=0.0)
    q_pe = q_pe.to(tl.float32)
    if not KV_F32:  # hi + lo 16-bit halves: q_hi . k + q_lo . k ~ fp32 q . k for 16-bit-exact k
        q_hi, q_pe_hi = _to_dot(q, HALF), _to_dot(q_pe, HALF)
        q_lo = _to_dot(q - q_hi.to(tl.float32), HALF)
        q_pe_lo = _to_dot(q_pe - q_pe_hi.to(tl.float32), HALF)
    if HAS_SCALE:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
        qk_scale = qk_scale * kv_scale

    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    table = tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_mask = toks < end
        blk = tl.load(table + toks // PAGE, mask=t_mask, other=0).to(tl.int64)
        rows = kv_ptr + blk * stride_kvb + (toks % PAGE) * stride_kvt
        kv = tl.load(rows[:, None] + cols[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
        pe_tile_mask = t_mask[:, None] & pe_mask[None, :]
        k_pe = tl.load(rows[:, None] + R + pe_cols[None, :], mask=pe_tile_mask, other=0.0)
        if KV_F32:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
        else:
            kv, k_pe = _to_dot(kv.to(tl.float32), HALF), _to_dot(k_pe.to(tl.float32), HALF)  # exact
            k_t, k_pe_t = tl.trans(kv), tl.trans(k_pe)
            s = _dot(q_hi, k_t, tl.zeros([BLOCK_H, BLOCK_N], tl.float32), EMULATE)
            s = _dot(q_lo, k_t, s, EMULATE)
            s = _dot(q_pe_hi, k_pe_t, s, EMULATE)
            s = _dot(q_pe_lo, k_pe_t, s, EMULATE)
        s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_F32:
            acc = tl.dot(p, kv, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = _dot(_to_dot(p, HALF), kv, acc * alpha[:, None], EMULATE)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # empty: acc = 0 -> 0
    if HAS_SCALE:
        o = o * kv_scale
    o_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + cols[None, :]
    o_mask = h_mask[:, None] & r_mask[None, :]
    if FINAL:
        tl.store(o_ptrs, o, mask=o_mask)
    else:
        tl.store(o_ptrs + split * stride_os, o, mask=o_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _merge_kernel(
    o_part_ptr, lse_ptr, out_ptr, num_heads, num_splits, stride_pb, stride_ph, stride_ps, stride_lb,
    stride_lh, stride_ob, stride_oh,
    R: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
):
    hb, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    splits, cols = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_R)
    lse_rows = lse_ptr + b * stride_lb + heads * stride_lh
    lse_mask = h_mask[:, None] & (splits < num_splits)[None, :]
    lse = tl.load(lse_rows[:, None] + splits[None, :], mask=lse_mask, other=float("-inf"))  # [BH, BS]
    m = tl.max(lse, 1)
    m = tl.where(m > float("-inf"), m, 0.0)  # no tokens at all: every weight below is 0
    den = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - m[:, None]), 0.0), 1)
    part = o_part_ptr + b * stride_pb + heads[:, None] * stride_ph + cols[None, :]
    o_mask = h_mask[:, None] & (cols < R)[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for i in range(num_splits):
        lse_i = tl.load(lse_rows + i, mask=h_mask, other=float("-inf"))
        w = tl.where(lse_i > float("-inf"), tl.exp2(lse_i - m), 0.0)  # empty splits stored o = 0
        acc += w[:, None] * tl.load(part + i * stride_ps, mask=o_mask, other=0.0)
    out = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + cols[None, :], out, mask=o_mask)


# ---- launch ------------------------------------------------------------------------------------


def run_split_k(
    kernel: triton.JITFunction, q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, softmax_scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None,
    num_splits: int | None, *, block_h: int, target_programs: int, **meta: int | bool,
) -> torch.Tensor:
    """o_latent [B, h, r] fp32: ``kernel`` (``_split_kernel``'s signature; ``meta`` its other constexprs and
    launch options) over the grid ``(cdiv(h, block_h), splits, B)``, then ``_merge_kernel`` when there are
    several splits. ``q`` [B, h, r + rope] is the query as the kernel reads it; the other arguments are the
    op's, already checked. ``num_splits`` defaults to ``default_num_splits`` of the shapes (``block_h`` heads
    and about ``target_programs`` programs). Nothing is read on the host."""
    if kv_cache.stride(2) != 1:
        raise ValueError(f"kv_cache rows must be contiguous, got strides {kv_cache.stride()}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    b, h, d = q.shape
    page, r = kv_cache.shape[1], kv_lora_rank
    out = torch.empty(b, h, r, dtype=torch.float32, device=q.device)
    if b == 0 or h == 0:
        return out
    if block_tables.shape[1] == 0:
        return out.zero_()
    q = q if q.stride(2) == 1 else q.contiguous()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    splits = num_splits or default_num_splits(b, h, block_tables.shape[1] * page, block_h, target_programs)
    final = splits == 1
    if final:
        o_part, lse = out, out
    else:
        o_part = torch.empty(b, h, splits, r, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    block_r = _pow2(r)
    kernel[(triton.cdiv(h, block_h), splits, b)](
        q, kv_cache, tables, seq_lens, kv_scale if kv_scale is not None else out, o_part, lse, h, splits,
        softmax_scale * LOG2E, q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
        tables.stride(0),
        o_part.stride(0), o_part.stride(1), 0 if final else o_part.stride(2),
        0 if final else lse.stride(0), 0 if final else lse.stride(1),
        PAGE=page, R=r, PE=d - r, BLOCK_R=block_r, BLOCK_PE=_pow2(d - r), BLOCK_H=block_h,
        HAS_SCALE=kv_scale is not None, HALF=kv_cache.dtype == torch.float16, FINAL=final,
        EMULATE=not q.is_cuda, **meta, **_OPTS,
    )
    if not final:
        _merge_kernel[(triton.cdiv(h, BLOCK_H), b)](
            o_part, lse, out, h, splits, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), R=r, BLOCK_R=block_r, BLOCK_H=BLOCK_H,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4, **_OPTS,
        )
    return out


def paged_mla_decode_triton(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """o_latent [B, h, kv_lora_rank] fp32 (see ``mla_decode.paged_mla_decode``); ``num_splits``
    defaults to ``default_num_splits`` of the shapes. Nothing is read on the host."""
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, kv_scale)
    big = _pow2(kv_lora_rank) >= 256
    return run_split_k(
        _split_kernel, q_latent.float(), kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale,
        num_splits, block_h=BLOCK_H, target_programs=TARGET_PROGRAMS, BLOCK_N=BLOCK_N,
        KV_F32=kv_cache.dtype == torch.float32, num_warps=8 if big else 4, num_stages=2,
    )
