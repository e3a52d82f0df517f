"""Paged MLA decode attention in absorbed form, reading the paged latent cache in place.

Decode queries ``q_latent [B, h, r + rope]`` (``W_UK`` already folded in, fp32) attend as multi-query
attention over the cached rows ``[c_kv (r) | k_pe (rope)]`` of their sequence: the key is the whole
row, the value its first ``r = kv_lora_rank`` columns. The cache is ``[num_blocks, block_size,
r + rope]`` in bf16/fp16/fp32, or float8_e4m3fn with a per-layer scalar ``kv_scale`` (stored = latent /
scale; read = stored * scale). Sequence ``i`` holds its ``seq_lens[i]`` tokens in the blocks
``block_tables[i, :cdiv(seq_lens[i], block_size)]``, in order; later table entries are never read.
Rows with ``seq_lens[i] == 0`` (padding of a padded batch) come out zero.

``paged_mla_decode`` is the op (declared once, ``kernels.opdef``; traced, always the custom op
``epserve::paged_mla_decode``; its table keyed by the cache dtype). On CUDA: FlashInfer where
``kernels.backends`` chose it for the cache dtype (``kernels.mla_flashinfer``); else, for calls with
``WIDE_MIN_HEADS`` heads or more (DeepSeek-V3 with DP attention: 128), the many-head Triton kernel that
reads each KV tile for 64 heads at once (``kernels.mla_decode_wide``, :func:`takes_wide`: a bf16, fp16 or
FP8 cache, a power-of-two ``r``); else the split-K Triton kernels (``kernels.mla_decode_triton``, 16 heads
a program). The choice reads shapes only; the Triton modules are imported only on CUDA, so the CPU engine
never loads triton. On the CPU the C kernel of ``kernels.cpu_ops`` for a bf16 or fp32 cache (one pass per
sequence and head, no gather); the torch reference ``paged_mla_decode_ref`` otherwise (an fp16 or FP8
cache). The reference walks the context a chunk of blocks at a time for all sequences still running,
gathering those blocks through the block table (dequantizing FP8 as read) and merging chunks with an
online softmax, so its memory stays bounded (about ``_CHUNK_ELEMS`` fp32 values) however long the
contexts are. It reads ``seq_lens`` on the host; the Triton kernels never do (no host sync, CUDA-graph
safe): their grids come from shapes only, and their context bound is ``block_tables.shape[1] *
block_size``. The kernels' precision contracts are in their modules.
"""

from __future__ import annotations

import torch

from epserve.kernels import cpu_ops
from epserve.kernels.fp8 import FP8_DTYPE, cdiv
from epserve.kernels.opdef import declare

CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)
BLOCK_H = 16  # heads per Triton program (the MMA's M; fewer heads are masked)
TARGET_PROGRAMS = 256  # split the context until B * head blocks * splits reaches about this (~2 waves)
MIN_SPLIT_TOKENS = 256  # ... but give each split at least this much of the longest possible context
MAX_SPLITS = 64
WIDE_MIN_HEADS = 64  # from this many heads on, CUDA runs the many-head kernel (kernels.mla_decode_wide)
WIDE_CACHE_DTYPES = (torch.bfloat16, torch.float16, FP8_DTYPE)
_CHUNK_ELEMS = 1 << 22  # the reference's working set per chunk: ~16 MiB of fp32


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_decode(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None,
) -> None:
    """Shapes, dtypes and devices only (nothing read from the device)."""
    if q_latent.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(
            f"paged MLA decode needs q_latent [B, h, r + rope] and kv_cache [blocks, block_size, r + rope], "
            f"got {_shape(q_latent)} and {_shape(kv_cache)}"
        )
    b, _, d = q_latent.shape
    if kv_cache.shape[2] != d or not 0 < kv_lora_rank < d:
        raise ValueError(
            f"q_latent {_shape(q_latent)} and kv_cache {_shape(kv_cache)} must share the last dim "
            f"r + rope with 0 < kv_lora_rank ({kv_lora_rank}) < it"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != b or _shape(seq_lens) != (b,):
        raise ValueError(
            f"block_tables {_shape(block_tables)} and seq_lens {_shape(seq_lens)} must be [{b}, max_blocks] "
            f"and [{b}] for q_latent {_shape(q_latent)}"
        )
    ints = (torch.int32, torch.int64)
    if block_tables.dtype not in ints or seq_lens.dtype not in ints:
        raise ValueError(
            f"block_tables and seq_lens must be int32/int64, got {block_tables.dtype} and {seq_lens.dtype}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype must be one of {CACHE_DTYPES}, got {kv_cache.dtype}")
    if kv_scale is not None and kv_scale.numel() != 1:
        raise ValueError(f"kv_scale must be a scalar tensor, got shape {_shape(kv_scale)}")
    tensors = (kv_cache, block_tables, seq_lens) + ((kv_scale,) if kv_scale is not None else ())
    if any(t.device != q_latent.device for t in tensors):
        devices = [str(t.device) for t in (q_latent, *tensors)]
        raise ValueError(f"all inputs must be on one device, got {devices}")


def default_num_splits(batch: int, num_heads: int, max_tokens: int, block_h: int = BLOCK_H,
                       target_programs: int = TARGET_PROGRAMS) -> int:
    """KV splits per (sequence, head block) for the Triton kernels, from shapes only: enough programs
    (``block_h`` heads each) to fill the GPU (``target_programs``), at least ``MIN_SPLIT_TOKENS`` of the
    longest possible context (``max_tokens``) per split, at most ``MAX_SPLITS``. Each sequence divides its
    own length into this many parts, so short sequences in a long batch get short splits."""
    programs = max(1, batch * cdiv(num_heads, block_h))
    return max(1, min(cdiv(target_programs, programs), max_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS))


# ---- torch reference ----------------------------------------------------------------------------


def _read_blocks(kv_cache: torch.Tensor, tables: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 copies of the cache blocks ``tables`` [A, n] -> [A, n, block_size, d], dequantized when FP8
    (gathered as bytes: index ops lack float8 kernels)."""
    if kv_cache.dtype != FP8_DTYPE:
        return kv_cache[tables].float()
    blocks = kv_cache.view(torch.uint8)[tables].view(FP8_DTYPE).float()
    return blocks if kv_scale is None else blocks * kv_scale.float()


def _host_lens(seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> list[int]:
    """``seq_lens`` read on the host, each checked to fit its block table."""
    lens = [int(n) for n in seq_lens.tolist()]
    if min(lens, default=0) < 0 or max(lens, default=0) > block_tables.shape[1] * block_size:
        raise ValueError(
            f"seq_lens {lens} must lie in [0, {block_tables.shape[1] * block_size}] "
            f"(block_tables {_shape(block_tables)}, block_size {block_size})"
        )
    return lens


def paged_mla_decode_ref(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    chunk_blocks: int | None = None,
) -> torch.Tensor:
    """o_latent [B, h, kv_lora_rank] fp32: softmax(q k^T * softmax_scale) v over each sequence's cached
    rows, ``chunk_blocks`` cache blocks at a time (default: ~``_CHUNK_ELEMS`` values per chunk)."""
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, kv_scale)
    lens = _host_lens(seq_lens, block_tables, kv_cache.shape[1])
    b, h, d = q_latent.shape
    block_size, r = kv_cache.shape[1], kv_lora_rank
    device = q_latent.device
    acc = torch.zeros(b, h, r, dtype=torch.float32, device=device)
    max_blocks = cdiv(max(lens, default=0), block_size)
    if max_blocks == 0 or h == 0:
        return acc
    q, tables = q_latent.float(), block_tables.long()
    lens_t = torch.tensor(lens, device=device)
    step = chunk_blocks or max(1, _CHUNK_ELEMS // (b * block_size * max(d, h)))
    if max_blocks <= step:  # one chunk holds every context: a plain softmax (fewer, larger ops)
        kv = _read_blocks(kv_cache, tables[:, :max_blocks], kv_scale).view(b, -1, d)  # [B, L, d]
        scores = torch.bmm(q, kv.transpose(1, 2)) * softmax_scale  # [B, h, L]
        pad = torch.arange(kv.shape[1], device=device)[None, :] >= lens_t[:, None]
        probs = torch.softmax(scores.masked_fill_(pad[:, None, :], float("-inf")), dim=-1)
        out = torch.bmm(probs, kv[..., :r])
        return torch.where((lens_t > 0)[:, None, None], out, 0.0)  # empty rows: softmax of nothing is NaN
    m = torch.full((b, h), float("-inf"), device=device)
    denom = torch.zeros(b, h, device=device)
    for c0 in range(0, max_blocks, step):
        c1 = min(c0 + step, max_blocks)
        rows = [i for i, n in enumerate(lens) if n > c0 * block_size]  # every one has a token here
        idx = torch.tensor(rows, device=device)
        kv = _read_blocks(kv_cache, tables[idx, c0:c1], kv_scale).view(len(rows), -1, d)  # [A, n, d]
        scores = torch.bmm(q[idx], kv.transpose(1, 2)) * softmax_scale  # [A, h, n]
        pos = torch.arange(c0 * block_size, c1 * block_size, device=device)
        scores.masked_fill_((pos[None, :] >= lens_t[idx, None])[:, None, :], float("-inf"))
        m_old = m[idx]
        m_new = torch.maximum(m_old, scores.amax(dim=-1))  # finite: each row has a valid position
        alpha = torch.exp(m_old - m_new)  # 0 on the first chunk (m_old = -inf)
        p = torch.exp(scores - m_new[..., None])
        denom[idx] = denom[idx] * alpha + p.sum(dim=-1)
        acc[idx] = acc[idx] * alpha[..., None] + torch.bmm(p, kv[..., :r])
        m[idx] = m_new
    return torch.where(denom[..., None] > 0, acc / denom.clamp(min=1e-30)[..., None], 0.0)


# ---- the op ------------------------------------------------------------------------------------


def _check(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
           softmax_scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None,
           num_splits: int | None = None) -> None:
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, kv_scale)


def _fake(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
          softmax_scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None,
          num_splits: int | None = None) -> torch.Tensor:
    return q_latent.new_empty(q_latent.shape[0], q_latent.shape[1], kv_lora_rank, dtype=torch.float32)


@declare("paged_mla_decode", fake=_fake, check=_check, opaque=True, dtype_of="kv_cache")
def paged_mla_decode(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """o_latent [B, h, kv_lora_rank] fp32 for q_latent [B, h, r + rope] over the paged latent cache.
    ``block_tables`` [B, max_blocks] int32/int64 and ``seq_lens`` [B] live on q's device; ``kv_scale``
    (0-d fp32) dequantizes an FP8 cache; ``num_splits`` (CUDA only) overrides the KV split count.
    On CUDA: FlashInfer (``kernels.mla_flashinfer``) where the call fits it (bf16/fp16 cache, DeepSeek's
    512 + 64 columns, no ``num_splits``; in a captured decode through its CUDA-graph-mode wrapper, planned by
    ``kernels.decode_plan``) and ``kernels.backends`` chose it for this device and cache dtype
    (installed, self-test passed, or forced by ``EPSERVE_MLA_BACKEND``), else Triton: the many-head kernel
    for ``WIDE_MIN_HEADS`` heads or more, the split-K one for fewer. The reference ignores ``num_splits``."""
    return paged_mla_decode_ref(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale)


def paged_mla_decode_c(
    q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    softmax_scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None, num_splits: int | None = None,
) -> torch.Tensor | None:
    """The C kernel (a bf16 or fp32 cache, no ``kv_scale``), or None where it does not apply."""
    if kv_scale is not None:
        return None
    return cpu_ops.mla_decode(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)


def wide_fits(kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """Whether the many-head kernel takes this cache's dtype and latent width (a power of two >= 32)."""
    return kv_cache.dtype in WIDE_CACHE_DTYPES and kv_lora_rank >= 32 and kv_lora_rank & (kv_lora_rank - 1) == 0


def takes_wide(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               softmax_scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None,
               num_splits: int | None = None) -> bool:
    """The many-head kernel runs calls with ``WIDE_MIN_HEADS`` heads or more that it fits (shapes only)."""
    return q_latent.shape[1] >= WIDE_MIN_HEADS and wide_fits(kv_cache, kv_lora_rank)


paged_mla_decode.implement("cpu", f"{__name__}:paged_mla_decode_c")
paged_mla_decode.implement("cuda", "epserve.kernels.mla_flashinfer:paged_mla_decode_fi",
                           backend=("mla_decode", "flashinfer"))
paged_mla_decode.implement("cuda", "epserve.kernels.mla_decode_wide:paged_mla_decode_wide", takes=takes_wide,
                           traced="op")
paged_mla_decode.implement("cuda", "epserve.kernels.mla_decode_triton:paged_mla_decode_triton", traced="op")
