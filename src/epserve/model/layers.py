"""Small building blocks: linear weights (model dtype, FP8 block-scaled or NVFP4), RMSNorm, rotary embedding
with YaRN scaling, SwiGLU MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from epserve.checkpoint import fp8_block_dequantize
from epserve.config import ModelConfig, RopeScaling, yarn_get_mscale
from epserve.kernels import gather_rows, linear, rms_norm, rope_ref, silu_mul
from epserve.kernels.fp8 import BLOCK, block_fp8_gemm, fp8_weight_pair, silu_mul_quant
from epserve.kernels.fp8_layers import fp8_linear
from epserve.kernels.nvfp4 import SCALE_DTYPE, dequantize_rows, nvfp4_linear, nvfp4_shapes
from epserve.kernels.nvfp4_w4a4 import nvfp4_w4a4_linear
from epserve.kernels.nvfp4_w4a4_moe import fp4_experts_take
from epserve.moe.experts import GroupedExperts


class Linear(nn.Module):
    """``y = x W^T``, W ``[out, in]``: in the model dtype, or (``fp8``) float8 e4m3 with one fp32 scale per
    128x128 tile in ``weight_scale_inv``, run as a block-scaled FP8 GEMM (activations quantized per
    token and 128 columns), or (``nvfp4``) NVFP4 as ModelOpt stores it: ``weight`` uint8 ``[out, in/2]``,
    ``weight_scale`` e4m3 ``[out, in/16]``, and per part (``parts`` linears fused along the output rows, each
    with its own) the global ``weight_scale_2`` and the activations' ``input_scale``, fp32 ``[parts]``; run as
    four-bit weights (``kernels.nvfp4.nvfp4_linear``, W4A16), or with ``w4a4`` set (:func:`use_w4a4`) with the
    activations quantized to NVFP4 by their input scale (``kernels.nvfp4_w4a4``, W4A4 on FP4 tensor cores)."""

    def __init__(self, in_features: int, out_features: int, fp8: bool = False, nvfp4: bool = False,
                 parts: int = 1) -> None:
        super().__init__()
        self.weight_scale_inv: nn.Parameter | None = None
        self.weight_scale_2: nn.Parameter | None = None
        if nvfp4:
            packed, scales = nvfp4_shapes(out_features, in_features)
            self.weight = _frozen(torch.empty(packed, dtype=torch.uint8))
            self.weight_scale = _frozen(torch.empty(scales, dtype=SCALE_DTYPE))
            self.weight_scale_2 = _frozen(torch.empty(parts, dtype=torch.float32))
            self.input_scale = _frozen(torch.empty(parts, dtype=torch.float32))
            self.w4a4 = False
        elif fp8:
            self.weight, self.weight_scale_inv = fp8_weight_pair(out_features, in_features)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out] in x's dtype."""
        if self.weight_scale_2 is not None:
            if self.w4a4:
                return nvfp4_w4a4_linear(x, self.weight, self.weight_scale, self.weight_scale_2, self.input_scale)
            return nvfp4_linear(x, self.weight, self.weight_scale, self.weight_scale_2)
        if self.weight_scale_inv is None:
            return linear(x, self.weight)
        return fp8_linear(x, self.weight, self.weight_scale_inv)

    def dequantized(self) -> torch.Tensor:
        """The weight as fp32 ``[out, in]`` (after loading; for derived weights such as MLA's absorbed ones)."""
        if self.weight_scale_2 is not None:
            return dequantize_rows(self.weight, self.weight_scale, self.weight_scale_2)
        if self.weight_scale_inv is None:
            return self.weight.detach().float()
        return fp8_block_dequantize(self.weight, self.weight_scale_inv, (BLOCK, BLOCK))


def use_w4a4(model: nn.Module) -> int:
    """Run every NVFP4 :class:`Linear` of ``model`` and its NVFP4 routed experts (``moe.experts.GroupedExperts``)
    W4A4: their activations quantized to NVFP4 by the checkpoint's input scales (an expert's by its own). Experts
    whose shapes the FP4 GEMM does not take stay W4A16 (``kernels.nvfp4_w4a4_moe.fp4_experts_take``: elsewhere
    they would read their counts on the host). Returns how many modules switched (linears and experts' modules)."""
    switched = [m for m in model.modules() if (isinstance(m, Linear) and m.weight_scale_2 is not None) or (
        isinstance(m, GroupedExperts) and m.nvfp4 and fp4_experts_take(m.w13, m.w13_scale_2, m.w2, m.w2_scale_2))]
    for m in switched:
        m.w4a4 = True
    return len(switched)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim], normalised in fp32, scaled in x's dtype (``kernels.rms_norm``)."""
        return rms_norm(x, self.weight, self.eps)


def yarn_inv_freq(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: blend interpolated and extrapolated frequencies with a linear ramp over the dims. [dim/2]"""

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Rotary embedding on the ``qk_rope_head_dim`` part of q and k, with a cos/sin table for every
    position up to ``max_position_embeddings``. DeepSeek stores rotary dims as interleaved pairs
    ``(x0, x1), (x2, x3), …``; the output is laid out de-interleaved ``[evens', odds']`` (the same
    permutation for q and k, so scores are unchanged)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.qk_rope_head_dim
        self.interleave = config.rope_interleave
        if torch.empty(0).is_meta:  # the loader's plan: shapes only (ops on meta import much of torch)
            cos = sin = torch.empty(config.max_position_embeddings, dim // 2)
        else:
            cos, sin = _rotary_tables(config)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTable:
        """cos/sin rows for ``positions`` [T], looked up once per forward and shared by every layer."""
        return RopeTable(gather_rows(self.cos, positions, dtype), gather_rows(self.sin, positions, dtype),
                         self.interleave)


def _rotary_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_position_embeddings, rope_dim / 2], YaRN's attention scaling folded in."""
    dim = config.qk_rope_head_dim
    s = config.rope_scaling
    if s is None:
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        attention_scaling = 1.0
    else:
        inv_freq = yarn_inv_freq(dim, config.rope_theta, s)
        attention_scaling = yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim)
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, dim/2]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


@dataclass(frozen=True)
class RopeTable:
    cos: torch.Tensor  # [T, rope_dim / 2]
    sin: torch.Tensor  # [T, rope_dim / 2]
    interleave: bool

    def rows(self, start: int, end: int) -> RopeTable:
        """The table of tokens ``[start, end)`` (a micro-batch's)."""
        return RopeTable(self.cos[start:end], self.sin[start:end], self.interleave)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, ..., rope_dim] -> same shape, rotated."""
        return rope_ref(x, self.cos, self.sin, self.interleave)


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM (``nvfp4``: gate and up
    keep their own global scales, the fused linear's two parts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, fp8: bool = False, nvfp4: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, fp8, nvfp4, parts=2)
        self.down_proj = Linear(intermediate_size, hidden_size, fp8, nvfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H]"""
        gate_up = self.gate_up_proj(x)
        down = self.down_proj
        if down.weight_scale_inv is not None:  # SiLU·mul fused with the activation quantization
            return block_fp8_gemm(*silu_mul_quant(gate_up), down.weight, down.weight_scale_inv, x.dtype)
        return down(silu_mul(gate_up))
