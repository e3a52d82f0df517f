"""A decode step's small fused ops, each declared once (``kernels.opdef``) with its torch reference: RMSNorm,
rotary embedding of each head's last columns, MLA's latent KV append (norm, rotary, write) and MLA's absorbed
per-head projections; and the step's remaining small ops (row gathers, copies and casts, residual adds,
SwiGLU's activation), so that a CPU step is C kernel calls only and can be recorded (``kernels/cpu_graph.py``).

On the CPU in eager steps each is one C call (``kernels.cpu_ops``, ``cpu_ops*.c``) in place of a chain of
small torch ops; in a CPU trace (``torch.compile`` fuses the references itself), for dtypes or shapes the
kernels do not take, with gradients, or without the library, the torch reference runs. On CUDA the norm,
the rotary embedding and the latent append are the same fusions in Triton (``kernels.fused_triton``,
imported only then, so the CPU engine never loads triton; no host syncs, so CUDA graphs capture them),
through the custom ops ``epserve::rms_norm``, ``rope_heads`` and ``append_latent`` when traced; the
per-head projections stay ``torch.bmm``. Both kernels round as the references' bf16 ops do, so kernel and
reference differ at most by the order of a sum (a norm's mean).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels import cpu_ops
from epserve.kernels.opdef import declare

_FLOATS = (torch.bfloat16, torch.float32)  # what the Triton kernels take
_MAX_TILE = 1 << 15  # the widest row (a norm's) the Triton kernels hold as one tile


_TRITON = "epserve.kernels.fused_triton"  # imported on CUDA only: importing triton costs the CPU engine for nothing


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


def _triton_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """Whether the Triton RMSNorm takes these CUDA tensors (else the reference runs)."""
    d = x.shape[-1] if x.dim() else 0
    return (x.dtype in _FLOATS and weight.dtype in _FLOATS and tuple(weight.shape) == (d,) and 0 < d <= _MAX_TILE
            and not _grad(x, weight))


def _triton_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, rope_dim: int) -> bool:
    """... the Triton rotary embedding: q [T, h, D] contiguous, rotated in the promoted dtype, which is q's."""
    return (q.dim() == 3 and q.is_contiguous() and _rope_takes(q, cos, sin, q.shape[0])
            and rope_dim == 2 * cos.shape[-1] <= q.shape[2] and _promoted(q, cos, sin) == q.dtype
            and not _grad(q, cos, sin))


def _triton_append(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   interleave: bool, slots: torch.Tensor, flat_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """... the Triton latent append: last dims contiguous, int32/int64 slots [T], a bf16/fp32 cache."""
    t = latent.shape[0] if latent.dim() == 2 else -1
    return (t >= 0 and _rope_takes(latent, cos, sin, t) and norm_weight.dtype in _FLOATS
            and tuple(norm_weight.shape) == (kv_lora_rank,) and 0 < kv_lora_rank <= _MAX_TILE
            and latent.shape[1] == kv_lora_rank + 2 * cos.shape[-1] and flat_cache.dtype in _FLOATS
            and flat_cache.dim() == 2 and flat_cache.shape[1] == latent.shape[1] and flat_cache.stride(1) == 1
            and (t == 0 or latent.stride(1) == 1) and tuple(slots.shape) == (t,)
            and slots.dtype in (torch.int32, torch.int64) and not _grad(latent, norm_weight, cos, sin))


def _promoted_like(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@declare("rms_norm", fake=_promoted_like)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [..., D] -> [..., D]: normalised in fp32, scaled in x's dtype. One C call for bf16/fp32
    rows on the CPU, Triton on CUDA."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


rms_norm.implement("cpu", "epserve.kernels.cpu_ops:rms_norm")
rms_norm.implement("cuda", f"{_TRITON}:rms_norm_triton", takes=_triton_norm, traced="op")
rms_norm_ref = rms_norm.reference


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


def _rope_out_of_place(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                       rope_dim: int) -> torch.Tensor:
    """The custom op's body: eager calls rotate q in place, the op returns a new tensor."""
    return rope_heads.eager(q.clone(memory_format=torch.contiguous_format), cos, sin, interleave, rope_dim)


@declare("rope_heads", fake=lambda q, cos, sin, interleave, rope_dim: q.new_empty(q.shape),
         custom_body=_rope_out_of_place)
def rope_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, rope_dim: int) -> torch.Tensor:
    """q [T, h, D] with the last ``rope_dim`` columns of each head rotated (``rope_ref``); the C kernel
    rotates a contiguous ``q`` in place and returns it, as the Triton kernel does on CUDA (traced: its
    custom op, out of place)."""
    nope, pe = q.split([q.shape[-1] - rope_dim, rope_dim], dim=-1)
    return torch.cat([nope, rope_ref(pe, cos, sin, interleave)], dim=-1)


def rope_heads_c(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                 rope_dim: int) -> torch.Tensor | None:
    """The C kernel (in place) where it takes the call, else None."""
    return q if rope_dim == 2 * cos.shape[-1] and cpu_ops.rope_heads(q, cos, sin, interleave) else None


rope_heads.implement("cpu", f"{__name__}:rope_heads_c")
rope_heads.implement("cuda", f"{_TRITON}:rope_heads_triton", takes=_triton_rope, traced="op")


@declare("append_latent", fake=lambda *args: None, mutates_args=("flat_cache",))
def append_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool, slots: torch.Tensor, flat_cache: torch.Tensor, kv_lora_rank: int) -> None:
    """MLA's latent KV append: each row of ``latent`` [T, r + rope] (``c_kv`` then ``k_pe``, as projected)
    becomes ``[RMSNorm(c_kv) | rope(k_pe)]``, written in the cache's dtype (bf16/fp32) to the rows
    ``slots`` [T] of ``flat_cache`` [rows, r + rope]. On CUDA one Triton kernel (its custom op when
    traced), which reads the slots on the device: a slot outside the cache is skipped, not raised."""
    c_kv, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    rows = torch.cat([rms_norm(c_kv, norm_weight, eps), rope_ref(k_pe, cos, sin, interleave)], dim=-1)
    flat_cache.index_copy_(0, slots, rows.to(flat_cache.dtype))


append_latent.implement("cpu", "epserve.kernels.cpu_ops:append_latent")
append_latent.implement("cuda", f"{_TRITON}:append_latent_triton", takes=_triton_append, traced="op")


@declare("head_matmul")
def head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, h, K] times each head's weight w [h, K, N] -> [B, h, N] in w's dtype (MLA's absorbed
    projections), or written into ``out`` [B, h, N] (rounded once to its dtype) and returned: one C call
    for fp32 weights on the CPU, ``torch.bmm`` otherwise."""
    y = torch.bmm(x.to(w.dtype).transpose(0, 1), w).transpose(0, 1)
    if out is None:
        return y
    out.copy_(y)
    return out


head_matmul.implement("cpu", "epserve.kernels.cpu_ops:head_matmul")


@declare("gather_rows")
def gather_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``table[ids]`` [N, D] in ``dtype`` (default the table's): the embedding lookup and the rotary rows of
    a step's positions; one C call on the CPU."""
    return F.embedding(ids, table).to(dtype or table.dtype)


def gather_rows_c(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor | None:
    return cpu_ops.gather_rows(table, ids, dtype or table.dtype)


gather_rows.implement("cpu", f"{__name__}:gather_rows_c")


@declare("copy_")
def copy_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` (a cast between bf16 and fp32 included): one C call on the CPU."""
    return dst.copy_(src)


def copy_c(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    return dst if cpu_ops.copy_cast(dst, src) else None


copy_.implement("cpu", f"{__name__}:copy_c")


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``: ``x`` itself in that dtype already, else a C copy on the CPU."""
    if x.dtype == dtype:
        return x
    return copy_(torch.empty(x.shape, dtype=dtype, device=x.device), x)


@declare("add")
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` (a residual add): one C call on the CPU for two bf16/fp32 tensors of one shape."""
    return a + b


add.implement("cpu", "epserve.kernels.cpu_ops:add")


@declare("silu_mul")
def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation of ``x`` [T, 2I] = [gate | up]: ``F.silu(gate) * up`` [T, I], rounded as those
    two ops round; one C call on the CPU."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


silu_mul.implement("cpu", "epserve.kernels.cpu_ops:silu_mul")
