"""Triton paged MLA decode for many heads (DeepSeek-V3 with DP attention runs all 128 on a rank): the
``mla_decode`` op's CUDA kernel where a call has ``kernels.mla_decode.WIDE_MIN_HEADS`` heads or more (see
``kernels.mla_decode`` for the layout and the reference; ``kernels.mla_decode_triton`` for the split-K kernel
it keeps for fewer heads, and the merge pass both share).

Why this shape (Hopper, H100/H200). The split-K kernel takes 16 heads per program (``mma.sync``, M = 16):
at 128 heads each KV tile is read by 8 programs, each running four dot products on it (the query's hi and
lo bf16 halves times the latent and rope columns) plus P.V. MLA decode is MQA over one shared latent row
per token, so the heads are the MMA's M dimension and a tile should be read once for all of them, as
FlashMLA does. FlashMLA (deepseek-ai/FlashMLA, ``csrc/``) gives a CTA 64 heads (one wgmma M), two
warpgroups of 128 threads; Q [64, 576] bf16 (72 KB) stays in shared memory, the K tile (64 tokens) is
double-buffered there, each warpgroup owns half of the [64, 512] fp32 output (128 registers a thread) and
the two take turns computing S for alternate tiles ("seesaw"); 128 heads are two CTAs.

All 128 heads in one program does not fit: the [128, 512] fp32 accumulator alone is 256 KB, the whole
register file. So ``_wide_kernel`` takes ``BLOCK_H = 64`` heads (wgmma M = 64) with 8 warps: Triton lays the
accumulator as two [64, 256] halves, one per warpgroup (128 registers a thread), and wants Q as a
shared-memory operand, which it does when Q is loaded already in the dot's 16-bit type (the wrapper casts
it; a cast inside the kernel makes it a register operand: 144 more registers a thread, and spills). The
latent columns are taken as two halves [BLOCK_N, r / 2], each with its own accumulator, matching the
warpgroups' split (one [BLOCK_N, r] tile spilled in the loop). ``BLOCK_N = 32`` tokens a tile, two
stages of ``cp.async`` (the tile rows are clamped to the sequence's last token, never masked, so the
copies need no predicates; scores past the end are masked to -inf): shared memory 72 KB (Q) + 2 x 36 KB
(bf16 tile) = 144 KB (126 KB with FP8 tiles), one program per SM. Compiled offline for sm_90a (Triton
3.9, cuobjdump ``-res-usage``): bf16 and fp16 caches 255 registers, no spill inside the loop (two words
outside it); FP8 255 registers and about 60 spilled words reloaded (from L1) per tile, beside the
FP8-to-bf16 conversions. ``BLOCK_N = 64`` (216 KB) spills in the loop for every cache dtype; 16 warps cap a thread at
128 registers, below the accumulator's share plus Q's.

Reads. 128 heads are two programs; head blocks vary fastest in the grid ``(cdiv(h, 64), splits, B)``, so
the two programs on one stretch of a sequence start together and the second reads each tile from L2: each
tile comes from HBM once. What Triton does not give is FlashMLA's seesaw: both warpgroups compute the
whole S [64, 32] (Triton places the S dot's 8 warps along M), so S's MMA work is done twice: per tile and
head 2 x 576 + 512 multiply-adds where 1,088 are needed. At 128 heads MLA decode is compute-bound on
Hopper anyway (about 2 x 128 FLOPs per cached byte of bf16, FlashMLA's analysis), which is why the query
is not split into hi + lo halves here (two more dots per tile).

Precision (a contract of its own, tested against the fp32 reference): the query is rounded once to the
dots' 16-bit type (bf16; fp16 for an fp16 cache, whose query must then fit fp16's range), as FlashMLA,
FlashInfer, vLLM and SGLang run MLA decode. With ``u`` that type's unit roundoff (bf16 2^-8, fp16 2^-11)
a score errs by at most ``eps = u softmax_scale max_t sum_i |q_i k_ti|``, each softmax weight by a factor
within ``exp(+-2 eps)``, so the output by at most ``(exp(2 eps) - 1) max|v|``, plus what P rounded to 16
bits for P.V adds (as in the split-K kernel). Given the rounded query, the kernel matches the reference at
the split-K kernel's tolerance. FP8 rows convert exactly to bf16 and ``kv_scale`` is applied to the scores
and the output. Triton's interpreter (CPU tensors, ``EMULATE``) runs the 16-bit dots in fp32 on the same
values.

The grid derives from shapes only and no value is read on the host: the launch can be captured in a CUDA
graph. Split-K and the merge are ``mla_decode_triton.run_split_k``'s, the output layout the split kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.mla_decode import WIDE_CACHE_DTYPES, check_decode, wide_fits
from epserve.kernels.mla_decode_triton import _dot, run_split_k

BLOCK_H = 64  # heads per program: one wgmma M
BLOCK_N = 32  # tokens per KV tile
TARGET_PROGRAMS = 128  # one program per SM (144 KB of shared memory each): one wave on an H100's 132 SMs


@triton.jit
def _wide_kernel(
    q_ptr, kv_ptr, tables_ptr, lens_ptr, scale_ptr, o_ptr, lse_ptr, num_heads, num_splits, qk_scale,
    stride_qb, stride_qh, stride_kvb, stride_kvt, stride_tb, stride_ob, stride_oh, stride_os, stride_lb,
    stride_lh,
    PAGE: tl.constexpr, R: tl.constexpr, PE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SCALE: tl.constexpr, HALF: tl.constexpr,
    FINAL: tl.constexpr, EMULATE: tl.constexpr,
):
    hb, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    half_cols, pe_cols = tl.arange(0, R // 2), tl.arange(0, BLOCK_PE)  # the latent's halves (R: a power of 2)
    pe_mask = pe_cols < PE
    q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_a = tl.load(q_rows + half_cols[None, :], mask=h_mask[:, None], other=0.0)  # 16-bit: a shared operand
    q_b = tl.load(q_rows + R // 2 + half_cols[None, :], mask=h_mask[:, None], other=0.0)
    q_pe = tl.load(q_rows + R + pe_cols[None, :], mask=h_mask[:, None] & pe_mask[None, :], other=0.0)
    if HAS_SCALE:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
        qk_scale = qk_scale * kv_scale

    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, R // 2], tl.float32)
    acc_b = tl.zeros([BLOCK_H, R // 2], tl.float32)
    table = tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_mask = toks < end
        toks = tl.minimum(toks, end - 1)  # rows past the end re-read the last one (masked below): no predicates
        blk = tl.load(table + toks // PAGE).to(tl.int64)
        rows = kv_ptr + blk * stride_kvb + (toks % PAGE) * stride_kvt
        kv_a = tl.load(rows[:, None] + half_cols[None, :])
        kv_b = tl.load(rows[:, None] + R // 2 + half_cols[None, :])
        if BLOCK_PE == PE:
            k_pe = tl.load(rows[:, None] + R + pe_cols[None, :])
        else:
            k_pe = tl.load(rows[:, None] + R + pe_cols[None, :], mask=pe_mask[None, :], other=0.0)
        kv_a, kv_b, k_pe = kv_a.to(q_a.dtype), kv_b.to(q_a.dtype), k_pe.to(q_a.dtype)  # exact
        s = _dot(q_a, tl.trans(kv_a), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), EMULATE)
        s = _dot(q_b, tl.trans(kv_b), s, EMULATE)
        s = _dot(q_pe, tl.trans(k_pe), s, EMULATE)
        s = tl.where(t_mask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(q_a.dtype)
        acc_a = _dot(p16, kv_a, acc_a * alpha[:, None], EMULATE)
        acc_b = _dot(p16, kv_b, acc_b * alpha[:, None], EMULATE)
        m_i = m_new

    norm = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # empty: acc = 0 -> 0
    if HAS_SCALE:
        norm = norm * kv_scale
    o_ptrs = o_ptr + b * stride_ob + heads[:, None] * stride_oh + half_cols[None, :]
    if not FINAL:
        o_ptrs += split * stride_os
    tl.store(o_ptrs, acc_a * norm[:, None], mask=h_mask[:, None])
    tl.store(o_ptrs + R // 2, acc_b * norm[:, None], mask=h_mask[:, None])
    if not FINAL:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


def paged_mla_decode_wide(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """o_latent [B, h, kv_lora_rank] fp32 (see ``mla_decode.paged_mla_decode``) for a bf16, fp16 or FP8 cache
    and a power-of-two ``kv_lora_rank`` >= 32 (any head count; built for 64 and more); ``num_splits``
    defaults to ``default_num_splits`` of the shapes at ``BLOCK_H`` heads a program and about
    ``TARGET_PROGRAMS`` programs. Nothing is read on the host."""
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, kv_scale)
    if not wide_fits(kv_cache, kv_lora_rank):
        raise ValueError(f"the many-head MLA kernel takes a {WIDE_CACHE_DTYPES} cache and a power-of-two "
                         f"kv_lora_rank >= 32, got {kv_cache.dtype} and {kv_lora_rank}")
    q = q_latent.to(torch.float16 if kv_cache.dtype == torch.float16 else torch.bfloat16)
    return run_split_k(
        _wide_kernel, q, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale, num_splits,
        block_h=BLOCK_H, target_programs=TARGET_PROGRAMS, BLOCK_N=BLOCK_N, num_warps=8, num_stages=2,
    )
