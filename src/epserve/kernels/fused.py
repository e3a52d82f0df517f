"""Front ends of a decode step's small fused ops, with their torch references: RMSNorm, rotary
embedding of each head's last columns, MLA's latent KV append (norm, rotary, write) and MLA's
absorbed per-head projections.

On the CPU in eager steps each is one C call (``kernels.cpu``, ``cpu_ops.c``) in place of a chain of
small torch ops; in a trace (``torch.compile`` fuses the references itself), on CUDA, for dtypes or
shapes the kernels do not take, or without the library, the torch reference runs. The C kernels round
as the references' bf16 ops do, so the two differ at most by the order of a sum (a norm's mean).
"""

from __future__ import annotations

import torch

from epserve.kernels import cpu
from epserve.kernels.device import tracing


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]: normalised in fp32, scaled in x's dtype (the torch reference)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (``rms_norm_ref``): one C call for a few bf16/fp32 rows on the CPU."""
    out = None if tracing() else cpu.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps) if out is None else out


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding of x [T, ..., 2 * half] by cos/sin [T, half]: pairs ``(x0, x1), (x2, x3), ...`` when
    ``interleave`` (DeepSeek's layout), else the halves; the output de-interleaved ``[evens', odds']``."""
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[-1]]
    cos, sin = cos.view(shape), sin.view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, rope_dim: int) -> torch.Tensor:
    """q [T, h, D] with the last ``rope_dim`` columns of each head rotated (``rope_ref``); the C kernel
    rotates a contiguous ``q`` in place and returns it."""
    if rope_dim == 2 * cos.shape[-1] and not tracing() and cpu.rope_heads(q, cos, sin, interleave):
        return q
    nope, pe = q.split([q.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([nope, rope_ref(pe, cos, sin, interleave)], dim=-1)


def append_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool, slots: torch.Tensor, flat_cache: torch.Tensor, kv_lora_rank: int) -> None:
    """MLA's latent KV append: each row of ``latent`` [T, r + rope] (``c_kv`` then ``k_pe``, as projected)
    becomes ``[RMSNorm(c_kv) | rope(k_pe)]``, written in the cache's dtype (bf16/fp32) to the rows
    ``slots`` [T] of ``flat_cache`` [rows, r + rope]."""
    if not tracing() and cpu.append_latent(latent, norm_weight, eps, cos, sin, interleave, slots, flat_cache,
                                           kv_lora_rank):
        return
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    rows = torch.cat([rms_norm(c_kv, norm_weight, eps), rope_ref(k_pe, cos, sin, interleave)], dim=-1)
    flat_cache.index_copy_(0, slots, rows.to(flat_cache.dtype))


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, h, K] times each head's weight w [h, K, N] -> [B, h, N] in w's dtype (MLA's absorbed
    projections): one C call for fp32 weights on the CPU, ``torch.bmm`` otherwise."""
    out = None if tracing() else cpu.head_matmul(x, w)
    return torch.bmm(x.to(w.dtype).transpose(0, 1), w).transpose(0, 1) if out is None else out
