"""Kernel selection for the model's hot ops: custom kernels where they apply, torch otherwise.

The model calls these instead of ``F.linear`` so the choice is made in one place, per call, from
the tensors' device, dtype and shape (never from the parallel layout): FP8 block-scaled weights go to
``kernels.fp8`` (Triton or ``torch._scaled_mm`` on CUDA, a torch reference on the CPU), bf16 and fp32
decode GEMMs on a CPU with AVX512-BF16 / AVX2 to ``kernels.cpu``, as are a CPU decode step's small
fused ops (``kernels.fused``: RMSNorm, rotary embedding, MLA's latent append and per-head projections;
the gate and paged MLA decode through their own front ends). Importing the
package registers the kernels' custom ops (``kernels/ops.py``), which the front ends call when traced.
"""

from __future__ import annotations

import torch

from epserve.kernels import cpu, ops  # noqa: F401 - ops: registers torch.ops.epserve.*
from epserve.kernels.cpu import moe_swiglu
from epserve.kernels.fp8 import fp8_linear
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
