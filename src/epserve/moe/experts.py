"""Routed experts of one rank as stacked weights, run as one grouped GEMM over tokens grouped by expert.

The per-expert row counts stay on the device. The CUDA paths take them as device offsets, for every
dtype, so a decode step can be captured in a CUDA graph: FP8 grouped kernels, ``torch._grouped_mm`` for
bf16 on Hopper, the Triton grouped GEMM otherwise; the CPU's decode kernel reads them itself, its other paths
(grouped GEMM, a loop) on the host: all one op, ``kernels.grouped.grouped_swiglu``, which a trace treats as
one call where it cannot enter it.

The dispatcher may hand over an FP8 payload (``ExpertInput.scales``): rows already quantized as
``kernels.fp8.act_quant`` quantizes them. FP8 experts run their GEMMs on it directly; experts in the
model dtype, and NVFP4 experts (four-bit weights, activations in the model dtype), dequantize it first. An
NVFP4 payload (``--dispatch-dtype nvfp4``: e2m1 codes, ``scales`` and ``ExpertInput.global_scale``) is
dequantized to the model dtype by every kind of experts (NVFP4 experts run W4A16 on it, or with ``w4a4`` set
quantize it again with their own input scales: ``kernels.nvfp4_w4a4_moe``). Every
path takes the dispatcher's masked layout (``ExpertInput.masked``: the padding rows skipped by the GEMMs, and by
the FP8 quantizers) and its row-tile hint (``ExpertInput.rows_per_expert``).
"""

from __future__ import annotations

import torch
from torch import nn

from epserve.kernels.fp8 import BLOCK, FP8_DTYPE, fp8_weight_pair
from epserve.kernels.fp8_layers import fp8_moe_swiglu, fp8_moe_swiglu_quantized
from epserve.kernels.nvfp4 import SCALE_DTYPE, nvfp4_moe_swiglu, nvfp4_shapes
from epserve.kernels.nvfp4_act import nvfp4_act_dequant
from epserve.kernels.nvfp4_w4a4_moe import nvfp4_w4a4_moe_swiglu
from epserve.kernels.ops import grouped_swiglu
from epserve.moe.dispatch.base import ExpertInput

F32 = torch.float32


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 payload (q fp8 [N, H], fp32 scales [N, ceil(H/128)], one per row and 128 columns) -> [N, H]."""
    h = q.shape[1]
    return (q.float() * scales.float().repeat_interleave(BLOCK, dim=1)[:, :h]).to(dtype)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU experts: ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I].
    With ``fp8`` both are float8 e4m3 with one fp32 scale per 128x128 tile (``w13_scale_inv``
    [E, 2I/128, H/128], ``w2_scale_inv``), run as grouped block-scaled FP8 GEMMs.

    ``act_dtype``: the model's activation dtype, the dtype of the output when the input is an FP8 payload
    (the FP8 rows no longer tell it, and FP8 weights do not either); whoever knows the runtime dtype sets
    it (at construction or as the attribute). Experts in the model dtype need not: their weights' dtype.

    With ``nvfp4`` the weights are NVFP4 as ModelOpt stores each expert's linears: ``w13`` uint8 [E, 2I, H/2] with
    e4m3 block scales ``w13_scale`` [E, 2I, H/16] and fp32 global scales ``w13_scale_2`` [E, 2] (gate's, up's;
    ``w13_input_scale`` the activations'), ``w2`` uint8 [E, H, I/2] with ``w2_scale`` [E, H, I/16], ``w2_scale_2``
    and ``w2_input_scale`` [E, 1]; run as four-bit weights (``kernels.nvfp4.nvfp4_moe_swiglu``, W4A16: an FP8
    payload is dequantized to ``act_dtype`` first, which must then be set), or with ``w4a4`` set
    (``model.layers.use_w4a4``) with each expert's rows quantized to NVFP4 by its input scales
    (``kernels.nvfp4_w4a4_moe.nvfp4_w4a4_moe_swiglu``, W4A4 on FP4 tensor cores)."""

    def __init__(
        self, num_local_experts: int, hidden_size: int, intermediate_size: int, fp8: bool = False,
        act_dtype: torch.dtype | None = None, nvfp4: bool = False,
    ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.intermediate_size = intermediate_size
        self.act_dtype = act_dtype
        w13_shape = (num_local_experts, 2 * intermediate_size, hidden_size)
        w2_shape = (num_local_experts, hidden_size, intermediate_size)
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        self.nvfp4 = nvfp4
        self.w4a4 = False
        if nvfp4:
            for name, (n, k), parts in (("w13", w13_shape[1:], 2), ("w2", w2_shape[1:], 1)):
                packed, scales = nvfp4_shapes(n, k)
                setattr(self, name, _frozen(torch.empty(num_local_experts, *packed, dtype=torch.uint8)))
                setattr(self, f"{name}_scale", _frozen(torch.empty(num_local_experts, *scales, dtype=SCALE_DTYPE)))
                for scalar in ("scale_2", "input_scale"):  # per expert and part
                    setattr(self, f"{name}_{scalar}", _frozen(torch.empty(num_local_experts, parts, dtype=F32)))
        elif fp8:
            self.w13, self.w13_scale_inv = fp8_weight_pair(*w13_shape)
            self.w2, self.w2_scale_inv = fp8_weight_pair(*w2_shape)
        else:
            self.w13 = nn.Parameter(torch.empty(w13_shape), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(w2_shape), requires_grad=False)

    def _out_dtype(self, expert_input: ExpertInput) -> torch.dtype:
        if expert_input.scales is None:
            return expert_input.hidden_states.dtype
        if self.w13_scale_inv is None and not self.nvfp4:
            return self.w13.dtype
        if self.act_dtype is None:
            raise ValueError("an FP8 or NVFP4 payload (ExpertInput.scales) reached FP8 or NVFP4 experts whose "
                             "act_dtype (the model's activation dtype, the output's) was not set")
        return self.act_dtype

    def forward(self, expert_input: ExpertInput) -> torch.Tensor:
        """Rows grouped by local expert [N, H] -> expert outputs [N, H] in the same order (in the model's
        activation dtype; rows past the counts' sum zero, or undefined for a ``masked`` input, whose padding
        rows the experts skip, FP8 or not; the GEMMs' row tile from ``rows_per_expert``)."""
        x, counts, scales = expert_input.hidden_states, expert_input.num_tokens_per_expert, expert_input.scales
        if expert_input.global_scale is not None:  # an NVFP4 payload: its values in the model dtype (W4A16)
            if scales is None:
                raise ValueError("an NVFP4 payload (ExpertInput.global_scale) came without its block scales")
            x = nvfp4_act_dequant(x, scales, expert_input.global_scale, self._out_dtype(expert_input))
            scales = None
        want_scales = (x.shape[0], -(-x.shape[1] // BLOCK))
        if scales is not None and (x.dtype != FP8_DTYPE or tuple(scales.shape) != want_scales):
            raise ValueError(f"an FP8 payload is {FP8_DTYPE} rows [N, H] with fp32 scales [N, ceil(H/128)], got "
                             f"{x.dtype} {tuple(x.shape)} and scales {tuple(scales.shape)}")
        out_dtype = self._out_dtype(expert_input)
        if x.shape[0] == 0:
            return torch.empty(0, self.w2.shape[1], dtype=out_dtype, device=x.device)
        tile, masked = expert_input.rows_per_expert, expert_input.masked
        if self.w13_scale_inv is not None:
            if scales is not None:  # already quantized by the dispatcher: no activation quantization here
                return fp8_moe_swiglu_quantized(x, scales, counts, self.w13, self.w13_scale_inv, self.w2,
                                                self.w2_scale_inv, out_dtype, tile, masked)
            return fp8_moe_swiglu(x, counts, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv, tile, masked)
        if scales is not None:
            x = dequantize_rows(x, scales, out_dtype)
        if self.nvfp4 and self.w4a4:
            return nvfp4_w4a4_moe_swiglu(x, counts, self.w13, self.w13_scale, self.w13_scale_2, self.w13_input_scale,
                                         self.w2, self.w2_scale, self.w2_scale_2, self.w2_input_scale, tile, masked)
        if self.nvfp4:
            return nvfp4_moe_swiglu(x, counts, self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale,
                                    self.w2_scale_2, tile, masked)
        # CUDA: device counts (_grouped_mm on bf16 SM90+, or Triton), no host sync; CPU: the decode kernel reads
        # the counts, larger inputs read them on the host
        return grouped_swiglu(x, counts, self.w13, self.w2, tile, masked)
