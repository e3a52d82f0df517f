"""Block-scaled FP8 (DeepSeek-V3's recipe): activation quantization and GEMMs as kernel ops, with a torch reference.

Weights are float8_e4m3fn ``[N, K]`` with one fp32 ``scale_inv`` per 128x128 tile (multiplied in to
dequantize). Activations are quantized at run time per token and 128-column group (1x128, scale =
amax / 448, amax clamped to ``MIN_AMAX``). The GEMM accumulates in fp32 one 128-wide K block at a time:
``acc += (a_blk @ b_blk^T) * a_scale[m, kb] * b_scale[n // 128, kb]``.

The ops (``act_quant``, ``silu_mul_quant``, ``block_fp8_gemm``, ``grouped_block_fp8_gemm``; declared once,
``kernels.opdef``) run the ``*_ref`` torch reference off CUDA (correct, not fast: it dequantizes one K block
at a time and loops over experts), Triton kernels on CUDA (``kernels.fp8_triton``, imported only then, so
the CPU engine never loads triton) and, for ``block_fp8_gemm``, ``torch._scaled_mm`` with blockwise (1x128,
128x128) scales where its self-test passes for the device and output dtype (cuBLASLt >= 12.9 on SM90; the
``fp8_gemm`` op of ``kernels.backends``, in ``kernels.fp8_scaled_mm``; the op's table is keyed by the output
dtype and lists ``_scaled_mm`` ahead of Triton only where it was chosen). ``EPSERVE_FP8_BACKEND``
(``env.fp8_backend``) forces a backend on CUDA (``torch``: the reference). When traced (``torch.compile``,
fake tensors) each is its custom op ``epserve::fp8_*``: a trace never enters Triton, runs a self-test or
reads the counts on the host. ``kernels.fp8_layers`` composes them into the FP8 linear and routed experts.

On CUDA the quantizers return their scales M-major (``[M, nK]`` with strides ``(1, M)``), the
layout ``_scaled_mm`` takes and the one the Triton GEMMs read coalesced; the reference returns them
row-major. Grouped GEMMs take rows grouped by expert, ``counts[e]`` rows each, in expert order; rows past
``sum(counts)`` (padding) come out zero. The CUDA path never reads ``counts`` on the host, so it can
be captured in a CUDA graph.

A masked grouped input (``moe.dispatch.base.ExpertInput.masked``: padding rows never written, their outputs
never read) is skipped on CUDA: ``grouped_block_fp8_gemm(..., masked=True)`` gives its padding rows no tile
(neither read nor written), and the quantizers given the input's ``counts`` stop at ``sum(counts)`` rows, a
count they read on the device. The grouped GEMM's row tile comes from ``rows_per_expert`` (the real rows an
expert is expected to get, a host value) where given, not from the padded rows. The reference reads the
counts on the host: it never reads the padding rows either, and is exact on the real ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from epserve import env
from epserve.kernels import backends
from epserve.kernels.device import is_cuda
from epserve.kernels.opdef import declare

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # weight tile 128x128, activation group 1x128
MIN_AMAX = 1e-10  # all-zero groups get scale MIN_AMAX / FP8_MAX, not a division by zero


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- shape checks (the Triton wrappers import them) ---------------------------------------------


def fp8_scale_shape(*shape: int) -> tuple[int, ...]:
    """The scale tensor of an FP8 weight ``[..., out, in]``: one fp32 per 128x128 tile."""
    *lead, out_features, in_features = shape
    return (*lead, cdiv(out_features, BLOCK), cdiv(in_features, BLOCK))


def fp8_weight_pair(*shape: int) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    """An empty FP8 weight ``shape`` (``[..., out, in]``) and its tile scales, as DeepSeek publishes them."""
    weight = torch.nn.Parameter(torch.empty(*shape, dtype=FP8_DTYPE), requires_grad=False)
    scale = torch.nn.Parameter(torch.empty(*fp8_scale_shape(*shape), dtype=torch.float32), requires_grad=False)
    return weight, scale


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_act(x: torch.Tensor, name: str = "x") -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {_shape(x)}")


def check_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    """a fp8 [M, K], a_scale [M, ceil(K/128)], b fp8 [N, K], b_scale [ceil(N/128), ceil(K/128)]."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"block FP8 GEMM needs 2-D a [M, K] and b [N, K], got {_shape(a)} and {_shape(b)}")
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a and b must be {FP8_DTYPE}, got {a.dtype} and {b.dtype}")
    (m, k), (n, kb) = a.shape, b.shape
    want_a, want_b = (m, cdiv(k, BLOCK)), (cdiv(n, BLOCK), cdiv(k, BLOCK))
    if kb != k or _shape(a_scale) != want_a or _shape(b_scale) != want_b:
        raise ValueError(
            f"block FP8 GEMM shapes do not match: a {_shape(a)}, a_scale {_shape(a_scale)}, b {_shape(b)}, "
            f"b_scale {_shape(b_scale)}; expected b [N, {k}], a_scale {want_a}, b_scale {want_b}"
        )


def check_grouped(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts: torch.Tensor
) -> None:
    """a fp8 [R, K], a_scale [R, nK], b fp8 [E, N, K], b_scale [E, ceil(N/128), nK], counts [E]."""
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"grouped FP8 GEMM needs a [R, K] and b [E, N, K], got {_shape(a)} and {_shape(b)}")
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"a and b must be {FP8_DTYPE}, got {a.dtype} and {b.dtype}")
    (r, k), (e, n, kb) = a.shape, b.shape
    want_a, want_b = (r, cdiv(k, BLOCK)), (e, cdiv(n, BLOCK), cdiv(k, BLOCK))
    if kb != k or _shape(a_scale) != want_a or _shape(b_scale) != want_b or _shape(counts) != (e,):
        raise ValueError(
            f"grouped FP8 GEMM shapes do not match: a {_shape(a)}, a_scale {_shape(a_scale)}, b {_shape(b)}, "
            f"b_scale {_shape(b_scale)}, counts {_shape(counts)}; expected b [E, N, {k}], a_scale {want_a}, "
            f"b_scale {want_b}, counts ({e},)"
        )


def _as_counts(counts: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    if not isinstance(counts, torch.Tensor):
        return torch.tensor(list(counts), dtype=torch.int64, device=device)
    return counts


# ---- torch reference ----------------------------------------------------------------------------


def _real_rows_only(x: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    """x with its rows past ``sum(counts)`` replaced by zeros, unread (counts read on the host); x itself
    without counts."""
    if counts is None:
        return x
    real = min(int(counts.sum()), x.shape[0])
    return x if real == x.shape[0] else F.pad(x[:real], (0, 0, 0, x.shape[0] - real))


def act_quant_ref(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scales [M, ceil(K/128)]): one scale per row and 128 columns. With the
    ``counts`` of a grouped input, the rows past ``sum(counts)`` are not read (quantized as zero rows)."""
    check_act(x)
    x = _real_rows_only(x, counts)
    m, k = x.shape
    groups = cdiv(k, BLOCK)
    padded = torch.zeros(m, groups * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x
    tiles = padded.view(m, groups, BLOCK)
    scale = tiles.abs().amax(dim=2).clamp(min=MIN_AMAX) / FP8_MAX  # [M, groups]
    q = (tiles / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * BLOCK)[:, :k].contiguous(), scale


def silu_mul_quant_ref(
    gate_up: torch.Tensor, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] -> act_quant_ref(silu(gate) * up) computed in fp32; gate = the first I columns. With
    ``counts``, the rows past ``sum(counts)`` are not read (quantized as zero rows)."""
    check_act(gate_up, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns [M, 2I], got shape {_shape(gate_up)}")
    gate, up = _real_rows_only(gate_up, counts).float().chunk(2, dim=1)
    return act_quant_ref(F.silu(gate) * up)


def _gemm_ref_fp32(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    out = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    b_scale_rows = b_scale.float().repeat_interleave(BLOCK, dim=0)[:n]  # [N, nK]: each row's tile scale
    for kb in range(cdiv(k, BLOCK)):
        k0, k1 = kb * BLOCK, min(k, (kb + 1) * BLOCK)
        part = a[:, k0:k1].float() @ b[:, k0:k1].float().t()
        out += part * a_scale[:, kb : kb + 1].float() * b_scale_rows[:, kb]
    return out


def block_fp8_gemm_ref(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a fp8 [M, K] (scales [M, nK]) times b fp8 [N, K]^T (scales [ceil(N/128), nK]) -> [M, N] out_dtype."""
    check_gemm(a, a_scale, b, b_scale)
    return _gemm_ref_fp32(a, a_scale, b, b_scale).to(out_dtype)


def grouped_block_fp8_gemm_ref(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    counts: torch.Tensor | Sequence[int],
    out_dtype: torch.dtype,
    rows_per_expert: float | None = None,
    masked: bool = False,
) -> torch.Tensor:
    """Rows of a [R, K] grouped by expert (``counts[e]`` each, in order) times b[e] [N, K]^T -> [R, N]; only
    the real rows are read, the padding rows past ``sum(counts)`` come out zero (``masked`` or not: zero is
    one of the values a masked input's undefined rows may take); ``rows_per_expert`` is the kernels' tile
    hint."""
    counts = _as_counts(counts, a.device)
    check_grouped(a, a_scale, b, b_scale, counts)
    sizes = [int(c) for c in counts.tolist()]
    if min(sizes, default=0) < 0 or sum(sizes) > a.shape[0]:
        raise ValueError(f"counts {sizes} must be >= 0 and sum to at most the {a.shape[0]} rows of a")
    out = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    start = 0
    for e, n in enumerate(sizes):
        if n:
            rows = slice(start, start + n)
            out[rows] = _gemm_ref_fp32(a[rows], a_scale[rows], b[e], b_scale[e]).to(out_dtype)
            start += n
    return out


# ---- the ops -----------------------------------------------------------------------------------


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether a call goes to the CUDA kernels (otherwise the reference)."""
    return is_cuda(t) and env.fp8_backend() != "torch"


def _where(t: torch.Tensor, *_: object, **__: object) -> str:
    """The device type whose implementations run: ``cuda`` on the CUDA kernels' route, else the reference's."""
    return "cuda" if _on_cuda(t) else "cpu"


def _fake_quant(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, k], fp32 scales [M, ceil(k/128)]): M-major on the CUDA kernels' route, as they return them."""
    m, groups = x.shape[0], cdiv(k, BLOCK)
    q = x.new_empty(m, k, dtype=FP8_DTYPE)
    if _on_cuda(x):
        return q, x.new_empty(groups, m, dtype=torch.float32).t()
    return q, x.new_empty(m, groups, dtype=torch.float32)


def _fake_act(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_act(x)
    return _fake_quant(x, x.shape[1])


def _fake_silu(gate_up: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_act(gate_up, "gate_up")
    return _fake_quant(gate_up, gate_up.shape[1] // 2)


def _fake_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    check_gemm(a, a_scale, b, b_scale)
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def _fake_grouped(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  counts: torch.Tensor, out_dtype: torch.dtype, rows_per_expert: float | None = None,
                  masked: bool = False) -> torch.Tensor:
    check_grouped(a, a_scale, b, b_scale, counts)
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


_TRITON = "epserve.kernels.fp8_triton"  # imported on CUDA only: importing triton costs the CPU engine for nothing
_OP = {"opaque": True, "device_of": _where}


@declare("fp8_act_quant", fake=_fake_act, **_OP)
def act_quant(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 [M, ceil(K/128)]). ``counts``: x is a masked grouped input with these
    counts per expert (on x's device); its rows past ``sum(counts)`` are neither read nor quantized (their
    values and scales undefined; zero rows' on the reference)."""
    return act_quant_ref(x, counts)


@declare("fp8_silu_mul_quant", fake=_fake_silu, **_OP)
def silu_mul_quant(
    gate_up: torch.Tensor, counts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] -> quantized silu(gate) * up: (fp8 [M, I], fp32 [M, ceil(I/128)]). ``counts``: as
    for :func:`act_quant` (the rows past ``sum(counts)`` neither read nor quantized)."""
    return silu_mul_quant_ref(gate_up, counts)


@declare("fp8_block_gemm", fake=_fake_gemm, dtype_of="out_dtype", **_OP)
def block_fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a fp8 [M, K] x b fp8 [N, K]^T with block scales -> [M, N] out_dtype."""
    return block_fp8_gemm_ref(a, a_scale, b, b_scale, out_dtype)


@declare("fp8_grouped_gemm", fake=_fake_grouped, **_OP)
def grouped_block_fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts: torch.Tensor,
    out_dtype: torch.dtype, rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """Rows of a [R, K] grouped by expert (counts [E], or a list of ints in eager calls) times b [E, N, K] ->
    [R, N] out_dtype, rows past sum(counts) zero. ``masked`` (``ExpertInput.masked``): those rows may be
    garbage, and their outputs are left undefined; the CUDA kernels neither read nor write them.
    ``rows_per_expert``: the real rows an expert is expected to get (a host value), from which the CUDA
    kernels pick their row tile (``fp8_triton.grouped_tile_m``)."""
    return grouped_block_fp8_gemm_ref(a, a_scale, b, b_scale, counts, out_dtype, rows_per_expert, masked)


act_quant.implement("cuda", f"{_TRITON}:act_quant_triton", traced="op")
silu_mul_quant.implement("cuda", f"{_TRITON}:silu_mul_quant_triton", traced="op")
block_fp8_gemm.implement("cuda", "epserve.kernels.fp8_scaled_mm:block_fp8_gemm_scaled_mm", traced="op",
                         backend=("fp8_gemm", "scaled_mm"))
block_fp8_gemm.implement("cuda", f"{_TRITON}:block_fp8_gemm_triton", traced="op")
grouped_block_fp8_gemm.implement("cuda", f"{_TRITON}:grouped_block_fp8_gemm_triton", traced="op")


_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def scaled_mm_supported(device: torch.device | str, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether blockwise ``torch._scaled_mm`` with ``out_dtype`` output works on ``device`` (its self-test,
    run once per process, device and output dtype, whatever ``EPSERVE_FP8_BACKEND`` forces; False off
    CUDA; inside a graph capture before the test ran it raises ``backends.KernelUndecided``)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return backends.passes("fp8_gemm", "scaled_mm", device, out_dtype)


