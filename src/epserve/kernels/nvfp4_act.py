"""NVFP4 activations: token rows quantized to e2m1 with e4m3 block scales, as ModelOpt quantizes a tensor.

A row of ``K`` values (``K`` a multiple of 16) with its fp32 global scale ``g`` becomes ``K/2`` bytes of e2m1
codes (two per byte, the even column in the low nibble) and ``K/16`` float8_e4m3fn block scales: block scale
``= block amax / (6 * g)`` rounded to e4m3 (1 for an all-zero block), each value divided by ``e4m3 block scale
* g`` and rounded to the nearest e2m1 code point (ties to the even code, magnitudes above 6 to 6, the sign
kept even where the value rounds to 0). That is ``checkpoint.nvfp4.nvfp4_quantize`` applied to each row with
the same global scale, bit for bit, wherever its block scales are finite e4m3 (a per-tensor ``g`` too small for
a row's values would put a block scale past 448, which ModelOpt turns to NaN; here it saturates at 448). The
value of a code is ``e2m1 x (block scale x g)`` in fp32 (``nvfp4_act_dequant``).

``g`` is one fp32 per row (``[M]``: ``nvfp4_token_scale``, amax / (6 * 448), so the row's largest block scale
is 448) or one for the tensor (``[1]``: a checkpoint's ``input_scale``). The FP4 dispatch payload
(``moe.dispatch.payload``) sends rows quantized with their own token scale.

The ops (``nvfp4_act_quant``, ``nvfp4_act_dequant``, ``nvfp4_token_scale``; declared once, ``kernels.opdef``,
with fake implementations) have torch references made of elementwise work and reductions only: no host read,
no table copied to the device, so they run inside a captured CUDA graph and trace as torch code. The e2m1
rounding compares with the seven midpoints; the decode computes ``2^(e-1) * (1 + m/2)`` from the code's bits.
"""

from __future__ import annotations

import torch

from epserve.kernels.nvfp4 import GROUP, SCALE_DTYPE
from epserve.kernels.opdef import declare

E2M1_MAX = 6.0  # largest e2m1 magnitude
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-10  # an all-zero row's amax in nvfp4_token_scale: a positive global scale, never a division by 0
# Midpoints between neighbouring e2m1 magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6), each with how it breaks a tie:
# toward the even code, which is the lower one at 0.25, 1.25, 2.5, 5 and the upper one at 0.75, 1.75, 3.5.
_ROUND_UP_AT = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_act(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[int, int]:
    """x [M, K] (K a multiple of 16), global_scale fp32 [M] or [1] -> (M, K)."""
    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ValueError(f"NVFP4 activations must be [M, K] with K a multiple of {GROUP}, got {_shape(x)}")
    _check_global(x.shape[0], global_scale)
    return x.shape[0], x.shape[1]


def _check_global(m: int, global_scale: torch.Tensor) -> None:
    if global_scale.dtype != torch.float32 or global_scale.dim() != 1 or global_scale.shape[0] not in (m, 1):
        raise ValueError(f"NVFP4 activations' global scale must be fp32 [{m}] (per row) or [1] (per tensor), got "
                         f"{global_scale.dtype} {_shape(global_scale)}")


def check_packed(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> tuple[int, int]:
    """packed uint8 [M, K/2], scales e4m3 [M, K/16], global_scale fp32 [M] or [1] -> (M, K)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8:
        raise ValueError(f"packed NVFP4 rows must be uint8 [M, K/2], got {packed.dtype} {_shape(packed)}")
    m, k = packed.shape[0], 2 * packed.shape[1]
    if k % GROUP or scales.dtype != SCALE_DTYPE or _shape(scales) != (m, k // GROUP):
        raise ValueError(f"packed NVFP4 rows {_shape(packed)} need K = {k} a multiple of {GROUP} and {SCALE_DTYPE} "
                         f"block scales {(m, k // GROUP)}, got {scales.dtype} {_shape(scales)}")
    _check_global(m, global_scale)
    return m, k


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scales) -> uint8 e2m1 codes: the nearest code point, ties to the
    even code, magnitudes above 6 to 6, negative values (those rounding to 0 too) with the sign bit set."""
    a = x.abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _ROUND_UP_AT:
        index += (a >= midpoint) if tie_up else (a > midpoint)
    return index | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes -> fp32 values: sign bit 3, exponent bits 2-1, mantissa bit 0 (subnormal: 0 or 0.5)."""
    exponent = ((codes >> 1) & 3).float()
    mantissa = (codes & 1).float()
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, torch.exp2(exponent - 1) * (1 + 0.5 * mantissa))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def nvfp4_act_quant_ref(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (uint8 [M, K/2] packed e2m1, float8_e4m3fn [M, K/16] block scales) for the global scales
    ``global_scale`` (fp32 [M] or [1]); the arithmetic of ``checkpoint.nvfp4.nvfp4_quantize`` in fp32."""
    m, k = check_act(x, global_scale)
    blocks = x.float().view(m, k // GROUP, GROUP)
    g = global_scale.view(-1, 1)
    block_scale = blocks.abs().amax(-1) / (E2M1_MAX * g)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    scales = block_scale.clamp(max=E4M3_MAX).to(SCALE_DTYPE)
    divisor = (scales.float() * g).unsqueeze(-1)
    scaled = torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks))
    codes = e2m1_round(scaled).view(m, k)
    return (codes[:, 1::2] << 4) | codes[:, 0::2], scales


def nvfp4_act_dequant_ref(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """The rows' values [M, K] in ``dtype``: e2m1 x (block scale x global scale) computed in fp32."""
    m, k = check_packed(packed, scales, global_scale)
    values = e2m1_decode(torch.stack((packed & 0x0F, packed >> 4), dim=-1)).view(m, k // GROUP, GROUP)
    scale = scales.float() * global_scale.view(-1, 1)
    return (values * scale.unsqueeze(-1)).view(m, k).to(dtype)


def _fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = check_act(x, global_scale)
    return x.new_empty(m, k // 2, dtype=torch.uint8), x.new_empty(m, k // GROUP, dtype=SCALE_DTYPE)


def _fake_dequant(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    m, k = check_packed(packed, scales, global_scale)
    return packed.new_empty(m, k, dtype=dtype)


def _fake_token_scale(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], dtype=torch.float32)


@declare("nvfp4_act_quant", fake=_fake_quant)
def nvfp4_act_quant(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, K a multiple of 16) with fp32 global scales [M] (one per row) or [1] (per
    tensor) -> (uint8 [M, K/2] packed e2m1 codes, float8_e4m3fn [M, K/16] block scales)."""
    return nvfp4_act_quant_ref(x, global_scale)


@declare("nvfp4_act_dequant", fake=_fake_dequant)
def nvfp4_act_dequant(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Packed NVFP4 rows (uint8 [M, K/2], e4m3 [M, K/16], fp32 [M] or [1]) -> their values [M, K] in ``dtype``
    (computed in fp32, cast once)."""
    return nvfp4_act_dequant_ref(packed, scales, global_scale, dtype)


@declare("nvfp4_token_scale", fake=_fake_token_scale)
def nvfp4_token_scale(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 [M]: each row's global scale, ``amax(|row|) / (6 * 448)`` (amax at least ``MIN_AMAX``)."""
    if x.dim() != 2:
        raise ValueError(f"nvfp4_token_scale needs x [M, K], got {_shape(x)}")
    return x.float().abs().amax(-1).clamp(min=MIN_AMAX) / (E2M1_MAX * E4M3_MAX)
