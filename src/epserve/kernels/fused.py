"""Front ends of a decode step's small fused ops, with their torch references: RMSNorm, rotary
embedding of each head's last columns, MLA's latent KV append (norm, rotary, write) and MLA's
absorbed per-head projections; and the step's remaining small ops (row gathers, copies and casts,
residual adds, SwiGLU's activation), so that a CPU step is C kernel calls only and can be recorded
(``kernels/cpu_graph.py``).

On the CPU in eager steps each is one C call (``kernels.cpu_ops``, ``cpu_ops.c``) in place of a chain of
small torch ops; in a CPU trace (``torch.compile`` fuses the references itself), for dtypes or shapes the
kernels do not take, with gradients, or without the library, the torch reference runs. On CUDA the norm,
the rotary embedding and the latent append are the same fusions in Triton (``kernels.fused_triton``,
imported only then, so the CPU engine never loads triton; no host syncs, so CUDA graphs capture them),
through the custom ops ``epserve::rms_norm``, ``rope_heads`` and ``append_latent`` of ``kernels/ops.py``
when traced; the per-head projections stay ``torch.bmm``. Both kernels round as the references' bf16 ops
do, so kernel and reference differ at most by the order of a sum (a norm's mean).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from epserve.kernels import cpu_ops
from epserve.kernels.device import is_cuda, tracing

_FLOATS = (torch.bfloat16, torch.float32)  # what the Triton kernels take
_MAX_TILE = 1 << 15  # the widest row (a norm's) the Triton kernels hold as one tile


def _triton() -> ModuleType:
    from epserve.kernels import fused_triton  # lazy: importing triton costs the CPU engine for nothing

    return fused_triton


def _grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records these (the training model shares RMSNorm): then the reference runs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _promoted(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _rope_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int) -> bool:
    half = cos.shape[-1] if cos.dim() == 2 else -1
    return (x.dtype in _FLOATS and cos.dtype in _FLOATS and sin.dtype in _FLOATS
            and tuple(cos.shape) == tuple(sin.shape) == (rows, half) and 0 < half <= _MAX_TILE)


def _triton_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton RMSNorm takes these CUDA tensors (else the reference runs)."""
    d = x.shape[-1] if x.dim() else 0
    return (x.dtype in _FLOATS and weight.dtype in _FLOATS and tuple(weight.shape) == (d,) and 0 < d <= _MAX_TILE
            and not _grad(x, weight))


def _triton_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> bool:
    """... the Triton rotary embedding: q [T, h, D] contiguous, rotated in the promoted dtype, which is q's."""
    return (q.dim() == 3 and q.is_contiguous() and _rope_takes(q, cos, sin, q.shape[0])
            and rope_dim == 2 * cos.shape[-1] <= q.shape[2] and _promoted(q, cos, sin) == q.dtype
            and not _grad(q, cos, sin))


def _triton_append(latent: torch.Tensor, norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, flat_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """... the Triton latent append: last dims contiguous, int32/int64 slots [T], a bf16/fp32 cache."""
    t = latent.shape[0] if latent.dim() == 2 else -1
    return (t >= 0 and _rope_takes(latent, cos, sin, t) and norm_weight.dtype in _FLOATS
            and tuple(norm_weight.shape) == (kv_lora_rank,) and 0 < kv_lora_rank <= _MAX_TILE
            and latent.shape[1] == kv_lora_rank + 2 * cos.shape[-1] and flat_cache.dtype in _FLOATS
            and flat_cache.dim() == 2 and flat_cache.shape[1] == latent.shape[1] and flat_cache.stride(1) == 1
            and (t == 0 or latent.stride(1) == 1) and tuple(slots.shape) == (t,)
            and slots.dtype in (torch.int32, torch.int64) and not _grad(latent, norm_weight, cos, sin))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> [..., D]: normalised in fp32, scaled in x's dtype (the torch reference)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (``rms_norm_ref``): one C call for a few bf16/fp32 rows on the CPU, Triton on CUDA."""
    if is_cuda(x) and _triton_norm(x, weight):
        return torch.ops.epserve.rms_norm(x, weight, eps) if tracing() else _triton().rms_norm_triton(x, weight, eps)
    out = None if tracing() else cpu_ops.rms_norm(x, weight, eps)
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
    rotates a contiguous ``q`` in place and returns it, as the Triton kernel does on CUDA (traced: its
    custom op, out of place)."""
    if is_cuda(q) and _triton_rope(q, cos, sin, rope_dim):
        if tracing():
            return torch.ops.epserve.rope_heads(q, cos, sin, interleave, rope_dim)
        return _triton().rope_heads_triton(q, cos, sin, interleave, rope_dim)
    if rope_dim == 2 * cos.shape[-1] and not tracing() and cpu_ops.rope_heads(q, cos, sin, interleave):
        return q
    nope, pe = q.split([q.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([nope, rope_ref(pe, cos, sin, interleave)], dim=-1)


def append_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool, slots: torch.Tensor, flat_cache: torch.Tensor, kv_lora_rank: int) -> None:
    """MLA's latent KV append: each row of ``latent`` [T, r + rope] (``c_kv`` then ``k_pe``, as projected)
    becomes ``[RMSNorm(c_kv) | rope(k_pe)]``, written in the cache's dtype (bf16/fp32) to the rows
    ``slots`` [T] of ``flat_cache`` [rows, r + rope]. On CUDA one Triton kernel (its custom op when
    traced), which reads the slots on the device: a slot outside the cache is skipped, not raised."""
    if is_cuda(latent) and _triton_append(latent, norm_weight, cos, sin, slots, flat_cache, kv_lora_rank):
        fn = torch.ops.epserve.append_latent if tracing() else _triton().append_latent_triton
        fn(latent, norm_weight, eps, cos, sin, interleave, slots, flat_cache, kv_lora_rank)
        return
    if not tracing() and cpu_ops.append_latent(latent, norm_weight, eps, cos, sin, interleave, slots, flat_cache,
                                           kv_lora_rank):
        return
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    rows = torch.cat([rms_norm(c_kv, norm_weight, eps), rope_ref(k_pe, cos, sin, interleave)], dim=-1)
    flat_cache.index_copy_(0, slots, rows.to(flat_cache.dtype))


def head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, h, K] times each head's weight w [h, K, N] -> [B, h, N] in w's dtype (MLA's absorbed
    projections), or written into ``out`` [B, h, N] (rounded once to its dtype) and returned: one C call
    for fp32 weights on the CPU, ``torch.bmm`` otherwise."""
    fused = None if tracing() else cpu_ops.head_matmul(x, w, out)
    if fused is not None:
        return fused
    y = torch.bmm(x.to(w.dtype).transpose(0, 1), w).transpose(0, 1)
    if out is None:
        return y
    out.copy_(y)
    return out


def gather_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``table[ids]`` [N, D] in ``dtype`` (default the table's): the embedding lookup and the rotary rows of
    a step's positions; one C call on the CPU."""
    dtype = dtype or table.dtype
    out = None if tracing() else cpu_ops.gather_rows(table, ids, dtype)
    return F.embedding(ids, table).to(dtype) if out is None else out


def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` (a cast between bf16 and fp32 included): one C call on the CPU."""
    if tracing() or not cpu_ops.copy_cast(dst, src):
        dst.copy_(src)
    return dst


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``: ``x`` itself in that dtype already, else a C copy on the CPU."""
    if x.dtype == dtype:
        return x
    return copy_(torch.empty(x.shape, dtype=dtype, device=x.device), x)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` (a residual add): one C call on the CPU for two bf16/fp32 tensors of one shape."""
    out = None if tracing() else cpu_ops.add(a, b)
    return a + b if out is None else out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of ``x`` [T, 2I] = [gate | up]: ``F.silu(gate) * up`` [T, I], rounded as those
    two ops round; one C call on the CPU."""
    out = None if tracing() else cpu_ops.silu_mul(x)
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
