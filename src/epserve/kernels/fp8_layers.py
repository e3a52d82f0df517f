"""The FP8 layers composed of ``kernels.fp8``'s ops: a linear (activation quantization, then the block GEMM)
and the routed SwiGLU experts (grouped GEMMs around SiLU·mul fused with the re-quantization), on rows in
the model dtype or on a dispatcher's already quantized FP8 payload.

The experts take a dispatcher's masked layout (``ExpertInput.masked``: padding rows past the counts' sum
never written, their outputs never read) and its tile hint (``ExpertInput.rows_per_expert``). On CUDA a masked
input's padding rows are then neither quantized (the quantizers stop at the real rows, counted on the
device) nor read or written by either grouped GEMM; the reference reads only the real rows in any case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from epserve.kernels import fp8
from epserve.kernels.device import values_readable
from epserve.kernels.fp8 import (
    BLOCK,
    FP8_DTYPE,
    _as_counts,
    _shape,
    act_quant,
    block_fp8_gemm,
    cdiv,
    check_act,
    grouped_block_fp8_gemm,
    silu_mul_quant,
)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ w^T, w fp8 [N, K] with scales [ceil(N/128), ceil(K/128)] -> [..., N]
    in x.dtype: x quantized per token and 128 columns, then the block GEMM."""
    want = (cdiv(w.shape[0], BLOCK), cdiv(w.shape[-1], BLOCK)) if w.dim() == 2 else None
    if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[1] or _shape(w_scale) != want:
        raise ValueError(
            f"fp8_linear shapes do not match: x {_shape(x)}, w {_shape(w)}, w_scale {_shape(w_scale)}; "
            f"expected x [..., K], w [N, K], w_scale {want or '[ceil(N/128), ceil(K/128)]'}"
        )
    lead = x.shape[:-1]
    q, s = act_quant(x.reshape(-1, x.shape[-1]))
    return block_fp8_gemm(q, s, w, w_scale, x.dtype).view(*lead, w.shape[0])


def _check_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """x [R, H], w13 [E, 2I, H], w2 [E, H, I]."""
    check_act(x)
    e, two_i, h = w13.shape if w13.dim() == 3 else (0, 1, 0)
    if w2.dim() != 3 or two_i % 2 or _shape(w2) != (e, h, two_i // 2) or x.shape[1] != h:
        raise ValueError(f"fp8_moe_swiglu shapes do not match: x {_shape(x)}, w13 {_shape(w13)}, w2 {_shape(w2)}; "
                         "expected x [R, H], w13 [E, 2I, H], w2 [E, H, I]")


def _real_rows(x: torch.Tensor, counts: torch.Tensor) -> int:
    """The rows the experts read: every row on CUDA and in traces (the grouped kernels skip the padding on
    the device); on the reference path, which reads the counts on the host anyway, up to sum(counts)."""
    return x.shape[0] if fp8._on_cuda(x) or not values_readable() else min(int(counts.sum()), x.shape[0])


def _pad_rows(y: torch.Tensor, rows: int) -> torch.Tensor:  # zero rows up to ``rows``
    return y if y.shape[0] == rows else F.pad(y, (0, 0, 0, rows - y.shape[0]))


def _counts_for(x: torch.Tensor, counts: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """The counts as a tensor, on x's device on the CUDA kernels' route (once for every kernel of the
    experts; a no-op for device counts)."""
    counts = _as_counts(counts, x.device)
    return counts.to(x.device, non_blocking=True) if fp8._on_cuda(x) else counts


def fp8_moe_swiglu(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w13_scale: torch.Tensor,
    w2: torch.Tensor, w2_scale: torch.Tensor, rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """Routed experts on x [R, H] grouped by expert: ``w2[e] @ (silu(gate) * up)`` with
    ``[gate; up] = w13[e] @ x`` (w13 fp8 [E, 2I, H], w2 fp8 [E, H, I], block scales) -> [R, H] in x.dtype,
    rows past sum(counts) zero (``masked``: undefined, and never read): x quantized once (``act_quant``, only
    its real rows when ``masked``), then :func:`fp8_moe_swiglu_quantized`."""
    _check_moe(x, w13, w2)
    counts = _counts_for(x, counts)
    rows = _real_rows(x, counts)
    q, s = act_quant(x[:rows], counts if masked else None)
    out = fp8_moe_swiglu_quantized(q, s, counts, w13, w13_scale, w2, w2_scale, x.dtype, rows_per_expert, masked)
    return _pad_rows(out, x.shape[0])


def fp8_moe_swiglu_quantized(
    q: torch.Tensor, s: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor,
    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, out_dtype: torch.dtype,
    rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """:func:`fp8_moe_swiglu` on rows already quantized (q fp8 [R, H], s fp32 [R, ceil(H/128)] in any
    layout, as ``act_quant`` returns them: an FP8 dispatch payload) -> [R, H] out_dtype, rows past
    sum(counts) zero. SiLU·mul is fused with the re-quantization between the two grouped GEMMs.
    ``masked`` (``ExpertInput.masked``): the rows past sum(counts) may be garbage; on CUDA neither GEMM reads
    or writes them and the intermediate's are not quantized, so their outputs are undefined.
    ``rows_per_expert``: both GEMMs' tile hint (``kernels.fp8.grouped_block_fp8_gemm``)."""
    _check_moe(q, w13, w2)
    want = (q.shape[0], cdiv(q.shape[1], BLOCK))
    if q.dtype != FP8_DTYPE or s.dtype != torch.float32 or _shape(s) != want:
        raise ValueError(f"fp8_moe_swiglu_quantized needs q {FP8_DTYPE} [R, H] and fp32 scales {want}, got q "
                         f"{q.dtype} {_shape(q)} and scales {s.dtype} {_shape(s)}")
    counts = _counts_for(q, counts)
    rows = _real_rows(q, counts)
    gate_up = grouped_block_fp8_gemm(q[:rows], s[:rows], w13, w13_scale, counts, out_dtype, rows_per_expert, masked)
    q, s = silu_mul_quant(gate_up, counts if masked else None)
    return _pad_rows(grouped_block_fp8_gemm(q, s, w2, w2_scale, counts, out_dtype, rows_per_expert, masked), want[0])
