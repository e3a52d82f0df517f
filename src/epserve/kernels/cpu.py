"""CPU decode kernels, compiled with the system C compiler on first use: bf16 (``cpu_bf16.c``,
AVX512-BF16) and fp32 (``cpu_f32.c``, AVX2 + FMA). Both stream each weight once for up to ``TILE_M``
token rows, so a decode step with a few rows per request (speculative verification) costs about what
one row does; BLAS's small-M GEMM does not stream (two fp32 rows cost about twice one on AVX2).

``linear(x, w)`` and ``moe_swiglu(x, counts, w13, w2)`` take the kernel path only for bf16 or fp32 CPU
tensors with few rows (decode), and fall back to torch otherwise, or when the CPU lacks the
instructions, no C compiler is found, or ``EPSERVE_CPU_KERNELS=0``. Results match torch's path up to
summation order.

``cpu_ops.c`` (AVX2 + FMA) holds the small ops of a decode step fused, each in place of a chain of
eager torch ops that costs more in dispatch than in arithmetic: ``mla_decode`` (paged MLA decode
attention), ``grouped_topk`` (DeepSeek's gate) and ``rms_norm``. They return None where they do not
apply (the caller then runs its torch reference); their front ends (``kernels.mla_decode``,
``kernels.gate``, ``kernels.rms_norm``) use them on the CPU in eager steps, never in a trace.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from epserve import env
from epserve.kernels.device import tracing

logger = logging.getLogger(__name__)

TILE_M = 16  # rows per weight pass; must match the C sources
_SOURCE = Path(__file__).with_name("cpu_bf16.c")
_SOURCE_F32 = Path(__file__).with_name("cpu_f32.c")
_SOURCE_OPS = Path(__file__).with_name("cpu_ops.c")
_HEADER = Path(__file__).with_name("cpu_bf16.h")  # included by the sources: part of every build's tag
OPS = "ops"  # the library of fused small ops (any dtype)
# per element type (or OPS): the source, the compiler flags, the CPU flags it needs, its kernels' names
_KINDS: dict[torch.dtype | str, tuple[str, list[str], tuple[str, ...], str]] = {
    torch.bfloat16: ("_SOURCE", ["-mavx512f", "-mavx512bf16"], ("avx512f", "avx512_bf16"), "bf16"),
    torch.float32: ("_SOURCE_F32", ["-mavx2", "-mfma"], ("avx2", "fma"), "f32"),
    OPS: ("_SOURCE_OPS", ["-mavx2", "-mfma", "-ffp-contract=off"], ("avx2", "fma"), "ops"),  # torch's roundings
}


def _cpu_has(*flags: str) -> bool:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(f in words for f in flags)


def _cpu_has_avx512_bf16() -> bool:
    return _cpu_has("avx512f", "avx512_bf16")


def _build(cc: str, lib_path: Path, source: Path, flags: list[str]) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        tmp_lib = Path(tmp) / lib_path.name
        cmd = [cc, "-O3", *flags, "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(tmp_lib), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=proc.stderr)
        os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file


@cache
def _library(dtype: torch.dtype | str = torch.bfloat16) -> ctypes.CDLL | None:
    source_attr, cflags, cpu_flags, name = _KINDS[dtype]
    if not env.cpu_kernels_enabled() or not _cpu_has(*cpu_flags):
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    source_path: Path = globals()[source_attr]
    tag = hashlib.sha256(source_path.read_bytes() + _HEADER.read_bytes()).hexdigest()[:16]
    lib_path = env.cache_dir() / "kernels" / f"cpu_{name}-{tag}.so"
    try:
        if not lib_path.exists():
            _build(cc, lib_path, source_path, cflags)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("CPU %s kernels unavailable (%s); using torch", name, detail.strip()[:200])
        return None
    p, i64, c_int, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    if dtype == OPS:
        lib.epserve_mla_decode.argtypes = [p, i64, i64, i64, p, c_int, i64, i64, p, i64, p, f32, i64, p, c_int]
        lib.epserve_mla_decode.restype = c_int
        lib.epserve_grouped_topk.argtypes = [p, i64, i64, i64, i64, i64, c_int, c_int, c_int, c_int, f32, p, p, p, p]
        lib.epserve_rms_norm.argtypes = [p, p, i64, i64, i64, f32, c_int, p]
        lib.epserve_head_matmul.argtypes = [p, c_int, i64, i64, i64, i64, i64, p, i64, p, c_int]
        lib.epserve_rope_heads.argtypes = [p, i64, i64, i64, p, p, i64, c_int, c_int]
        lib.epserve_append_latent.argtypes = [p, i64, i64, i64, i64, p, f32, p, p, c_int, c_int, p, p, i64, c_int]
        lib.epserve_append_latent.restype = c_int
        lib.epserve_group_by_expert.argtypes = [p, i64, i64, p, p]
        lib.epserve_group_by_expert.restype = c_int
        lib.epserve_weighted_combine.argtypes = [p, i64, i64, p, p, i64, c_int, p]
        lib.epserve_weighted_combine.restype = c_int
    else:
        getattr(lib, f"epserve_linear_{name}").argtypes = [p, i64, p, i64, i64, p, c_int]
        getattr(lib, f"epserve_moe_swiglu_{name}").argtypes = [p, p, i64, p, p, i64, i64, p, c_int]
    logger.info("CPU %s decode kernels loaded from %s", name, lib_path)
    return lib


_available: dict[torch.dtype | str, bool] = {}  # available()'s answers, once asked: constants to torch.compile


def available(dtype: torch.dtype | str = torch.bfloat16) -> bool:
    """Whether the ``dtype`` kernels load here (built on first ask). Ask once before compiling a forward
    that may call them (``engine/graphs.py`` does), so torch.compile reads a constant instead of tracing
    the build."""
    if dtype not in _available:
        _available[dtype] = dtype in _KINDS and _library(dtype) is not None
    return _available[dtype]


def _eligible(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in _KINDS and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T; the kernel streams ``w`` once when M <= TILE_M."""
    if x.dim() == 2 and 0 < x.shape[0] <= TILE_M and x.shape[1] % 32 == 0 and _eligible(x, w) and available(x.dtype):
        return linear_kernel(x, w) if tracing() else _linear_kernel(x, w)
    return F.linear(x, w)


def _linear_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The decode GEMM of ``x``'s dtype, bf16 or fp32 (as a custom op below: one opaque call to
    ``torch.compile``)."""
    lib = _library(x.dtype)
    assert lib is not None, f"the CPU {x.dtype} kernels are not available (kernels.cpu.available)"
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    kernel = lib.epserve_linear_f32 if x.dtype == torch.float32 else lib.epserve_linear_bf16
    kernel(x.data_ptr(), x.shape[0], w.data_ptr(), w.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


linear_kernel = torch.library.custom_op("epserve::cpu_linear", _linear_kernel, mutates_args=())


@linear_kernel.register_fake
def _(x, w):  # noqa: ANN001
    return x.new_empty(x.shape[0], w.shape[0])


def moe_swiglu(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor | None:
    """Experts on rows grouped by expert. The kernel takes every expert with at most TILE_M rows;
    the few larger ones (skewed routing) run through torch here. Returns None when the kernel does not
    apply or most of the work is large groups (prefill), for which the caller's grouped GEMM is best."""
    hidden, inter = w2.shape[1], w2.shape[2]
    if not counts or hidden % 32 or inter % 32 or not _eligible(x, w13, w2):
        return None
    big = [e for e, n in enumerate(counts) if n > TILE_M]
    if sum(counts[e] for e in big) * 2 > len(x):
        return None
    lib = _library(x.dtype)
    if lib is None:
        return None
    starts = list(itertools.accumulate(counts, initial=0))
    offsets = torch.tensor(starts, dtype=torch.int64)
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
    kernel = lib.epserve_moe_swiglu_f32 if x.dtype == torch.float32 else lib.epserve_moe_swiglu_bf16
    kernel(x.data_ptr(), offsets.data_ptr(), len(counts), w13.data_ptr(), w2.data_ptr(), hidden, inter,
           out.data_ptr(), torch.get_num_threads())
    for e in big:
        lo, hi = starts[e], starts[e + 1]
        gate, up = F.linear(x[lo:hi], w13[e]).chunk(2, dim=-1)
        out[lo:hi] = F.linear(F.silu(gate) * up, w2[e])
    return out


# ---- the fused small ops (cpu_ops.c) ------------------------------------------------------------------

_NORM_MAX_ROWS = 256  # past this (prefill) torch's threaded ops win over one C thread
_COMBINE_MAX_ELEMS = 1 << 20  # the same for the combine's expert-output elements
_METHODS = {"noaux_tc": 0, "group_limited_greedy": 1}  # greedy: never grouped


def _ops(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library, unless tracing or ``tensors`` need gradients (the training model shares RMSNorm)."""
    if tracing() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    return _library(OPS) if available(OPS) else None


def mla_decode(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, lens: list[int],
               softmax_scale: float, kv_lora_rank: int) -> torch.Tensor | None:
    """Paged MLA decode for fp32 queries over a bf16 or fp32 cache (``lens``: the checked sequence
    lengths) -> o_latent [B, h, r] fp32; None where it does not apply (an FP8 cache, CUDA, a trace)."""
    if (q_latent.device.type != "cpu" or kv_cache.dtype not in (torch.bfloat16, torch.float32)
            or q_latent.shape[-1] % 8 or kv_lora_rank % 8):  # the kernel takes eight columns at a time
        return None
    lib = _ops()
    if lib is None or not kv_cache.is_contiguous() or q_latent.requires_grad:
        return None
    b, h, d = q_latent.shape
    q = q_latent.float().contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens_t = torch.tensor(lens, dtype=torch.int64)
    out = torch.empty(b, h, kv_lora_rank, dtype=torch.float32)
    if lib.epserve_mla_decode(q.data_ptr(), b, h, d, kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16),
                              kv_cache.shape[0], kv_cache.shape[1], tables.data_ptr(), tables.shape[1], lens_t.data_ptr(),
                              softmax_scale, kv_lora_rank, out.data_ptr(), torch.get_num_threads()):
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
    table = logical_to_physical.to(torch.int64).contiguous() if logical_to_physical is not None else None
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    lib.epserve_grouped_topk(x.data_ptr(), t, e, top_k, n_group, topk_group, _METHODS.get(method, 0),
                             int(scoring == "softmax"), int(grouped), int(norm_topk_prob), routed_scaling_factor,
                             None if b is None else b.data_ptr(), None if table is None else table.data_ptr(),
                             ids.data_ptr(), weights.data_ptr())
    return ids, weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``kernels.rms_norm_ref`` for a few bf16 or fp32 rows (rows may be strided, as a split's view is),
    or None."""
    d = x.shape[-1]
    if (x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype
            or weight.shape != (d,) or not weight.is_contiguous()):
        return None
    rows = x if x.dim() == 2 else x.reshape(-1, d)
    if rows.shape[0] > _NORM_MAX_ROWS or (rows.shape[0] and rows.stride(1) != 1):
        return None
    lib = _ops(x, weight)
    if lib is None:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    lib.epserve_rms_norm(rows.data_ptr(), weight.data_ptr(), rows.shape[0], d, rows.stride(0) if rows.shape[0] else d,
                         eps, int(x.dtype == torch.bfloat16), out.data_ptr())
    return out.view(x.shape)


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [B, h, K] (bf16 or fp32, the last dim contiguous) times each head's fp32 weight w [h, K, N] ->
    fp32 [B, h, N] (MLA's absorbed projections), or None."""
    if (x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or w.dtype != torch.float32
            or x.dim() != 3 or w.dim() != 3 or x.shape[1:] != w.shape[:2] or not w.is_contiguous()
            or (x.numel() and x.stride(2) != 1) or x.shape[0] > TILE_M):
        return None
    lib = _ops(x, w)
    if lib is None:
        return None
    b, h, k = x.shape
    out = torch.empty(b, h, w.shape[2], dtype=torch.float32)
    lib.epserve_head_matmul(x.data_ptr(), int(x.dtype == torch.bfloat16), b, h, k, x.stride(0), x.stride(1),
                            w.data_ptr(), w.shape[2], out.data_ptr(), torch.get_num_threads())
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


def weighted_combine(y: torch.Tensor, token_idx: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor | None:
    """``moe.dispatch.base.weighted_combine`` bit for bit (index_add_'s order and roundings), or None."""
    if (y.device.type != "cpu" or y.dtype not in _FLOATS or y.dim() != 2 or not y.is_contiguous()
            or y.numel() > _COMBINE_MAX_ELEMS
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
