"""Front ends of ``cpu_ops*.c``, the small fused ops of a CPU decode step (the library ``kernels.cpu`` builds
and loads as ``OPS``): paged MLA decode, the grouped top-k gate, RMSNorm, rotary embedding, MLA's latent
append and per-head projections, the dispatchers' grouping and weighted combine, and the rest of a step
(the embedding and rotary rows, copies and casts, residual adds, SwiGLU's activation, the local dispatch,
the load counters) so that a whole decode step can run as C kernel calls (``kernels/cpu_graph.py``), and
the replay of such a recorded step. The row-wise ops also take a prefill's rows, on every OpenMP thread
(``PARALLEL_MIN`` in ``cpu_ops.h``; the same bits as one thread). Each is a plain implementation of a kernel
op (``kernels.opdef``, which never calls one in a trace): it returns None (or False) where it does not apply,
and the op runs its torch reference; results equal the references up to the order of a sum unless said
otherwise.
"""

from __future__ import annotations

import ctypes

import torch

from epserve.kernels import cpu_threads
from epserve.kernels.cpu import OPS, TILE_M, _lib, _library, available

_METHODS = {"noaux_tc": 0, "group_limited_greedy": 1}  # greedy: never grouped


def _ops(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, unless ``tensors`` need gradients (the training model shares RMSNorm: then the op's
    reference runs)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return _lib(OPS) if available(OPS) else None


def mla_decode(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               softmax_scale: float, kv_lora_rank: int) -> torch.Tensor | None:
    """Paged MLA decode for fp32 queries over a bf16 or fp32 cache -> o_latent [B, h, r] fp32; None where it
    does not apply (an FP8 cache, CUDA). The kernel reads ``seq_lens`` itself (never the host):
    a length past its block table raises ValueError, a block outside the cache IndexError."""
    if (q_latent.device.type != "cpu" or kv_cache.dtype not in (torch.bfloat16, torch.float32)
            or q_latent.shape[-1] % 8 or kv_lora_rank % 8):  # the kernel takes eight columns at a time
        return None
    lib = _ops()
    if lib is None or not kv_cache.is_contiguous() or q_latent.requires_grad:
        return None
    b, h, d = q_latent.shape
    q = q_latent.float().contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty(b, h, kv_lora_rank, dtype=torch.float32)
    code = lib.epserve_mla_decode(q.data_ptr(), b, h, d, kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16),
                                  kv_cache.shape[0], kv_cache.shape[1], tables.data_ptr(), tables.shape[1],
                                  lens.data_ptr(), softmax_scale, kv_lora_rank, out.data_ptr(), cpu_threads.threads())
    if code == -2:
        raise ValueError(f"seq_lens {seq_lens.tolist()} must lie in [0, {block_tables.shape[1] * kv_cache.shape[1]}] "
                         f"(block_tables {tuple(block_tables.shape)}, block_size {kv_cache.shape[1]})")
    if code:
        raise IndexError(f"a block of block_tables lies outside the cache's {kv_cache.shape[0]} blocks")
    return out


def grouped_topk(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, method: str, scoring: str,
                 norm_topk_prob: bool, routed_scaling_factor: float, bias: torch.Tensor | None,
                 logical_to_physical: torch.Tensor | None, grouped: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``kernels.gate``'s checked arguments -> (ids int64 [T, K], weights fp32 [T, K]), or None."""
    if logits.device.type != "cpu":
        return None
    lib = _ops()
    if lib is None:
        return None
    x = logits.float().contiguous()
    t, e = x.shape
    b = bias.float().contiguous() if bias is not None else None
    table = logical_to_physical
    if table is not None and (table.dtype != torch.int64 or table.dim() != 1):
        table = table.to(torch.int64).reshape(-1)
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    lib.epserve_grouped_topk(x.data_ptr(), t, e, top_k, n_group, topk_group, _METHODS.get(method, 0),
                             int(scoring == "softmax"), int(grouped), int(norm_topk_prob), routed_scaling_factor,
                             None if b is None else b.data_ptr(), None if table is None else table.data_ptr(),
                             0 if table is None else table.stride(0), ids.data_ptr(), weights.data_ptr())
    return ids, weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``kernels.rms_norm_ref`` for bf16 or fp32 rows (rows may be strided, as a split's view is), or None."""
    d = x.shape[-1]
    if (x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype
            or weight.shape != (d,) or not weight.is_contiguous()):
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, d)
    if rows.shape[0] and rows.stride(1) != 1:
        return None
    lib = _ops(x, weight)
    if lib is None:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    lib.epserve_rms_norm(rows.data_ptr(), weight.data_ptr(), rows.shape[0], d, rows.stride(0) if rows.shape[0] else d,
                         eps, int(x.dtype == torch.bfloat16), out.data_ptr())
    return out.view(x.shape)


def head_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [B, h, K] (bf16 or fp32, the last dim contiguous) times each head's fp32 weight w [h, K, N] ->
    fp32 [B, h, N] (MLA's absorbed projections), or written into ``out`` [B, h, N] (bf16 or fp32, the last
    dim contiguous: the fp32 sums rounded once) and returned; or None (nothing written)."""
    if (x.device.type != "cpu" or x.dtype not in _FLOATS or w.dtype != torch.float32
            or x.dim() != 3 or w.dim() != 3 or x.shape[1:] != w.shape[:2] or not w.is_contiguous()
            or (x.numel() and x.stride(2) != 1) or x.shape[0] > TILE_M):
        return None
    b, h, k = x.shape
    if out is None:
        out = torch.empty(b, h, w.shape[2], dtype=torch.float32)
    elif (out.dtype not in _FLOATS or out.shape != (b, h, w.shape[2]) or (out.numel() and out.stride(2) != 1)
          or out.device.type != "cpu"):
        return None
    lib = _ops(x, w)
    if lib is None:
        return None
    lib.epserve_head_matmul(x.data_ptr(), int(x.dtype == torch.bfloat16), b, h, k, x.stride(0), x.stride(1),
                            w.data_ptr(), w.shape[2], out.data_ptr(), out.stride(0), out.stride(1),
                            int(out.dtype == torch.bfloat16), cpu_threads.threads())
    return out


_FLOATS = (torch.bfloat16, torch.float32)
_MAX_ROPE = 512  # the C buffers' size


def _rope_ok(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int) -> bool:
    half = cos.shape[-1] if cos.dim() == 2 else -1
    return (x.dtype in _FLOATS and cos.dtype == sin.dtype == x.dtype and cos.shape == sin.shape == (rows, half)
            and cos.is_contiguous() and sin.is_contiguous() and 0 < 2 * half <= _MAX_ROPE)


def rope_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> bool:
    """Rotates the last ``2 * half`` columns of each head of ``x`` [T, h, D] (contiguous) in place, with
    cos/sin [T, half] in x's dtype; False (nothing done) where the kernel does not apply."""
    if (x.device.type != "cpu" or x.dim() != 3 or not x.is_contiguous() or not _rope_ok(x, cos, sin, x.shape[0])
            or 2 * cos.shape[1] > x.shape[2]):
        return False
    lib = _ops(x)
    if lib is None:
        return False
    t, h, d = x.shape
    lib.epserve_rope_heads(x.data_ptr(), t, h, d, cos.data_ptr(), sin.data_ptr(), cos.shape[1], int(interleave),
                           int(x.dtype == torch.bfloat16))
    return True


def append_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool, slots: torch.Tensor, cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """MLA's latent append: rows ``[RMSNorm(c_kv) | rope(k_pe)]`` of ``latent`` [T, r + rope] (rows may be
    strided) written to the flat cache rows ``slots``; False (nothing written) where it does not apply."""
    t = latent.shape[0] if latent.dim() == 2 else -1
    if (latent.device.type != "cpu" or t < 0 or cache.dtype not in _FLOATS or not cache.is_contiguous()
            or norm_weight.dtype != latent.dtype or norm_weight.shape != (kv_lora_rank,)
            or not _rope_ok(latent, cos, sin, t) or latent.shape[1] != kv_lora_rank + 2 * cos.shape[1]
            or cache.shape[-1] != latent.shape[1] or (t and latent.stride(1) != 1) or slots.shape != (t,)):
        return False
    lib = _ops(latent)
    if lib is None:
        return False
    slots = slots.to(torch.int64).contiguous()
    rows = cache.numel() // cache.shape[-1]
    if lib.epserve_append_latent(latent.data_ptr(), t, latent.stride(0) if t else 0, kv_lora_rank, cos.shape[1],
                                 norm_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), int(interleave),
                                 int(latent.dtype == torch.bfloat16), slots.data_ptr(), cache.data_ptr(), rows,
                                 int(cache.dtype == torch.bfloat16)):
        raise IndexError(f"a KV slot of {slots.tolist()} lies outside the cache's {rows} rows")
    return True


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(order [T*K], counts [num_experts]) as ``moe.dispatch.local.group_by_expert`` returns them (a stable
    counting sort), or None (an id out of range included: the reference raises)."""
    if topk_ids.device.type != "cpu" or topk_ids.is_floating_point():
        return None
    lib = _ops()
    if lib is None:
        return None
    flat = topk_ids.reshape(-1).to(torch.int64).contiguous()
    order = torch.empty(flat.shape[0], dtype=torch.int64)
    counts = torch.empty(num_experts, dtype=torch.int64)
    if lib.epserve_group_by_expert(flat.data_ptr(), flat.shape[0], num_experts, order.data_ptr(), counts.data_ptr()):
        return None
    return order, counts


def weighted_combine(y: torch.Tensor, token_idx: torch.Tensor, weights: torch.Tensor,
                     num_tokens: int) -> torch.Tensor | None:
    """``moe.dispatch.base.weighted_combine`` bit for bit (index_add_'s order and roundings), or None."""
    if (y.device.type != "cpu" or y.dtype not in _FLOATS or y.dim() != 2 or not y.is_contiguous()
            or weights.dtype != torch.float32 or token_idx.shape != (y.shape[0],) or weights.shape != (y.shape[0],)):
        return None
    lib = _ops(y)
    if lib is None:
        return None
    token = token_idx.to(torch.int64).contiguous()
    w = weights.contiguous()
    out = torch.empty(num_tokens, y.shape[1], dtype=y.dtype)
    if lib.epserve_weighted_combine(y.data_ptr(), y.shape[0], y.shape[1], token.data_ptr(), w.data_ptr(), num_tokens,
                                    int(y.dtype == torch.bfloat16), out.data_ptr()):
        return None
    return out


# ---- the rest of a decode step (a step recorded whole runs only these: kernels/cpu_graph.py) -----------


def _bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``table[ids].to(dtype)`` for a 2-D bf16/fp32 table and int64 ids [N] (the embedding lookup, the
    rotary rows of the step's positions), or None. An id outside the table raises IndexError."""
    if (table.device.type != "cpu" or ids.device.type != "cpu" or table.dim() != 2 or table.dtype not in _FLOATS
            or dtype not in _FLOATS or not table.is_contiguous() or ids.dim() != 1 or ids.dtype != torch.int64
            or not ids.is_contiguous()):
        return None
    lib = _ops(table)
    if lib is None:
        return None
    out = torch.empty(ids.shape[0], table.shape[1], dtype=dtype)
    if lib.epserve_gather_rows(ids.data_ptr(), ids.shape[0], table.data_ptr(), table.shape[0], table.shape[1],
                               _bf16(table), out.data_ptr(), int(dtype == torch.bfloat16)):
        raise IndexError(f"an index of {ids.tolist()} lies outside the table's {table.shape[0]} rows")
    return out


def copy_cast(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)`` for bf16/fp32 tensors of one shape, up to 3-D, the last dims contiguous; False
    (nothing done) where it does not apply."""
    if (dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype not in _FLOATS or src.dtype not in _FLOATS
            or dst.shape != src.shape or not 1 <= dst.dim() <= 3 or (dst.numel() and (dst.stride(-1) != 1
                                                                                      or src.stride(-1) != 1))):
        return False
    lib = _ops(src)
    if lib is None:
        return False
    d3, s3 = dst.view((1,) * (3 - dst.dim()) + tuple(dst.shape)), src.view((1,) * (3 - src.dim()) + tuple(src.shape))
    n0, n1, cols = d3.shape
    lib.epserve_copy_cast(s3.data_ptr(), _bf16(src), n0, n1, cols, s3.stride(0), s3.stride(1), d3.data_ptr(),
                          _bf16(dst), d3.stride(0), d3.stride(1))
    return True


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """``a + b`` for contiguous bf16/fp32 tensors of one shape and dtype (a residual add), or None."""
    if (a.device.type != "cpu" or a.dtype not in _FLOATS or b.dtype != a.dtype or a.shape != b.shape
            or b.device.type != "cpu" or not a.is_contiguous() or not b.is_contiguous()):
        return None
    lib = _ops(a, b)
    if lib is None:
        return None
    out = torch.empty(a.shape, dtype=a.dtype)
    lib.epserve_add(a.data_ptr(), b.data_ptr(), a.numel(), _bf16(a), out.data_ptr())
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``F.silu(gate) * up`` of ``x`` [T, 2I] = [gate | up] (bf16/fp32, rows may be strided) -> [T, I], or None."""
    if (x.device.type != "cpu" or x.dtype not in _FLOATS or x.dim() != 2 or x.shape[1] % 2
            or (x.numel() and x.stride(1) != 1)):
        return None
    lib = _ops(x)
    if lib is None:
        return None
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, inter, dtype=x.dtype)
    lib.epserve_silu_mul(x.data_ptr(), t, inter, x.stride(0) if t else 2 * inter, _bf16(x), out.data_ptr())
    return out


def local_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The local dispatcher's permutation of x [T, H] by topk_ids [T, K] (int64) -> (rows [T*K, H] grouped by
    expert in stable order, counts [num_experts], each row's token [T*K] and weight [T*K] of
    ``topk_weights`` (fp32)), as ``moe.dispatch.local`` computes them with torch; or None (an id out of
    range included: the reference raises)."""
    if (x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous() or topk_ids.dtype != torch.int64
            or not topk_ids.is_contiguous() or topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous()
            or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape):
        return None
    lib = _ops(x)
    if lib is None:
        return None
    t, k = topk_ids.shape
    rows = torch.empty(t * k, x.shape[1], dtype=x.dtype)
    counts = torch.empty(num_experts, dtype=torch.int64)
    token_idx = torch.empty(t * k, dtype=torch.int64)
    weights = torch.empty(t * k, dtype=torch.float32)
    if lib.epserve_local_dispatch(x.data_ptr(), t, x.shape[1], x.element_size(), topk_ids.data_ptr(), k,
                                  topk_weights.data_ptr(), num_experts, rows.data_ptr(), counts.data_ptr(),
                                  token_idx.data_ptr(), weights.data_ptr()):
        return None
    return rows, counts, token_idx, weights


def index_add_counts(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.index_add_(0, index, src)`` for 1-D int64 tensors (the experts' load counters); False (nothing
    done) where it does not apply or an index is out of range (the reference then raises)."""
    if (dst.device.type != "cpu" or any(t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous()
                                        for t in (dst, index, src)) or index.shape != src.shape):
        return False
    lib = _ops()
    if lib is None:
        return False
    return not lib.epserve_index_add_i64(dst.data_ptr(), dst.shape[0], index.data_ptr(), src.data_ptr(),
                                         src.shape[0])


def replay(calls: tuple[ctypes.Array, ctypes.Array, int], seconds: ctypes.Array | None = None) -> tuple[int, int]:
    """Runs a recorded sequence of packed kernel calls (their addresses, their argument arrays' addresses,
    how many), each call's wall time added to ``seconds`` (doubles, one per call) when given: (-1, 0) when
    all ran, else the index of the first call that refused its inputs and its code."""
    lib = _library(OPS)
    assert lib is not None
    fns, args, n = calls
    rc = ctypes.c_int(0)
    failed = lib.epserve_replay(ctypes.addressof(fns), ctypes.addressof(args), n, ctypes.addressof(rc),
                                None if seconds is None else ctypes.addressof(seconds))
    return int(failed), int(rc.value)
