"""NVFP4 weights (NVIDIA Model Optimizer's four-bit format) run as four-bit weights: W4A16 kernel ops with a torch
reference that never expands a whole weight.

A quantized linear ``[N, K]`` is stored as ``weight`` uint8 ``[N, K/2]`` (two e2m1 codes per byte, the even
column in the low nibble), ``weight_scale`` float8_e4m3fn ``[N, K/16]`` (one scale per 16 values) and a fp32
global scale. Its value is ``e2m1 x (block scale x global scale)`` in fp32, the dequantized checkpoint's values
(``checkpoint.nvfp4.nvfp4_dequantize``, the oracle) bit for bit.

Our layers fuse linears that the checkpoint stores apart (gate and up projections; the experts stacked), each
part with its own global scale, so the ops take ``weight_scale_2`` as a vector ``[S]`` of per-part scales: the
output rows split into ``S`` equal parts, part ``s`` scaled by ``weight_scale_2[s]``. Exact for any fusion, no
rescaling of the block scales.

The ops (declared once, ``kernels.opdef``; always the custom op ``epserve::nvfp4_*`` in a trace, with fake
implementations): ``nvfp4_linear`` (x in bf16/fp16/fp32 stays in its dtype: W4A16) and ``nvfp4_moe_swiglu``
(the routed experts' grouped SwiGLU, the shape of ``kernels.fp8_layers.fp8_moe_swiglu``). Their reference
dequantizes :data:`CHUNK_ROWS` output rows at a time into fp32 and multiplies (fp32 accumulation, the result
cast to x's dtype), so its extra memory is one chunk whatever the weight's size; experts without rows are
never read. The e2m1 decode is a 16-entry table here (``checkpoint.nvfp4`` writes the format; kernels stay
below it). On the CPU the C kernels of ``kernels.cpu_nvfp4`` run them where they take the call (W4A16, four
bits a weight streamed, never expanded); on CUDA the Triton W4A16 kernels of ``kernels.nvfp4_triton`` (the
experts' counts read on the device, so a decode step can be captured) where their self-test passed for the device
and x's dtype (the ``nvfp4_w4a16`` op of ``kernels.backends``, ``kernels.nvfp4_w4a16``), else the references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from epserve.kernels.opdef import declare

GROUP = 16  # values per block scale
CHUNK_ROWS = 256  # output rows the reference dequantizes at a time
SCALE_DTYPE = torch.float8_e4m3fn
# e2m1 code -> value: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor([*_MAGNITUDES, *(-m for m in _MAGNITUDES)], dtype=torch.float32)
_TABLES: dict[torch.device, torch.Tensor] = {}


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _table(device: torch.device) -> torch.Tensor:
    table = _TABLES.get(device)
    if table is None:
        table = _TABLES[device] = E2M1_TABLE.to(device)
    return table


def nvfp4_shapes(out_features: int, in_features: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The packed weight's and the block scales' shapes of an ``[out, in]`` linear."""
    return (out_features, in_features // 2), (out_features, in_features // GROUP)


def check_nvfp4_weight(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                       name: str = "weight") -> tuple[int, int]:
    """weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 [S] with S dividing N; -> (N, K)."""
    if weight.dim() != 2 or weight.dtype != torch.uint8:
        raise ValueError(f"NVFP4 {name} must be uint8 [N, K/2], got {weight.dtype} {_shape(weight)}")
    n, k = weight.shape[0], 2 * weight.shape[1]
    if k % GROUP or weight_scale.dtype != SCALE_DTYPE or _shape(weight_scale) != (n, k // GROUP):
        raise ValueError(f"NVFP4 {name} {_shape(weight)} needs K = {k} a multiple of {GROUP} and {SCALE_DTYPE} "
                         f"block scales {(n, k // GROUP)}, got {weight_scale.dtype} {_shape(weight_scale)}")
    parts = weight_scale_2.numel()
    if weight_scale_2.dtype != torch.float32 or weight_scale_2.dim() != 1 or not parts or n % parts:
        raise ValueError(f"NVFP4 {name} {_shape(weight)} needs fp32 global scales [S] with S dividing {n}, got "
                         f"{weight_scale_2.dtype} {_shape(weight_scale_2)}")
    return n, k


def dequantize_rows(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                    rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows ``[lo, hi)`` (all by default) of an NVFP4 weight as fp32 ``[hi - lo, K]``: e2m1 x (block scale x the
    rows' global scale)."""
    n, k = check_nvfp4_weight(weight, weight_scale, weight_scale_2)
    lo, hi = rows or (0, n)
    codes = weight[lo:hi]
    table = _table(codes.device)
    values = torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1)  # [r, K/2, 2]
    global_rows = weight_scale_2.repeat_interleave(n // weight_scale_2.numel())[lo:hi]
    scales = weight_scale[lo:hi].float() * global_rows.unsqueeze(1)  # [r, K/16]
    return (values.view(hi - lo, k // GROUP, GROUP) * scales.unsqueeze(-1)).view(hi - lo, k)


def nvfp4_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     weight_scale_2: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """x [..., K] @ dequantized(weight)^T -> [..., N] in x's dtype: ``chunk_rows`` output rows dequantized at a
    time (fp32 GEMM, cast once)."""
    n, k = check_nvfp4_weight(weight, weight_scale, weight_scale_2)
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"nvfp4_linear needs x [..., {k}] for the weight {_shape(weight)}, got x {_shape(x)}")
    xf = x.reshape(-1, k).float()
    out = torch.empty(xf.shape[0], n, dtype=x.dtype, device=x.device)
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        out[:, lo:hi] = F.linear(xf, dequantize_rows(weight, weight_scale, weight_scale_2, (lo, hi)))
    return out.view(*x.shape[:-1], n)


def _fake_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor) -> torch.Tensor:
    check_nvfp4_weight(weight, weight_scale, weight_scale_2)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@declare("nvfp4_linear", fake=_fake_linear, opaque=True)
def nvfp4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ W^T, W an NVFP4 weight (uint8 [N, K/2], e4m3 block scales [N, K/16], fp32
    per-part global scales [S]) -> [..., N] in x's dtype (W4A16: x is not quantized)."""
    return nvfp4_linear_ref(x, weight, weight_scale, weight_scale_2)


# ---- the routed experts -------------------------------------------------------------------------


def check_nvfp4_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
                        w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor) -> None:
    """x [R, H]; w13 uint8 [E, 2I, H/2] (scales [E, 2I, H/16], [E, S13]); w2 uint8 [E, H, I/2] ([E, H, I/16],
    [E, S2])."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"NVFP4 experts need x [R, H], w13 [E, 2I, H/2] and w2 [E, H, I/2], got x {_shape(x)}, "
                         f"w13 {_shape(w13)}, w2 {_shape(w2)}")
    e, two_i, h = w13.shape[0], w13.shape[1], 2 * w13.shape[2]
    if x.shape[1] != h or two_i % 2 or _shape(w2) != (e, h, two_i // 4) or w13_scale_2.dim() != 2 \
            or w2_scale_2.dim() != 2 or w13_scale_2.shape[0] != e or w2_scale_2.shape[0] != e:
        raise ValueError(f"NVFP4 experts' shapes do not match: x {_shape(x)}, w13 {_shape(w13)}, w2 {_shape(w2)}, "
                         f"global scales {_shape(w13_scale_2)} and {_shape(w2_scale_2)}; expected x [R, {h}], "
                         f"w2 {(e, h, two_i // 4)}, global scales [{e}, S]")
    if w13_scale.dim() != 3 or w2_scale.dim() != 3:
        raise ValueError(f"NVFP4 experts' block scales must be [E, N, K/16], got {_shape(w13_scale)} and "
                         f"{_shape(w2_scale)}")
    check_nvfp4_weight(*map(first_expert, (w13, w13_scale, w13_scale_2)), "w13")
    check_nvfp4_weight(*map(first_expert, (w2, w2_scale, w2_scale_2)), "w2")


def first_expert(t: torch.Tensor) -> torch.Tensor:
    """t[0] as narrow's view (an integer index needs a device guard, which a fake CUDA tensor cannot give)."""
    return t.narrow(0, 0, 1).squeeze(0)


def nvfp4_moe_swiglu_ref(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
) -> torch.Tensor:
    """The experts one at a time over their rows (counts read on the host), each weight dequantized a chunk of
    rows at a time; rows past sum(counts) zero."""
    check_nvfp4_experts(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    sizes = [int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if len(sizes) != w13.shape[0] or min(sizes, default=0) < 0 or sum(sizes) > x.shape[0]:
        raise ValueError(f"counts {sizes} must be {w13.shape[0]} values >= 0 summing to at most the {x.shape[0]} "
                         "rows of x")
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for e, n in enumerate(sizes):
        if n:
            rows = x[start : start + n]
            gate, up = nvfp4_linear_ref(rows, w13[e], w13_scale[e], w13_scale_2[e]).float().chunk(2, dim=-1)
            hidden = (F.silu(gate) * up).to(x.dtype)
            out[start : start + n] = nvfp4_linear_ref(hidden, w2[e], w2_scale[e], w2_scale_2[e])
            start += n
    return out


def _fake_moe(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
              w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
              rows_per_expert: float | None = None, masked: bool = False) -> torch.Tensor:
    check_nvfp4_experts(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    return x.new_empty(x.shape[0], w2.shape[1])


@declare("nvfp4_moe_swiglu", fake=_fake_moe, opaque=True)
def nvfp4_moe_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
    w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor, rows_per_expert: float | None = None,
    masked: bool = False,
) -> torch.Tensor:
    """Routed experts on x [R, H] grouped by expert (counts [E]; a list of ints in eager calls):
    ``w2[e] @ (silu(gate) * up)`` with ``[gate; up] = w13[e] @ x``, NVFP4 weights (w13 uint8 [E, 2I, H/2] with
    e4m3 scales [E, 2I, H/16] and global scales [E, 2]: gate's, up's; w2 uint8 [E, H, I/2], [E, H, I/16],
    [E, 1]) -> [R, H] in x's dtype, rows past sum(counts) zero (``masked``: undefined; the reference never reads
    them). ``rows_per_expert``: the GPU kernels' tile hint."""
    return nvfp4_moe_swiglu_ref(x, counts, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)


# ---- implementations ----------------------------------------------------------------------------

from epserve.kernels import cpu_nvfp4  # noqa: E402  (imports nothing of this module)

nvfp4_linear.implement("cpu", "epserve.kernels.cpu_nvfp4:linear", takes=cpu_nvfp4.linear_takes)
nvfp4_moe_swiglu.implement("cpu", "epserve.kernels.cpu_nvfp4:moe_swiglu", takes=cpu_nvfp4.moe_swiglu_takes)
# CUDA: the Triton kernels where the nvfp4_w4a16 op chose them (their self-test passed), else its torch backend
nvfp4_linear.implement("cuda", "epserve.kernels.nvfp4_triton:nvfp4_linear_triton", traced="op",
                       backend=("nvfp4_w4a16", "triton"))
nvfp4_linear.implement("cuda", "epserve.kernels.nvfp4_w4a16:linear_torch", traced="op")
nvfp4_moe_swiglu.implement("cuda", "epserve.kernels.nvfp4_triton:nvfp4_moe_swiglu_triton", traced="op",
                           backend=("nvfp4_w4a16", "triton"))
nvfp4_moe_swiglu.implement("cuda", "epserve.kernels.nvfp4_w4a16:moe_swiglu_torch", traced="op")
