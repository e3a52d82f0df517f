"""Kernel selection for the model's hot ops: custom kernels where they apply, torch otherwise.

The model calls these instead of ``F.linear`` so the choice is made in one place, per call, from
the tensors' device, dtype and shape (never from the parallel layout): FP8 block-scaled weights go to
``kernels.fp8`` (Triton or ``torch._scaled_mm`` on CUDA, a torch reference on the CPU), bf16 and fp32
decode GEMMs on a CPU with AVX512-BF16 / AVX2 to ``kernels.cpu``, as are a CPU decode step's small
fused ops (RMSNorm and MLA's per-head projections here, the gate and paged MLA decode through their own front ends). Importing the
package registers the kernels' custom ops (``kernels/ops.py``), which the front ends call when traced.
"""

from __future__ import annotations

import torch

from epserve.kernels import cpu, ops  # noqa: F401 - ops: registers torch.ops.epserve.*
from epserve.kernels.cpu import moe_swiglu
from epserve.kernels.device import tracing
from epserve.kernels.fp8 import fp8_linear


def linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T; with ``scale_inv`` (one fp32 per 128x128 tile) ``w`` is FP8 block-scaled."""
    if scale_inv is not None:
        return fp8_linear(x, w, scale_inv)
    return cpu.linear(x, w)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]: normalised in fp32, scaled in x's dtype (the torch reference)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm: one C call for a few bf16/fp32 rows on the CPU in eager steps (``kernels.cpu``), the
    torch reference otherwise (what ``torch.compile`` fuses, and CUDA runs)."""
    out = None if tracing() else cpu.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps) if out is None else out


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, h, K] times each head's weight w [h, K, N] -> [B, h, N] in w's dtype (MLA's absorbed
    projections): one C call for fp32 weights on the CPU in eager steps, ``torch.bmm`` otherwise."""
    out = None if tracing() else cpu.head_matmul(x, w)
    return torch.bmm(x.to(w.dtype).transpose(0, 1), w).transpose(0, 1) if out is None else out


__all__ = ["head_matmul", "linear", "moe_swiglu", "rms_norm", "rms_norm_ref"]
