"""Triton kernels for block-scaled FP8 (see ``kernels.fp8`` for the recipe and the torch reference).

- ``_quant_kernel``: per-token, 128-column-group activation quantization, optionally fused with
  ``silu(gate) * up`` over ``gate_up [M, 2I]``. Values are rounded to the e4m3 grid in fp32 (round to
  nearest even, subnormals included) before the cast, so the cast is exact on every target: Triton's
  interpreter rounds fp32 -> fp8 wrongly (no carry into the exponent), the GPU does not. On a masked
  grouped input it stops at the real rows (``sum(counts)``, summed and read on the device): the programs
  past them return at once, the padding rows are neither read nor written.
- ``_gemm_kernel`` / ``_grouped_gemm_kernel``: fp32 accumulation over 128-wide K blocks (BK = the
  scale group), each block's ``dot`` scaled by ``a_scale[m, kb] * b_scale[n // 128, kb]``. The grouped
  kernel runs a grid of ``cdiv(R, BM) + E`` row tiles over all experts; a tile -> (expert, rows) map
  is built on the device from ``counts`` (no host sync, CUDA-graph safe); tiles past the last expert
  zero the padding rows past ``sum(counts)``, the rest return at once.

The wrappers take CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run them) and CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from epserve.kernels.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    MIN_AMAX,
    cdiv,
    check_act,
    check_gemm,
    check_grouped,
)

QUANT_ROWS = 16  # rows per quantization program
# fp32 FMA fusion on (the GEMMs' scale-and-accumulate); explicit, since Triton 3.10 changes the default
_OPTS = {"enable_fp_fusion": True}


@triton.jit
def _round_to_e4m3(v):
    """Round fp32 ``v`` (|v| <= 448) to the nearest float8_e4m3fn value, ties to even, in fp32."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    e = ((bits >> 23) & 0xFF) - 127  # binade of |v|
    e = tl.maximum(e, -6)  # below 2^-6 the spacing stays 2^-9 (subnormals)
    ulp = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    inv_ulp = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    t = a * inv_ulp  # exact; < 16
    f = tl.floor(t)
    d = t - f
    odd = (f.to(tl.int32) & 1) == 1
    up = (d > 0.5) | ((d == 0.5) & odd)
    r = (f + up.to(tl.float32)) * ulp
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)  # v's sign


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, real_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
    SILU: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr,
    FMAX: tl.constexpr, AMIN: tl.constexpr,
):
    num_rows = M
    if MASKED:  # only the first *real_ptr rows (a count on the device)
        num_rows = tl.minimum(tl.load(real_ptr), M)
        if tl.program_id(0) * BM >= num_rows:
            return
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (cols[None, :] < K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
    if SILU:  # gate = columns [0, K), up = [K, 2K)
        gate = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = gate / (1.0 + tl.exp(-gate)) * up
    else:
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, AMIN), FMAX)
    v = tl.math.div_rn(x, scale[:, None])
    v = tl.minimum(tl.maximum(v, -FMAX), FMAX)
    q = _round_to_e4m3(v).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1) * stride_sk, scale, mask=row_mask)


@triton.jit
def _block_dot(
    a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, m_mask, offs_n, n_mask, K,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    """fp32 [BM, BN] = sum over K blocks of dot(a, b^T) * a_scale * b_scale (BK == the scale block)."""
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BK, BN] view of b^T
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // BK) * stride_bsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k_mask = offs_k < K - kb * BK
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb * stride_ask, mask=m_mask, other=0.0)
        sb = tl.load(bs_ptrs + kb * stride_bsk, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        a_ptrs += BK
        b_ptrs += BK
    return acc


@triton.jit
def _gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
    stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n  # GROUP_M row tiles sweep the N tiles together (L2 reuse of b)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = _block_dot(a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, m_mask, offs_n, n_mask, K,
                     stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, BM, BN, BK)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, R, N, K, E,
    stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert > E:  # unused tile
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = (offs_m < tl.load(tile_end_ptr + pid_m)) & (offs_m < R)
    n_mask = offs_n < N
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    c_mask = m_mask[:, None] & n_mask[None, :]
    if expert == E:  # padding rows past sum(counts)
        tl.store(c_ptrs, tl.zeros((BM, BN), dtype=c_ptr.dtype.element_ty), mask=c_mask)
        return
    acc = _block_dot(a_ptr, as_ptr, b_ptr + expert.to(tl.int64) * stride_be, bs_ptr + expert * stride_bse,
                     offs_m, m_mask, offs_n, n_mask, K,
                     stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, BM, BN, BK)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# ---- wrappers -----------------------------------------------------------------------------------


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def quantize_act(
    x: torch.Tensor, silu: bool = False, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (or gate_up [M, 2K] with ``silu``) -> (fp8 [M, K], fp32 scales [M, ceil(K/128)]); the
    scales are M-major (strides (1, M)), the layout ``_scaled_mm`` takes and the GEMMs read coalesced.
    ``counts`` (a masked grouped input's, any device): only the first ``sum(counts)`` rows are read and
    quantized, a sum taken and read on the device; the other rows of both outputs are left unwritten."""
    check_act(x, "gate_up" if silu else "x")
    if silu and x.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns [M, 2I], got shape {tuple(x.shape)}")
    x = _rows_contiguous(x)
    m, k = x.shape[0], x.shape[1] // 2 if silu else x.shape[1]
    groups = cdiv(k, BLOCK)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
    if m and k:
        # the real-row count: a device sum (no host read), [1] int64; unread without counts
        real = scale if counts is None else counts.to(x.device, non_blocking=True).sum(0, keepdim=True)
        grid = (cdiv(m, QUANT_ROWS), groups)
        _quant_kernel[grid](
            x, q, scale, real, m, k, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1),
            SILU=silu, MASKED=counts is not None, BM=QUANT_ROWS, GROUP=BLOCK, FMAX=FP8_MAX, AMIN=MIN_AMAX,
            num_warps=4, **_OPTS,
        )
    return q, scale


def act_quant_triton(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 [M, ceil(K/128)] M-major); with ``counts``, rows past their sum unread
    and unwritten."""
    return quantize_act(x, counts=counts)


def silu_mul_quant_triton(
    gate_up: torch.Tensor, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] -> quantized silu(gate) * up: (fp8 [M, I], fp32 [M, ceil(I/128)] M-major); with
    ``counts``, rows past their sum unread and unwritten."""
    return quantize_act(gate_up, silu=True, counts=counts)


def _tile_m(rows_per_group: float) -> int:
    """Row tile: small for decode-sized groups (fewer wasted rows per weight tile), 64 otherwise."""
    return 16 if rows_per_group <= 16 else 32 if rows_per_group <= 32 else 64


def grouped_tile_m(rows: int, num_experts: int, rows_per_expert: float | None = None) -> int:
    """A grouped GEMM's row tile, from the real rows an expert is expected to get (``rows_per_expert``, a
    host value the dispatcher knows from the step's token count) where given, else from ``rows`` (which may
    count padding rows) over the experts."""
    return _tile_m(rows / num_experts if rows_per_expert is None else rows_per_expert)


def block_fp8_gemm_triton(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a fp8 [M, K] x b fp8 [N, K]^T with block scales -> [M, N] out_dtype."""
    check_gemm(a, a_scale, b, b_scale)
    a, b = _rows_contiguous(a), _rows_contiguous(b)
    (m, k), n = a.shape, b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    bm, bn = _tile_m(m), 128
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _gemm_kernel[grid](
        a, a_scale, b, b_scale, out, m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), b.stride(0), b_scale.stride(0), b_scale.stride(1),
        out.stride(0), BM=bm, BN=bn, BK=BLOCK, GROUP_M=8, num_warps=4, num_stages=3, **_OPTS,
    )
    return out


def _tile_map(counts: torch.Tensor, rows: int, tiles: int, bm: int, masked: bool = False) -> tuple[torch.Tensor, ...]:
    """Per row tile t < ``tiles``: (expert, first row, end row), on the device, without a host sync.
    Expert e's rows get cdiv(counts[e], bm) tiles in order; then tiles for the padding rows past
    sum(counts) (expert = E: they write zeros), none with ``masked`` (the padding rows are left unwritten);
    the rest are unused (expert = E + 1). ``tiles = cdiv(R, bm) + E`` is
    always enough: sum_e cdiv(c_e, bm) + cdiv(R - sum c, bm) < R / bm + E + 1."""
    num_experts = counts.shape[0]
    counts = counts.to(torch.int64)
    per_expert = (counts + bm - 1) // bm
    tile_end = torch.cumsum(per_expert, 0)
    row_end = torch.cumsum(counts, 0)
    total_rows = row_end[-1:]  # [1]
    used = tile_end[-1:]
    pad_tiles = (rows - total_rows + bm - 1).clamp(min=0) // bm * (not masked)
    t = torch.arange(tiles, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # first e with tile_end[e] > t
    e = expert.clamp(max=num_experts - 1)
    first = row_end[e] - counts[e] + (t - (tile_end[e] - per_expert[e])) * bm
    end = row_end[e]
    pad = expert == num_experts
    first = torch.where(pad, total_rows + (t - used) * bm, first)
    end = torch.where(pad, torch.full_like(end, rows), end)
    expert = torch.where(pad & (t - used >= pad_tiles), num_experts + 1, expert)
    return expert.to(torch.int32), first.to(torch.int32), end.to(torch.int32)


def grouped_block_fp8_gemm_triton(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    counts: torch.Tensor | Sequence[int],
    out_dtype: torch.dtype,
    rows_per_expert: float | None = None,
    masked: bool = False,
) -> torch.Tensor:
    """Rows of a [R, K] grouped by expert (counts [E], sum <= R) times b [E, N, K] -> [R, N] out_dtype;
    rows past sum(counts) come out zero, or are left unwritten with ``masked``. ``counts`` is never read on
    the host; the row tile comes from ``rows_per_expert`` where given (``grouped_tile_m``)."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.int64)
    check_grouped(a, a_scale, b, b_scale, counts)
    a, b = _rows_contiguous(a), _rows_contiguous(b)
    (r, k), (num_experts, n, _) = a.shape, b.shape
    out = torch.empty(r, n, dtype=out_dtype, device=a.device)
    if r == 0 or n == 0:
        return out
    if k == 0 or num_experts == 0:
        return out.zero_()
    counts = counts.to(a.device, non_blocking=True)
    bm, bn = grouped_tile_m(r, num_experts, rows_per_expert), 128
    tiles = cdiv(r, bm) + num_experts
    tile_expert, tile_row, tile_end = _tile_map(counts, r, tiles, bm, masked)
    grid = (tiles, cdiv(n, bn))
    _grouped_gemm_kernel[grid](
        a, a_scale, b, b_scale, out, tile_expert, tile_row, tile_end, r, n, k, num_experts,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), b.stride(0), b.stride(1),
        b_scale.stride(0), b_scale.stride(1), b_scale.stride(2), out.stride(0),
        BM=bm, BN=bn, BK=BLOCK, num_warps=4, num_stages=3, **_OPTS,
    )
    return out
