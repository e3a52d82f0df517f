"""Grouped SwiGLU experts in the model dtype: rows grouped by expert, per-expert counts on the device.

``grouped_swiglu(x [R, H], counts [E], w13 [E, 2I, H], w2 [E, H, I])`` returns ``w2[e] @ (silu(gate) * up)``
with ``[gate; up] = w13[e] @ x`` for expert ``e``'s ``counts[e]`` rows (in expert order); rows past
``sum(counts)`` (a fixed-shape dispatcher's padding) come out zero. On CUDA nothing reads ``counts`` on
the host, so the call can be captured in a CUDA graph:

- bf16 where ``torch._grouped_mm`` runs (Hopper-class GPUs, SM90+): two ``_grouped_mm`` calls on the
  device offsets, the padding rows masked to zero;
- otherwise (fp32, fp16, bf16 below SM90): the Triton grouped GEMM (``kernels.grouped_triton``, imported
  only then, so the CPU engine never loads triton); through the custom op ``epserve::grouped_swiglu_triton``
  (``kernels/ops.py``) when traced.

Off CUDA it is ``grouped_swiglu_ref``, the per-expert loop, which reads the counts on the host (the CPU
engine's fast paths are in ``moe/experts.py``). Compute capabilities come from ``kernels.device``.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from epserve.kernels.device import capability, is_cuda, tracing
from epserve.kernels.fused import silu_mul

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """x [R, H], counts [E] integers, w13 [E, 2I, H], w2 [E, H, I], one float dtype for x and weights."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] % 2:
        raise ValueError(f"grouped SwiGLU needs x [R, H], w13 [E, 2I, H] and w2 [E, H, I], got x {_shape(x)}, "
                         f"w13 {_shape(w13)}, w2 {_shape(w2)}")
    e, two_i, h = w13.shape
    if x.shape[1] != h or _shape(w2) != (e, h, two_i // 2) or _shape(counts) != (e,):
        raise ValueError(f"grouped SwiGLU shapes do not match: x {_shape(x)}, counts {_shape(counts)}, w13 "
                         f"{_shape(w13)}, w2 {_shape(w2)}; expected x [R, {h}], counts ({e},), w2 {(e, h, two_i // 2)}")
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"grouped SwiGLU takes x and weights of one dtype among fp32/fp16/bf16, got x {x.dtype}, "
                         f"w13 {w13.dtype}, w2 {w2.dtype}")
    if counts.is_floating_point() or counts.is_complex():
        raise ValueError(f"counts must be integers, got {counts.dtype}")


def grouped_swiglu_ref(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The torch reference: one ``F.linear`` pair per expert over its rows (counts read on the host)."""
    sizes = [int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if min(sizes, default=0) < 0 or sum(sizes) > x.shape[0]:
        raise ValueError(f"counts {sizes} must be >= 0 and sum to at most the {x.shape[0]} rows of x")
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for e, n in enumerate(sizes):
        if n:
            gate, up = F.linear(x[start : start + n], w13[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm takes bf16 on the CPU and on Hopper-class GPUs (SM90+)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    return x.device.type == "cpu" or (is_cuda(x) and capability(x.device)[0] >= 9)


def grouped_mm_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The experts as two ``torch._grouped_mm`` calls on device offsets (rows past sum(counts) undefined)."""
    offs = counts.cumsum(0).to(device=x.device, dtype=torch.int32)
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    return torch._grouped_mm(silu_mul(gate_up), w2.transpose(1, 2), offs=offs)


def _triton() -> ModuleType:
    from epserve.kernels import grouped_triton  # lazy: importing triton costs the CPU engine for nothing

    return grouped_triton


def grouped_swiglu(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Experts on rows of x [R, H] grouped by expert (counts [E]) -> [R, H] in x's dtype, rows past
    sum(counts) zero: ``_grouped_mm`` or Triton on CUDA (no host read), the reference elsewhere."""
    if not is_cuda(x):
        return grouped_swiglu_ref(x, counts, w13, w2)
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.int64, device=x.device)
    check_grouped_swiglu(x, counts, w13, w2)
    if grouped_mm_ok(x):  # device offsets; the rows past the last offset are undefined (maybe NaN): zeroed
        valid = (torch.arange(x.shape[0], device=x.device) < counts.sum()).unsqueeze(1)
        return torch.where(valid, grouped_mm_swiglu(x, counts, w13, w2), 0.0)
    if tracing():
        return torch.ops.epserve.grouped_swiglu_triton(x, counts, w13, w2)  # kernels/ops.py
    return _triton().grouped_swiglu_triton(x, counts, w13, w2)
