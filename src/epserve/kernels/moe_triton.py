"""Triton kernels of the dispatchers' ops (``kernels.moe_ops`` declares them with their references).

``_gather_rows_kernel``: the masked row gather. A fixed grid covers every row of the output, but the number
of real rows is read on the device, and a program past it returns at once: padding rows are neither read nor
written, and the launch can be captured in a CUDA graph. The wrapper takes CUDA tensors, and CPU tensors
under ``TRITON_INTERPRET=1`` (how the tests run it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.fp8 import cdiv

ROWS = 4  # rows per program
COLS = 512  # columns per inner step
_OPTS = {"enable_fp_fusion": False}  # copies only: explicit, since Triton 3.10 changes the default


@triton.jit
def _gather_rows_kernel(out_ptr, src_ptr, index_ptr, total_ptr, N, C, col0, stride_out, stride_src,
                        BR: tl.constexpr, BC: tl.constexpr):
    row0 = tl.program_id(0) * BR
    total = tl.load(total_ptr)
    if row0 >= total:  # padding rows only
        return
    rows = row0 + tl.arange(0, BR)
    r_mask = (rows < total) & (rows < N)
    src_rows = tl.load(index_ptr + rows, mask=r_mask, other=0).to(tl.int64)
    for c in range(0, C, BC):
        cols = c + tl.arange(0, BC)
        mask = r_mask[:, None] & (cols < C)[None, :]
        v = tl.load(src_ptr + src_rows[:, None] * stride_src + (col0 + cols)[None, :], mask=mask)
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], v, mask=mask)


def gather_real_rows_triton(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor, total: torch.Tensor,
                            col0: int) -> None:
    """``out[j] = src[index[j], col0:col0 + C]`` for ``j < total`` (read on the device); other rows untouched."""
    n, c = out.shape
    if n == 0 or c == 0:
        return
    if out.stride(1) != 1 or src.stride(1) != 1 or out.dtype != src.dtype:
        raise ValueError(f"gather_real_rows takes row-major out and src of one dtype, got out {out.dtype} strides "
                         f"{out.stride()} and src {src.dtype} strides {src.stride()}")
    _gather_rows_kernel[(cdiv(n, ROWS),)](
        out, src, index, total.reshape(-1), n, c, col0, out.stride(0), src.stride(0), BR=ROWS, BC=COLS,
        num_warps=4, **_OPTS,
    )
