"""Routed experts of one rank as stacked weights, run as one grouped GEMM over tokens grouped by expert.

The per-expert row counts stay on the device. The GPU paths (FP8 grouped kernels, ``torch._grouped_mm``
on Hopper) take them as device offsets; the CPU paths (the decode kernel, grouped GEMM, a loop) read them
on the host inside the custom op ``epserve::grouped_swiglu``, which ``torch.compile`` treats as one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epserve.kernels import moe_swiglu
from epserve.kernels.fp8 import fp8_moe_swiglu, fp8_weight_pair
from epserve.kernels.ops import tracing
from epserve.moe.dispatch.base import ExpertInput


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm takes bf16 on CPU and on Hopper-class GPUs."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    return x.device.type == "cpu" or torch.cuda.get_device_capability(x.device)[0] >= 9


def _grouped_mm_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    offs = counts.cumsum(0).to(device=x.device, dtype=torch.int32)
    gate, up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)


def grouped_swiglu_host(x: torch.Tensor, sizes: tuple[int, ...], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts ``w2[e] @ (silu(gate) * up)``, ``[gate; up] = w13[e] @ x``, on rows grouped by expert
    (``sizes[e]`` each, in order, known on the host; rows past their sum come out zero)."""
    total = sum(sizes)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    if total == 0:
        return out
    rows = x[:total]
    y = moe_swiglu(rows, sizes, w13, w2)  # the CPU decode kernel, where it applies
    if y is None and _grouped_mm_ok(rows):
        y = _grouped_mm_swiglu(rows, torch.tensor(sizes), w13, w2)
    if y is not None:
        out[:total] = y
        return out
    start = 0
    for e, n in enumerate(sizes):
        if n:
            gate, up = F.linear(rows[start : start + n], w13[e]).chunk(2, dim=-1)
            out[start : start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


@torch.library.custom_op("epserve::grouped_swiglu", mutates_args=())
def grouped_swiglu(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The same as a custom op taking the counts as a tensor, for traces (kernels/ops.py: eager calls skip
    the op's first-call cost)."""
    return grouped_swiglu_host(x, tuple(int(n) for n in counts.tolist()), w13, w2)


@grouped_swiglu.register_fake
def _(x, counts, w13, w2):  # noqa: ANN001
    return x.new_empty(x.shape[0], w2.shape[1])


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU experts: ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I].
    With ``fp8`` both are float8 e4m3 with one fp32 scale per 128x128 tile (``w13_scale_inv``
    [E, 2I/128, H/128], ``w2_scale_inv``), run as grouped block-scaled FP8 GEMMs."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int, fp8: bool = False) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.intermediate_size = intermediate_size
        w13_shape = (num_local_experts, 2 * intermediate_size, hidden_size)
        w2_shape = (num_local_experts, hidden_size, intermediate_size)
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        if fp8:
            self.w13, self.w13_scale_inv = fp8_weight_pair(*w13_shape)
            self.w2, self.w2_scale_inv = fp8_weight_pair(*w2_shape)
        else:
            self.w13 = nn.Parameter(torch.empty(w13_shape), requires_grad=False)
            self.w2 = nn.Parameter(torch.empty(w2_shape), requires_grad=False)

    def forward(self, expert_input: ExpertInput) -> torch.Tensor:
        """Rows grouped by local expert [N, H] -> expert outputs [N, H] in the same order."""
        x = expert_input.hidden_states
        if x.shape[0] == 0:
            return x.new_empty(0, self.w2.shape[1])
        if self.w13_scale_inv is not None:
            return fp8_moe_swiglu(x, expert_input.num_tokens_per_expert, self.w13, self.w13_scale_inv,
                                  self.w2, self.w2_scale_inv)
        counts = expert_input.num_tokens_per_expert
        if x.device.type == "cuda" and _grouped_mm_ok(x):  # device offsets; padding rows zeroed, no sync
            valid = torch.arange(x.shape[0], device=x.device) < counts.sum()
            return _grouped_mm_swiglu(x, counts, self.w13, self.w2) * valid[:, None].to(x.dtype)
        if tracing():
            return grouped_swiglu(x, counts, self.w13, self.w2)
        return grouped_swiglu_host(x, expert_input.counts_list(), self.w13, self.w2)  # all_to_all's host counts
