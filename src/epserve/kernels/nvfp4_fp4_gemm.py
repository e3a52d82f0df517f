"""The GEMM on FP4 tensor cores that NVFP4 W4A4 runs on (``kernels.nvfp4_w4a4`` for the linears,
``kernels.nvfp4_w4a4_moe`` for the routed experts): ``torch.nn.functional.scaled_mm`` on ``float4_e2m1fn_x2``
data, BlockWise1x16 e4m3 scales in cuBLAS's swizzled 128x4 layout (:func:`swizzle_scales`) and a TensorWise fp32
scale each, one GEMM per part of a fused weight (each part with its own global scale). Needs compute capability
10.0 and up (never Hopper); shape operations and device work only, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels.nvfp4 import SCALE_DTYPE, nvfp4_linear_ref
from epserve.kernels.nvfp4_act import nvfp4_act_dequant_ref

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (10, 0)  # FP4 tensor cores (Blackwell)
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4  # cuBLAS's block-scale tile: 128 rows x 4 scales, stored as 32 x (4 x 4)


def swizzle_scales(scales: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales [R, C] (one row per matrix row, one column per 16 values of K) in cuBLAS's swizzled
    layout, flat: padded with zeros to 128-row by 4-column tiles, tile (rb, cb) at ``(rb * ceil(C/4) + cb) *
    512``, and within it scale (32 i + j, c) at ``16 j + 4 i + c``. Shape operations only (no indexing, no host
    read)."""
    r, c = scales.shape
    rows, cols = -(-r // SWIZZLE_ROWS) * SWIZZLE_ROWS, -(-c // SWIZZLE_COLS) * SWIZZLE_COLS
    padded = F.pad(scales.view(torch.uint8), (0, cols - c, 0, rows - r))  # (float8 cannot be padded)
    tiles = padded.view(rows // SWIZZLE_ROWS, 4, 32, cols // SWIZZLE_COLS, SWIZZLE_COLS).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(SCALE_DTYPE)



def fp4_gemm(q: torch.Tensor, s: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             weight_scale_2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """NVFP4 rows (q uint8 [M, K/2], e4m3 block scales s [M, K/16], global scale g fp32 [1]) times an NVFP4
    weight^T by ``scaled_mm`` on FP4 operands -> [M, N] out_dtype: one GEMM per part, each with its own weight
    global scale, the block scales swizzled on the device. ``float4_e2m1fn_x2`` keeps the even column in the low
    nibble, as ModelOpt packs it: the bytes are used as stored."""
    # (a recent torch's; with an older one this raises, so the self-test fails and the Triton emulation runs)
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    recipe = [ScalingType.BlockWise1x16, ScalingType.TensorWise]
    swizzle = [SwizzleType.SWIZZLE_32_4_4, SwizzleType.NO_SWIZZLE]
    a, scale_a = q.view(torch.float4_e2m1fn_x2), [swizzle_scales(s), g]
    parts = weight_scale_2.numel()
    rows = weight.shape[0] // parts
    outs = []
    for p in range(parts):
        w = weight.narrow(0, p * rows, rows).view(torch.float4_e2m1fn_x2)
        scale_b = [swizzle_scales(weight_scale.narrow(0, p * rows, rows)), weight_scale_2.narrow(0, p, 1)]
        outs.append(scaled_mm(a, w.t(), scale_a, recipe, scale_b, recipe, swizzle_a=swizzle, swizzle_b=swizzle,
                              output_dtype=out_dtype))
    return outs[0] if parts == 1 else torch.cat(outs, dim=1)



def fp4_gemm_takes(weight: torch.Tensor, weight_scale_2: torch.Tensor) -> bool:
    """The NVFP4 weights (uint8 [N, K/2], global scales [S]) :func:`fp4_gemm` takes: K a multiple of 32 (the
    packed K a multiple of 16), each part's rows a multiple of 16."""
    k, parts = 2 * weight.shape[-1], weight_scale_2.numel()
    return k % 32 == 0 and parts > 0 and weight.shape[0] % parts == 0 and (weight.shape[0] // parts) % 16 == 0


def fp4_gemm_ref(q: torch.Tensor, s: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`fp4_gemm`'s arithmetic on any device: both operands dequantized, multiplied in fp32, the result in
    out_dtype (what the W4A4 references compute from the same quantized rows)."""
    values = nvfp4_act_dequant_ref(q, s, g, torch.float32)
    return nvfp4_linear_ref(values, weight, weight_scale, weight_scale_2).to(out_dtype)
