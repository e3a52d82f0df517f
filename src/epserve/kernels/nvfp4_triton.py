"""Triton kernels for NVFP4 weights with activations in the model dtype (W4A16; see ``kernels.nvfp4`` for the
format and the torch reference). Hopper has no FP4 tensor cores: each program reads a tile of packed bytes,
unpacks the low (even column) and high nibbles to e2m1 values, multiplies in the e4m3 block scales (both decoded
from their bits, exactly, so the kernels also lower for Ampere) and runs ``tl.dot`` on the result in x's dtype,
accumulating in fp32; the per-part global scale multiplies the accumulator once, per output row. An e2m1 value
times an e4m3 scale has at most 6 significant bits, so the block-scaled weight is exact in bf16 and fp16 as in
fp32: the only roundings are the GEMM's own.

- ``_linear_kernel``: x [M, K] @ W^T, the 4.5 bits per weight read once per row tile.
- ``nvfp4_w4a4_triton``: W4A4's arithmetic (``kernels.nvfp4_w4a4``) where FP4 tensor cores are not: the
  activations quantized and dequantized, then the linear kernel in fp32.
- ``_grouped_kernel``: the routed experts' GEMMs on rows grouped by expert, as ``grouped_triton``'s grouped
  GEMM runs them: a grid of ``cdiv(R, BM) + E`` row tiles mapped to (expert, rows) on the device from
  ``counts`` (``fp8_triton._tile_map``: no host read, so the experts can be captured in a CUDA graph); with
  ``SWIGLU`` the gate and up rows of a tile give ``silu(gate) * up`` (the [R, 2I] intermediate is never
  written). Padding rows past ``sum(counts)`` come out zero, or, ``masked``, get no tile (neither read nor
  written); the row tile comes from the ``rows_per_expert`` hint where given.

The wrappers take CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run them). fp32
inputs multiply in IEEE fp32 (the reference's precision), not TF32; the interpreter multiplies bf16 dot
operands as raw bits, so on CPU tensors (``EMULATE``) bf16 dots run in fp32 on the same values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from epserve.kernels.fp8 import cdiv
from epserve.kernels.fp8_triton import _tile_m, _tile_map, grouped_tile_m
from epserve.kernels.nvfp4 import GROUP, check_nvfp4_experts, check_nvfp4_weight
from epserve.kernels.nvfp4_act import nvfp4_act_dequant, nvfp4_act_quant
from epserve.kernels.nvfp4_w4a4 import act_global_scale, check_w4a4

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BN = 64  # output columns (weight rows) per program
_OPTS = {"enable_fp_fusion": True}  # explicit, since Triton 3.10 changes the default


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> fp32, exact, built from the bits: bit 3 the sign, bits 1-2 the exponent
    (bias 1; 0: the subnormal 0 or 0.5), bit 0 the mantissa."""
    e = (code >> 1) & 3
    m = code & 1
    bits = tl.where(e > 0, ((e + 126) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((code >> 3) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn bytes (int32) -> fp32, exact: bit 7 the sign, bits 3-6 the exponent (bias 7; 0: subnormal,
    ``m x 2^-9``), bits 0-2 the mantissa (block scales are never NaN). Decoded from the bits rather than by a
    cast of a float8 pointer, which Triton lowers only from compute capability 8.9."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)
    return tl.where((byte >> 7) != 0, -v, v)


@triton.jit
def _weight_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn,
                 BN: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr):
    """[BK, BN] fp32: columns ``k0 .. k0 + BK`` of the weight rows ``offs_n``, e2m1 x block scale."""
    rows = offs_n.to(tl.int64)[:, None]
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    packed = tl.load(w_ptr + rows * stride_wn + offs_b[None, :], mask=n_mask[:, None] & (offs_b < K // 2)[None, :],
                     other=0).to(tl.int32)
    values = tl.reshape(tl.join(_e2m1(packed & 0xF), _e2m1(packed >> 4)), (BN, BK))  # even column: low nibble
    offs_g = k0 // GS + tl.arange(0, BK // GS)
    scales = _e4m3(tl.load(s_ptr + rows * stride_sn + offs_g[None, :],
                           mask=n_mask[:, None] & (offs_g < K // GS)[None, :], other=0).to(tl.int32))
    w = tl.reshape(tl.reshape(values, (BN, BK // GS, GS)) * scales[:, :, None], (BN, BK))
    return tl.trans(w)


@triton.jit
def _nvfp4_dot(x_ptr, w_ptr, s_ptr, offs_m, m_mask, offs_n, n_mask, K, stride_xm, stride_wn, stride_sn,
               PRECISION: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GS: tl.constexpr):
    """fp32 [BM, BN] = x[offs_m] @ (e2m1 x block scale)[offs_n]^T (the global scale not applied)."""
    offs_k = tl.arange(0, BK)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        b = _weight_tile(w_ptr, s_ptr, offs_n, n_mask, k0, K, stride_wn, stride_sn, BN, BK, GS)
        if EMULATE:
            acc = tl.dot(a.to(tl.float32), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        x_ptrs += BK
    return acc


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, c_ptr, M, N, K, part_rows, stride_xm, stride_wn, stride_sn, stride_cm,
    PRECISION: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GS: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n  # GROUP_M row tiles sweep the N tiles together (L2 reuse of the weight)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = _nvfp4_dot(x_ptr, w_ptr, s_ptr, offs_m, m_mask, offs_n, n_mask, K, stride_xm, stride_wn, stride_sn,
                     PRECISION, EMULATE, BM, BN, BK, GS)
    acc = acc * tl.load(g_ptr + offs_n // part_rows, mask=n_mask, other=0.0)[None, :]  # each row's part's scale
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, R, N, K, E, part_rows,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_cm,
    SWIGLU: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr, GS: tl.constexpr,
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
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    g_e = g_ptr + expert * stride_ge
    acc = _nvfp4_dot(x_ptr, w_e, s_e, offs_m, m_mask, offs_n, n_mask, K, stride_xm, stride_wn, stride_sn,
                     PRECISION, EMULATE, BM, BN, BK, GS)
    acc = acc * tl.load(g_e + offs_n // part_rows, mask=n_mask, other=0.0)[None, :]
    if SWIGLU:  # the up rows: N below the gate rows
        up = _nvfp4_dot(x_ptr, w_e, s_e, offs_m, m_mask, offs_n + N, n_mask, K, stride_xm, stride_wn, stride_sn,
                        PRECISION, EMULATE, BM, BN, BK, GS)
        up = up * tl.load(g_e + (offs_n + N) // part_rows, mask=n_mask, other=0.0)[None, :]
        acc = acc / (1.0 + tl.exp(-acc)) * up
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# ---- wrappers -----------------------------------------------------------------------------------


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _dot_options(x: torch.Tensor) -> dict[str, object]:
    """The dot's precision, the interpreter's bf16 emulation and the K tile for x's dtype."""
    if x.dtype not in DTYPES:
        raise ValueError(f"NVFP4 W4A16 kernels take activations in {DTYPES}, got {x.dtype}")
    return {"PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
            "EMULATE": not x.is_cuda and x.dtype == torch.bfloat16, "BK": 64 if x.dtype == torch.float32 else 128}


def nvfp4_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        weight_scale_2: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T, W NVFP4 (uint8 [N, K/2], e4m3 [N, K/16], fp32 per-part global scales
    [S]) -> [..., N] in x's dtype, the weight never expanded beyond one tile."""
    n, k = check_nvfp4_weight(weight, weight_scale, weight_scale_2)
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear needs x [..., {k}] for the weight {tuple(weight.shape)}, got x "
                         f"{tuple(x.shape)}")
    options = _dot_options(x)
    a = _rows_contiguous(x.reshape(-1, k))
    weight, weight_scale = _rows_contiguous(weight), _rows_contiguous(weight_scale)
    m = a.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        bm = _tile_m(m)
        _linear_kernel[(cdiv(m, bm) * cdiv(n, BN),)](
            a, weight, weight_scale.view(torch.uint8), weight_scale_2, out, m, n, k, n // weight_scale_2.numel(),
            a.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
            BM=bm, BN=BN, GS=GROUP, GROUP_M=8, num_warps=4, num_stages=3, **options, **_OPTS,
        )
    return out.view(*x.shape[:-1], n)


def _grouped_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, w_scale_2: torch.Tensor,
                  counts: torch.Tensor, swiglu: bool, rows_per_expert: float | None, masked: bool) -> torch.Tensor:
    """Rows of x [R, K] grouped by expert (counts [E] on x's device) times the NVFP4 weights w [E, N, K/2]
    (``swiglu``: [E, 2N, K/2], gate rows then up rows, giving ``silu(gate) * up``) -> [R, N] in x's dtype."""
    options = _dot_options(x)
    x, w, w_scale = _rows_contiguous(x), w.contiguous(), w_scale.contiguous()
    w_scale_2 = w_scale_2.contiguous()
    (r, k), (num_experts, n_all, _) = x.shape, w.shape
    n = n_all // 2 if swiglu else n_all
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    if r == 0 or n == 0:
        return out
    if num_experts == 0:
        return out.zero_()
    bm = grouped_tile_m(r, num_experts, rows_per_expert)
    tiles = cdiv(r, bm) + num_experts
    tile_expert, tile_row, tile_end = _tile_map(counts, r, tiles, bm, masked)
    _grouped_kernel[(tiles, cdiv(n, BN))](
        x, w, w_scale.view(torch.uint8), w_scale_2, out, tile_expert, tile_row, tile_end, r, n, k, num_experts,
        n_all // w_scale_2.shape[1], x.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        w_scale_2.stride(0), out.stride(0),
        SWIGLU=swiglu, BM=bm, BN=BN, GS=GROUP, num_warps=4, num_stages=3, **options, **_OPTS,
    )
    return out


def nvfp4_moe_swiglu_triton(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
    rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """Routed experts on x [R, H] grouped by expert (counts [E], never read on the host): ``w2[e] @ (silu(gate)
    * up)`` with ``[gate; up] = w13[e] @ x``, NVFP4 weights as ``kernels.nvfp4.nvfp4_moe_swiglu`` takes them ->
    [R, H] in x's dtype; rows past sum(counts) zero, or (``masked``) neither read nor written by either launch.
    Two launches: gate/up with SiLU·mul fused (the intermediate in x's dtype), then the down projection."""
    check_nvfp4_experts(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.int64)
    if tuple(counts.shape) != (w13.shape[0],) or counts.is_floating_point():
        raise ValueError(f"counts must be {w13.shape[0]} integers (one per expert), got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    counts = counts.to(x.device, non_blocking=True)  # a no-op for counts already there
    hidden = _grouped_gemm(x, w13, w13_scale, w13_scale_2, counts, True, rows_per_expert, masked)
    return _grouped_gemm(hidden, w2, w2_scale, w2_scale_2, counts, False, rows_per_expert, masked)


def nvfp4_w4a4_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """W4A4 (``kernels.nvfp4_w4a4.nvfp4_w4a4_linear``) where the FP4 GEMM does not run: x quantized as that GEMM
    quantizes it, dequantized to fp32 and multiplied by the W4A16 kernel in IEEE fp32 (the reference's
    arithmetic, in another summation order) -> [..., N] in x's dtype."""
    n, k = check_w4a4(x, weight, weight_scale, weight_scale_2, input_scale)
    g = act_global_scale(input_scale)
    values = nvfp4_act_dequant(*nvfp4_act_quant(x.reshape(-1, k), g), g, torch.float32)
    return nvfp4_linear_triton(values, weight, weight_scale, weight_scale_2).to(x.dtype).view(*x.shape[:-1], n)
