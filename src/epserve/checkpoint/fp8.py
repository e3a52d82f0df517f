"""FP8 block quantization as DeepSeek-V3 publishes it: float8_e4m3fn weights ``[out, in]`` with one
float32 ``scale_inv`` per ``b0 × b1`` tile (128 × 128), multiplied in to dequantize."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DEFAULT_BLOCK = (128, 128)

class Fp8Weight(NamedTuple):
    """A block-quantized weight: ``weight`` float8_e4m3fn ``[out, in]`` and ``scale_inv`` float32
    ``[ceil(out / b0), ceil(in / b1)]``. Unpacks as ``w_fp8, scale_inv``."""

    weight: torch.Tensor
    scale_inv: torch.Tensor


def _check_block(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"block quantization needs a 2-D [out, in] weight, got shape {tuple(shape)}")
    b0, b1 = int(block[0]), int(block[1])
    if b0 <= 0 or b1 <= 0:
        raise ValueError(f"block size must be positive, got {block}")
    return b0, b1


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> Fp8Weight:
    """Quantize ``w`` ``[out, in]`` to float8_e4m3fn with one scale per ``block`` tile.

    Each tile's absolute maximum maps to 448 (the e4m3 maximum); ``scale_inv = amax / 448`` is
    float32 ``[ceil(out / b0), ceil(in / b1)]`` and ``w ≈ w_fp8.float() * scale_inv`` (per tile).
    Edge tiles may be partial. All-zero tiles get ``scale_inv = 1``.
    """
    b0, b1 = _check_block(w.shape, block)
    out_dim, in_dim = w.shape
    n0, n1 = math.ceil(out_dim / b0), math.ceil(in_dim / b1)
    x = w.detach().float()
    padded = torch.zeros(n0 * b0, n1 * b1, dtype=torch.float32, device=x.device)
    padded[:out_dim, :in_dim] = x
    tiles = padded.view(n0, b0, n1, b1)  # [n0, b0, n1, b1]
    amax = tiles.abs().amax(dim=(1, 3))  # [n0, n1]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    w_fp8 = q.view(n0 * b0, n1 * b1)[:out_dim, :in_dim].to(FP8_DTYPE).contiguous()
    return Fp8Weight(w_fp8, scale_inv.contiguous())


def fp8_block_dequantize(
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = DEFAULT_BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse of ``fp8_block_quantize``: ``[out, in]`` = ``w_fp8`` times its tile's scale, float32
    unless ``out`` (any float dtype, same shape) is given. One row of tiles at a time, so the only
    temporary is ``b0 × in`` float32, however large the weight."""
    b0, b1 = _check_block(w_fp8.shape, block)
    out_dim, in_dim = w_fp8.shape
    expected = (math.ceil(out_dim / b0), math.ceil(in_dim / b1))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(w_fp8.shape)} "
            f"with block {(b0, b1)}: expected {expected}"
        )
    if out is None:
        out = torch.empty(out_dim, in_dim, dtype=torch.float32, device=w_fp8.device)
    elif tuple(out.shape) != (out_dim, in_dim):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(out_dim, in_dim)}")
    scales = scale_inv.float().repeat_interleave(b1, dim=1)[:, :in_dim]  # [n0, in]
    for i in range(expected[0]):
        rows = slice(i * b0, min((i + 1) * b0, out_dim))
        out[rows] = w_fp8[rows].float() * scales[i]
    return out
