"""Paged MLA decode cases for the kernel tests (``tests/kernels/test_mla_decode_*.py``; the interpreter's
subprocess imports them too): ragged contexts in shuffled blocks, the dense fp64 computation, tolerances and
the many-head kernel's precision contract (``kernels.mla_decode_wide``) as a bound to check."""

from __future__ import annotations

import torch

from epserve.kernels import mla_decode as md
from epserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, cdiv

R, PE = 64, 16
SOFTMAX_SCALE = (R + PE) ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": FP8_DTYPE}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # round to nearest, relative


def lens_for(batch: int, bs: int) -> list[int]:
    """Context lengths: 1, bs - 1, bs, several blocks, long; padding rows (0) in padded batches."""
    if batch == 1:
        return [9 * bs + 7]
    if batch == 3:
        return [bs - 1, 0, 3 * bs + 5]
    return [1, bs - 1, bs, 0, 3 * bs + 5, 9 * bs + 7, 2 * bs, 0][:batch]


def make_case(
    lens: list[int], heads: int, bs: int, dtype: torch.dtype, seed: int = 0, r: int = R, pe: int = PE
) -> tuple:
    """(q [B, h, r + pe], cache, block_tables, seq_lens, kv_scale | None). Each sequence's blocks are
    distinct shuffled ids; the table's tail holds ids of random (other) blocks; tables are int32 for
    even seeds, int64 for odd. FP8: latent / 0.02 rounded to e4m3 (values up to ~300), kv_scale 0.02."""
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, bs) for n in lens]
    num_blocks, width = sum(need) + 3, max(need, default=0) + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=g)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n]
        start += n
    latent = torch.randn(num_blocks, bs, r + pe, generator=g) * 1.5
    q = torch.randn(len(lens), heads, r + pe, generator=g) * 2
    kv_scale = None
    if dtype == FP8_DTYPE:
        kv_scale = torch.tensor(0.02)
        cache = (latent / kv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        cache = latent.to(dtype)
    return q, cache, tables.to(torch.int32 if seed % 2 == 0 else torch.int64), torch.tensor(lens), kv_scale


def context_rows(cache, tables, seq_lens, kv_scale, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's cached rows, dequantized, padded to the longest: ([B, L, d], pad mask [B, L])."""
    max_len, bs = max(seq_lens.tolist(), default=0), cache.shape[1]
    nb = cdiv(max_len, bs)
    blocks = cache.view(torch.uint8)[tables[:, :nb].long()].view(FP8_DTYPE) if cache.dtype == FP8_DTYPE \
        else cache[tables[:, :nb].long()]
    kv = blocks.to(dtype).view(tables.shape[0], nb * bs, -1)[:, :max_len]
    if kv_scale is not None:
        kv = kv * kv_scale.to(dtype)
    return kv, torch.arange(max_len, device=cache.device)[None, :] >= seq_lens[:, None]


def dense(q, cache, tables, seq_lens, scale, r, kv_scale) -> torch.Tensor:
    """``_decode_mqa``'s math in fp64 (gather the padded context of the whole batch); 0-length rows 0."""
    out = torch.zeros(q.shape[0], q.shape[1], r, dtype=torch.float64)
    if max(seq_lens.tolist(), default=0) == 0:
        return out.float()
    kv, pad = context_rows(cache, tables, seq_lens, kv_scale)
    scores = torch.bmm(q.double(), kv.transpose(1, 2)) * scale
    scores.masked_fill_(pad[:, None, :], float("-inf"))
    full = torch.bmm(torch.softmax(scores, dim=-1), kv[..., :r])
    live = seq_lens > 0
    out[live] = full[live]
    return out.float()


def value_max(cache: torch.Tensor, r: int, kv_scale) -> float:
    v = cache[..., :r].float()
    return v.abs().max().item() * (kv_scale.item() if kv_scale is not None else 1.0)


def assert_decode_close(out, want, lens, atol, rtol: float = 1e-5) -> None:
    """``atol``: a float, or a tensor broadcast against the output (a bound per sequence and head)."""
    assert out.shape == want.shape and out.dtype == torch.float32
    out, want = out.float().cpu(), want.float().cpu()
    assert bool(torch.isfinite(out).all())
    zero = torch.tensor(lens) == 0
    assert not out[zero].any(), "rows with seq_len 0 must be zeros"
    err = (out - want).abs()
    atol = atol.cpu() if isinstance(atol, torch.Tensor) else atol
    ok = err <= atol + rtol * want.abs()
    assert bool(ok.all()), f"max err {err.max().item():.3g}, worst excess {(err - atol).max().item():.3g}"


def rounded_query(q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The query the many-head kernel multiplies: rounded to its dots' 16-bit type (fp16 for an fp16 cache)."""
    return q.to(torch.float16 if cache.dtype == torch.float16 else torch.bfloat16).float()


def wide_bound(q, cache, tables, seq_lens, scale, r, kv_scale, p_atol: float) -> torch.Tensor:
    """[B, h, 1] the many-head kernel's contract (``kernels.mla_decode_wide``) on |o - o_ref| for the fp32
    query: ``(exp(2 eps) - 1) max|v| + p_atol`` with ``eps = u scale max_t sum_i |q_i k_ti|`` over each
    sequence's tokens (``p_atol``: what P's rounding adds, the split-K kernel's tolerance)."""
    u = UNIT_ROUNDOFF[torch.float16 if cache.dtype == torch.float16 else torch.bfloat16]
    if max(seq_lens.tolist(), default=0) == 0:
        return torch.full((q.shape[0], q.shape[1], 1), p_atol)
    kv, pad = context_rows(cache, tables, seq_lens, kv_scale, torch.float32)
    mag = torch.bmm(q.float().abs(), kv.abs().transpose(1, 2)).masked_fill_(pad[:, None, :], 0.0)  # [B, h, L]
    eps = u * scale * mag.amax(dim=-1, keepdim=True)
    return (torch.expm1(2 * eps) * value_max(cache, r, kv_scale) + p_atol).cpu()


def cuda_case(lens, heads, bs, dtype, seed=0, tables_dtype=None):
    """``make_case`` at DeepSeek's dims (512 + 64) on the GPU; ``tables_dtype`` overrides the tables'."""
    case = make_case(lens, heads, bs, dtype, seed=seed, r=512, pe=64)
    q, cache, tables, seq_lens, kv_scale = (t.cuda() if t is not None else None for t in case)
    return q, cache, tables if tables_dtype is None else tables.to(tables_dtype), seq_lens, kv_scale


def wide_refs(q, cache, tables, seq_lens, scale, kv_scale, p_atol) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the many-head kernel's output (DeepSeek's r = 512) is held to: (the reference fed its rounded query,
    the reference, the contract's bound ``wide_bound``), computed once for a case."""
    rounded = md.paged_mla_decode_ref(rounded_query(q, cache), cache, tables, seq_lens, scale, 512, kv_scale)
    ref = md.paged_mla_decode_ref(q, cache, tables, seq_lens, scale, 512, kv_scale)
    return rounded, ref, wide_bound(q, cache, tables, seq_lens, scale, 512, kv_scale, p_atol)


def assert_wide_contract(out, refs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], lens, p_atol) -> None:
    """At ``p_atol`` against the reference fed the rounded query, within the bound against the fp32 query."""
    rounded, ref, bound = refs
    assert_decode_close(out, rounded, lens, p_atol)
    assert_decode_close(out, ref, lens, bound)
