"""The model's hot ops: custom kernels where they apply, torch otherwise.

Each kernel op is declared once (``kernels/opdef.py``) and listed in ``kernels/ops.py``; importing the package
declares them all, which registers their custom ops (``torch.ops.epserve.*``). The model calls these instead
of ``F.linear`` and torch's small ops so the choice is made in one place, from the tensors' device, dtype and
shape (never from the parallel layout): ``linear`` (``kernels.dense``) takes model-dtype weights, its decode
GEMMs going to ``kernels.cpu`` on a CPU with AVX512-BF16 (bf16) or AVX2 (fp32), as do a CPU decode step's small
fused ops (``kernels.fused``: RMSNorm, rotary embedding, MLA's latent append and per-head projections; the gate
and paged MLA decode in their own modules). FP8 block-scaled weights go to ``kernels.fp8_layers.fp8_linear``
(Triton or ``torch._scaled_mm`` on CUDA, a torch reference on the CPU).
"""

from __future__ import annotations

from epserve.kernels import ops  # noqa: F401 - declares every kernel op (torch.ops.epserve.*)
from epserve.kernels.cpu import moe_swiglu
from epserve.kernels.dense import linear
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

__all__ = ["add", "append_latent", "cast", "copy_", "gather_rows", "head_matmul", "linear", "moe_swiglu", "rms_norm",
           "rms_norm_ref", "rope_heads", "rope_ref", "silu_mul"]
