"""The model's hot ops: custom kernels where they apply, torch otherwise.

Each kernel op is declared once (``kernels/opdef.py``) and listed in ``kernels/ops.py``; importing the package
declares them all, which registers their custom ops (``torch.ops.epserve.*``). The model calls these instead
of ``F.linear`` and torch's small ops so the choice is made in one place, from the tensors' device, dtype and
shape (never from the parallel layout): FP8 block-scaled weights go to ``kernels.fp8`` (Triton or
``torch._scaled_mm`` on CUDA, a torch reference on the CPU), bf16 and fp32 decode GEMMs on a CPU with
AVX512-BF16 / AVX2 to ``kernels.cpu``, as are a CPU decode step's small fused ops (``kernels.fused``: RMSNorm,
rotary embedding, MLA's latent append and per-head projections; the gate and paged MLA decode in their own
modules).
"""

from __future__ import annotations

import torch

from epserve.kernels import cpu, ops  # noqa: F401 - ops: declares every kernel op (torch.ops.epserve.*)
from epserve.kernels.cpu import moe_swiglu
from epserve.kernels.fp8_layers import fp8_linear
from epserve.kernels.fused import (
    add,
    append_latent,
    cast,
    copy_,
    gather_rows,
    head_matmul,
    rms_norm,
    rms_norm_ref,
    rope_heads,
    rope_ref,
    silu_mul,
)


def linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T; with ``scale_inv`` (one fp32 per 128x128 tile) ``w`` is FP8 block-scaled."""
    if scale_inv is not None:
        return fp8_linear(x, w, scale_inv)
    return cpu.linear(x, w)


__all__ = ["add", "append_latent", "cast", "copy_", "gather_rows", "head_matmul", "linear", "moe_swiglu", "rms_norm",
           "rms_norm_ref", "rope_heads", "rope_ref", "silu_mul"]
