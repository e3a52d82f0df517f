"""Routed experts of one rank as stacked weights, run as one grouped GEMM over tokens grouped by expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epserve.kernels import moe_swiglu
from epserve.moe.dispatch.base import ExpertInput


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm takes bf16 on CPU and on Hopper-class GPUs."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    return x.device.type == "cpu" or torch.cuda.get_device_capability(x.device)[0] >= 9


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU experts: ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I]."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_local_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, hidden_size, intermediate_size))

    def forward(self, expert_input: ExpertInput) -> torch.Tensor:
        """Rows grouped by local expert [N, H] -> expert outputs [N, H] in the same order."""
        x = expert_input.hidden_states
        if x.shape[0] == 0:
            return x.new_empty(0, self.w2.shape[1])
        out = moe_swiglu(x, expert_input.num_tokens_per_expert_list, self.w13, self.w2)  # decode-sized
        if out is not None:
            return out
        if _grouped_mm_ok(x):
            offs = expert_input.num_tokens_per_expert.cumsum(0).to(device=x.device, dtype=torch.int32)
            gate, up = torch._grouped_mm(x, self.w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)
        out = torch.empty(x.shape[0], self.w2.shape[1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(expert_input.num_tokens_per_expert_list):
            if n:
                rows = x[start : start + n]
                gate, up = F.linear(rows, self.w13[e]).chunk(2, dim=-1)
                out[start : start + n] = F.linear(F.silu(gate) * up, self.w2[e])
                start += n
        return out
