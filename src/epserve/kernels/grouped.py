"""Grouped SwiGLU experts in the model dtype: rows grouped by expert, per-expert counts on the device.

``grouped_swiglu(x [R, H], counts [E], w13 [E, 2I, H], w2 [E, H, I])`` returns ``w2[e] @ (silu(gate) * up)``
with ``[gate; up] = w13[e] @ x`` for expert ``e``'s ``counts[e]`` rows (in expert order); rows past
``sum(counts)`` (a fixed-shape dispatcher's padding) come out zero. On CUDA nothing reads ``counts`` on
the host, so the call can be captured in a CUDA graph:

- bf16 where ``torch._grouped_mm`` runs (Hopper-class GPUs, SM90+): two ``_grouped_mm`` calls on the
  device offsets, the padding rows masked to zero;
- otherwise (fp32, fp16, bf16 below SM90): the Triton grouped GEMM (``kernels.grouped_triton``, imported
  only then, so the CPU engine never loads triton).

On the CPU the decode kernel of ``kernels.cpu`` reads the counts itself (``moe_swiglu_counts``); otherwise
:func:`grouped_swiglu_host` reads them on the host: the decode kernel on the real rows, ``torch._grouped_mm``
(bf16), else ``grouped_swiglu_ref``, the per-expert loop. The op is declared once (``kernels.opdef``); a trace
sees the Triton kernel and the host read as the custom op ``epserve::grouped_swiglu``, and ``_grouped_mm`` as
itself. Compute capabilities come from ``kernels.device``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from epserve.kernels import cpu
from epserve.kernels.device import capability, is_cuda
from epserve.kernels.fused import silu_mul
from epserve.kernels.opdef import declare

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


def grouped_swiglu_host(x: torch.Tensor, sizes: Sequence[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert (``sizes[e]`` each, in order, known on the host; rows past their
    sum come out zero): the CPU decode kernel where it applies, else ``torch._grouped_mm`` (bf16), else the
    per-expert loop."""
    sizes = [int(n) for n in sizes]
    total = sum(sizes)
    if total == 0:
        return x.new_zeros(x.shape[0], w2.shape[1])
    rows = x[:total]
    y = cpu.moe_swiglu(rows, sizes, w13, w2)  # the CPU decode kernel, where it applies
    if y is not None and total == x.shape[0]:  # no padding rows (the local dispatcher's input)
        return y
    out = x.new_zeros(x.shape[0], w2.shape[1])
    if y is None and grouped_mm_ok(rows):
        y = grouped_mm_swiglu(rows, torch.tensor(sizes), w13, w2)
    if y is None:
        return grouped_swiglu_ref(x, sizes, w13, w2)
    out[:total] = y
    return out


def grouped_swiglu_cpu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       rows_per_expert: float | None = None, masked: bool = False) -> torch.Tensor | None:
    """The C decode kernel (``kernels.cpu.moe_swiglu_counts``: it reads the counts itself, and only the real
    rows), or None where it does not apply; the tile hint is the GPU kernels'."""
    return cpu.moe_swiglu_counts(x, counts, w13, w2)


def grouped_swiglu_counts(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          rows_per_expert: float | None = None, masked: bool = False) -> torch.Tensor:
    """:func:`grouped_swiglu_host` with the counts read on the host (the CPU op's fallback): only the real
    rows are read."""
    return grouped_swiglu_host(x, counts.tolist() if isinstance(counts, torch.Tensor) else counts, w13, w2)


def _device_counts(x: torch.Tensor, counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor):
        return torch.tensor(list(counts), dtype=torch.int64, device=x.device)
    return counts


def _grouped_mm_takes(x: torch.Tensor, *args: object, **kwargs: object) -> bool:
    return grouped_mm_ok(x)


def grouped_mm_masked(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      rows_per_expert: float | None = None, masked: bool = False) -> torch.Tensor:
    """The CUDA experts by ``_grouped_mm`` on device offsets; the rows past the last offset are undefined
    (maybe NaN): zeroed, or left so with ``masked``."""
    counts = _device_counts(x, counts)
    check_grouped_swiglu(x, counts, w13, w2)
    y = grouped_mm_swiglu(x, counts, w13, w2)
    if masked:
        return y
    valid = (torch.arange(x.shape[0], device=x.device) < counts.sum()).unsqueeze(1)
    return torch.where(valid, y, 0.0)


@declare("grouped_swiglu", fake=lambda x, counts, w13, w2, rows_per_expert=None, masked=False:
         x.new_empty(x.shape[0], w2.shape[1]))
def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   rows_per_expert: float | None = None, masked: bool = False) -> torch.Tensor:
    """Experts on rows of x [R, H] grouped by expert (counts [E]; a list of ints in eager calls) -> [R, H] in x's
    dtype, rows past sum(counts) zero: ``_grouped_mm`` or Triton on CUDA (no host read), the C decode kernel or
    a host read of the counts on the CPU; the reference (the per-expert loop) elsewhere. ``masked``
    (``ExpertInput.masked``): the rows past sum(counts) may be garbage and their outputs are left undefined,
    the GPU kernels neither read nor write them. ``rows_per_expert``: the real rows an expert is expected to
    get (a host value), from which the Triton kernels pick their row tile."""
    return grouped_swiglu_ref(x, counts, w13, w2)


grouped_swiglu.implement("cpu", f"{__name__}:grouped_swiglu_cpu")
grouped_swiglu.implement("cpu", f"{__name__}:grouped_swiglu_counts", takes=lambda *args: True, traced="op")
grouped_swiglu.implement("cuda", f"{__name__}:grouped_mm_masked", takes=_grouped_mm_takes, traced="inline")
grouped_swiglu.implement("cuda", "epserve.kernels.grouped_triton:grouped_swiglu_triton", traced="op")
