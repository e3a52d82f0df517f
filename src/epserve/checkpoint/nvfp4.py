"""NVFP4 as NVIDIA's Model Optimizer (ModelOpt) stores it in a Hugging Face checkpoint.

A quantized linear ``X`` (``[N, K]``, ``K`` a multiple of 16) is four tensors:

- ``X.weight``: uint8 ``[N, K/2]``, two e2m1 codes per byte; the even column's code is the low nibble,
  the odd column's the high nibble;
- ``X.weight_scale``: float8_e4m3fn ``[N, K/16]``, one scale per 16 consecutive values of a row;
- ``X.weight_scale_2``: float32 scalar, the global scale, ``amax(|W|) / (6 * 448)``;
- ``X.input_scale``: float32 scalar, ``amax(|x|) / (6 * 448)`` of the activations (for FP4 activations).

A code is ``sign << 3 | magnitude index`` into ``E2M1_VALUES``; the weight is
``E2M1_VALUES[code] * weight_scale * weight_scale_2`` (``nvfp4_dequantize``, the oracle, in fp32).
Modules the format leaves alone are listed in ``exclude_modules`` as wildcard patterns (``is_excluded``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from epserve.checkpoint.reader import CheckpointError

NVFP4_GROUP = 16  # values per block scale
E2M1_MAX = 6.0  # largest e2m1 magnitude
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
SCALE_DTYPE = torch.float8_e4m3fn
NVFP4_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")

# The 16 code points: codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same with the sign bit set.
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float32)
# Midpoints between neighbouring magnitudes; a tie goes to the even code (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4).
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)


class Nvfp4Weight(NamedTuple):
    """A quantized ``[N, K]`` weight: ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn
    ``[N, K/16]`` and ``weight_scale_2`` float32 0-d. Unpacks as ``weight, weight_scale, weight_scale_2``."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor


# ---- codes and bytes -------------------------------------------------------------------------


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (each < 16, ``K`` even) -> uint8 ``[..., K/2]``: column ``2j`` in the low
    nibble of byte ``j``, column ``2j + 1`` in its high nibble."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"e2m1 codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"e2m1 packing needs an even last dimension, got shape {tuple(codes.shape)}")
    return (codes[..., 1::2] << 4) | (codes[..., 0::2] & 0x0F)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_e2m1``: uint8 ``[..., K/2]`` -> uint8 codes ``[..., K]``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed e2m1 must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scales) to the nearest e2m1 code point, ties to the
    even code, magnitudes above 6 to 6; negative values (even those that round to 0) keep the sign bit."""
    x = x.float()
    sign = (x < 0).to(torch.uint8) << 3
    magnitude = torch.searchsorted(_MIDPOINTS.to(x.device), x.abs().contiguous(), right=False)
    # A value exactly on an odd-indexed midpoint (0.75, 1.75, 3.5) rounds up to the even code above it.
    on_odd = (x.abs().unsqueeze(-1) == _MIDPOINTS[1::2].to(x.device)).any(-1)
    return sign | (magnitude + on_odd).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> their float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


# ---- weights ---------------------------------------------------------------------------------


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """The per-tensor scale ModelOpt stores as ``weight_scale_2`` or ``input_scale``: ``amax / (6 * 448)``,
    so the largest block scale is 448, the e4m3 maximum."""
    return torch.as_tensor(amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX)


def _check_2d(w: torch.Tensor, group: int) -> tuple[int, int]:
    if w.dim() != 2:
        raise ValueError(f"NVFP4 quantization needs a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if k % group:
        raise ValueError(f"NVFP4 needs the input dimension ({k}) to be a multiple of the group size {group}")
    return n, k


def nvfp4_quantize(
    w: torch.Tensor, weight_scale_2: torch.Tensor | None = None, group: int = NVFP4_GROUP
) -> Nvfp4Weight:
    """Quantize ``w`` ``[N, K]`` to NVFP4 as ModelOpt does.

    The global scale is ``amax(|w|) / (6 * 448)`` unless given; each block of ``group`` values of a row
    gets ``block_amax / (6 * global)`` (1 for an all-zero block) rounded to e4m3; each value is divided by
    ``e4m3 block scale * global`` and rounded to e2m1 (``e2m1_codes``). A block whose scale rounds to 0 in
    e4m3 (a block under about 2e-6 of the tensor's largest value) dequantizes to zeros; its codes are 0.
    """
    n, k = _check_2d(w, group)
    x = w.detach().float()
    if weight_scale_2 is None:
        weight_scale_2 = nvfp4_global_scale(x.abs().amax())
    weight_scale_2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=x.device).reshape(())
    blocks = x.view(n, k // group, group)
    block_scale = blocks.abs().amax(-1) / (E2M1_MAX * weight_scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    weight_scale = block_scale.to(SCALE_DTYPE)
    divisor = (weight_scale.float() * weight_scale_2).unsqueeze(-1)
    scaled = torch.where(divisor > 0, blocks / divisor, torch.zeros_like(blocks))
    codes = e2m1_codes(scaled.view(n, k))
    return Nvfp4Weight(pack_e2m1(codes).contiguous(), weight_scale.contiguous(), weight_scale_2.clone())


def nvfp4_dequantize(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor | float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The oracle: ``[N, K]`` = e2m1 value × its block's e4m3 scale × the global scale, computed in fp32
    and then cast to ``dtype``."""
    n, half = weight.shape
    k = 2 * half
    if weight_scale.dim() != 2 or weight_scale.shape[0] != n or k % weight_scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} does not fit weight {tuple(weight.shape)}")
    group = k // weight_scale.shape[1]
    values = e2m1_values(unpack_e2m1(weight)).view(n, k // group, group)
    scale = weight_scale.float() * torch.as_tensor(weight_scale_2, dtype=torch.float32, device=weight.device)
    return (values * scale.unsqueeze(-1)).view(n, k).to(dtype)


# ---- checks ----------------------------------------------------------------------------------


def _spec(t: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(t, torch.Tensor):
        return t.dtype, tuple(t.shape)
    dtype, shape = t
    return dtype, tuple(int(s) for s in shape)


def check_nvfp4_module(
    module: str, tensors: Mapping[str, Any], in_features: int | None = None, out_features: int | None = None
) -> None:
    """Refuse a quantized linear ``module`` the format cannot describe.

    ``tensors`` maps each suffix (``weight``, ``weight_scale``, ``weight_scale_2``, ``input_scale``) to the
    tensor or to its ``(dtype, shape)``; ``in_features``/``out_features``, when given, are the model's
    ``[N, K]``. A missing tensor, a wrong dtype or a shape that does not fit raises ``CheckpointError``
    naming the full tensor name.
    """
    specs = {}
    for suffix in NVFP4_SUFFIXES:
        if tensors.get(suffix) is None:
            raise CheckpointError(f"NVFP4 checkpoint lacks tensor {module}.{suffix}")
        specs[suffix] = _spec(tensors[suffix])
    (w_dtype, w_shape), (s_dtype, s_shape) = specs["weight"], specs["weight_scale"]
    if w_dtype != torch.uint8 or len(w_shape) != 2:
        raise CheckpointError(f"{module}.weight must be uint8 [N, K/2] (packed e2m1), got {w_dtype} {list(w_shape)}")
    n, k = w_shape[0], 2 * w_shape[1]
    if (out_features is not None and n != out_features) or (in_features is not None and k != in_features):
        raise CheckpointError(
            f"{module}.weight has shape {list(w_shape)}; the model needs [{out_features}, {in_features} / 2]"
        )
    if k % NVFP4_GROUP:
        raise CheckpointError(f"{module}.weight: K = {k} is not a multiple of the group size {NVFP4_GROUP}")
    if s_dtype != SCALE_DTYPE or s_shape != (n, k // NVFP4_GROUP):
        raise CheckpointError(
            f"{module}.weight_scale must be float8_e4m3fn [{n}, {k // NVFP4_GROUP}] for weight {list(w_shape)}, "
            f"got {s_dtype} {list(s_shape)}"
        )
    for suffix in ("weight_scale_2", "input_scale"):
        dtype, shape = specs[suffix]
        if dtype != torch.float32 or any(s != 1 for s in shape):
            raise CheckpointError(f"{module}.{suffix} must be a float32 scalar, got {dtype} {list(shape)}")


def is_excluded(module: str, patterns: Iterable[str]) -> bool:
    """Whether ``module`` (``model.layers.3.self_attn.kv_a_proj_with_mqa``) is one of ``exclude_modules``:
    a pattern matches the name itself or any module that contains it (``*`` and ``?`` wildcards, as
    ModelOpt writes them: ``model.layers.*.self_attn*``, ``lm_head``)."""
    parts = module.split(".")
    prefixes = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatchcase(p, pat) for pat in patterns for p in prefixes)
