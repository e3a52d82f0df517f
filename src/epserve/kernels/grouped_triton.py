"""Triton grouped GEMMs for SwiGLU experts in the model dtype (fp32, fp16, bf16; any compute capability).
Semantics and reference: ``kernels.grouped``.

``_grouped_gemm_kernel`` multiplies rows grouped by expert (``counts[e]`` rows each, in order) by their
expert's weight ``b[e]`` [N, K]^T, accumulating in fp32. As in ``fp8_triton``'s grouped FP8 GEMM, a grid
of ``cdiv(R, BM) + E`` row tiles is mapped to (expert, rows) on the device from ``counts``
(``fp8_triton._tile_map``: no host read, so the kernels can be captured in a CUDA graph); tiles past the
last expert zero the padding rows past ``sum(counts)``, the unused ones return at once. With ``SWIGLU``
the kernel computes the gate columns ``n`` and the up columns ``n + N`` of the same tile and stores
``silu(gate) * up``: the first GEMM of an expert never writes its [R, 2I] intermediate. fp32 inputs
multiply in IEEE fp32 (torch's default for fp32 matmuls), not TF32. Triton's interpreter multiplies bf16
dot operands as raw bits, so on CPU tensors (``EMULATE``) bf16 dots run in fp32 on the same bf16 values.

The wrappers take CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from epserve.kernels.fp8 import cdiv
from epserve.kernels.fp8_triton import _tile_map, grouped_tile_m
from epserve.kernels.grouped import check_grouped_swiglu

_OPTS = {"enable_fp_fusion": True}
BN = 64  # output columns per program


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """``acc + a @ b`` (``EMULATE``: bf16 operands as fp32, for the interpreter)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, R, N, K, E,
    stride_am, stride_be, stride_bn, stride_cm,
    SWIGLU: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BK: tl.constexpr,
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
    offs_k = tl.arange(0, BK)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    b_ptrs = b_base + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BK, BN] view of b^T
    up_ptrs = b_ptrs + N * stride_bn  # SWIGLU: the up rows, N below the gate rows
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k_mask = offs_k < K - kb * BK
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, PRECISION, EMULATE)
        if SWIGLU:
            u = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_up = _dot(a, u, acc_up, PRECISION, EMULATE)
            up_ptrs += BK
        a_ptrs += BK
        b_ptrs += BK
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _as_counts(counts: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor):
        return torch.tensor(list(counts), dtype=torch.int64, device=device)
    return counts.to(device, non_blocking=True)  # a no-op for counts already on the device


def grouped_gemm_triton(
    a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, swiglu: bool = False,
    rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """Rows of a [R, K] grouped by expert (counts [E] on a's device, sum <= R) times b [E, N, K]^T ->
    [R, N] in a's dtype; ``swiglu``: b is [E, 2N, K] (gate rows, then up rows) and the result is
    ``silu(gate) * up`` [R, N]. Rows past sum(counts) come out zero, or, ``masked``, are neither read nor
    written; ``counts`` is never read on the host. The row tile: ``fp8_triton.grouped_tile_m``."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 and b.stride(-2) == b.shape[-1] else b.contiguous()
    (r, k), (num_experts, n, _) = a.shape, b.shape
    n = n // 2 if swiglu else n
    out = torch.empty(r, n, dtype=a.dtype, device=a.device)
    if r == 0 or n == 0:
        return out
    if k == 0 or num_experts == 0:
        return out.zero_()
    bm, bk = grouped_tile_m(r, num_experts, rows_per_expert), 32 if a.dtype == torch.float32 else 64
    tiles = cdiv(r, bm) + num_experts
    tile_expert, tile_row, tile_end = _tile_map(counts, r, tiles, bm, masked)
    _grouped_gemm_kernel[(tiles, cdiv(n, BN))](
        a, b, out, tile_expert, tile_row, tile_end, r, n, k, num_experts,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        SWIGLU=swiglu, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        EMULATE=not a.is_cuda and a.dtype == torch.bfloat16, BM=bm, BN=BN, BK=bk,
        num_warps=4, num_stages=3, **_OPTS,
    )
    return out


def grouped_swiglu_triton(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w2: torch.Tensor,
    rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """SwiGLU experts on rows of x [R, H] grouped by expert: ``w2[e] @ (silu(gate) * up)`` with
    ``[gate; up] = w13[e] @ x`` (w13 [E, 2I, H], w2 [E, H, I]) -> [R, H] in x's dtype, rows past
    sum(counts) zero (``masked``: never read or written, in either launch). Two launches: gate/up with
    SiLU·mul fused, then the down projection."""
    counts = _as_counts(counts, x.device)
    check_grouped_swiglu(x, counts, w13, w2)
    h = grouped_gemm_triton(x, w13, counts, swiglu=True, rows_per_expert=rows_per_expert, masked=masked)
    return grouped_gemm_triton(h, w2, counts, rows_per_expert=rows_per_expert, masked=masked)
