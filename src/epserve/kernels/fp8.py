"""Block-scaled FP8 (DeepSeek-V3's recipe): activation quantization and GEMMs, with a torch reference.

Weights are float8_e4m3fn ``[N, K]`` with one fp32 ``scale_inv`` per 128x128 tile (multiplied in to
dequantize). Activations are quantized at run time per token and 128-column group (1x128, scale =
amax / 448, amax clamped to ``MIN_AMAX``). The GEMM accumulates in fp32 one 128-wide K block at a time:
``acc += (a_blk @ b_blk^T) * a_scale[m, kb] * b_scale[n // 128, kb]``.

The front ends (``act_quant``, ``silu_mul_quant``, ``block_fp8_gemm``, ``grouped_block_fp8_gemm``,
``fp8_linear``, ``fp8_moe_swiglu``) pick a backend per call from the tensors' device: the ``*_ref``
torch reference off CUDA (correct, not fast: it dequantizes one K block at a time and loops over
experts), Triton kernels on CUDA (``kernels.fp8_triton``, imported only then, so the CPU engine never
loads triton) and, for ``block_fp8_gemm``, ``torch._scaled_mm`` with blockwise (1x128, 128x128)
scales where its self-test passes for the device and output dtype (cuBLASLt >= 12.9 on SM90; the
``fp8_gemm`` op of ``kernels.backends``).
``EPSERVE_FP8_BACKEND`` (``env.fp8_backend``) forces a backend on CUDA. When traced (``torch.compile``,
fake tensors) the kernel front ends call their custom op instead (``kernels/ops.py``): a trace never
enters Triton, runs a self-test or reads the counts on the host.

On CUDA the quantizers return their scales M-major (``[M, nK]`` with strides ``(1, M)``), the
layout ``_scaled_mm`` takes and the one the Triton GEMMs read coalesced; the reference returns them
row-major. Grouped GEMMs take rows grouped by expert, ``counts[e]`` rows each, in expert order; rows past
``sum(counts)`` (padding) come out zero. The CUDA path never reads ``counts`` on the host, so it can
be captured in a CUDA graph.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from epserve import env
from epserve.kernels import backends
from epserve.kernels.device import is_cuda, tracing

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # weight tile 128x128, activation group 1x128
MIN_AMAX = 1e-10  # all-zero groups get scale MIN_AMAX / FP8_MAX, not a division by zero


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- shape checks (shared with the Triton wrappers) ---------------------------------------------


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


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 scales [M, ceil(K/128)]): one scale per row and 128 columns."""
    check_act(x)
    m, k = x.shape
    groups = cdiv(k, BLOCK)
    padded = torch.zeros(m, groups * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x
    tiles = padded.view(m, groups, BLOCK)
    scale = tiles.abs().amax(dim=2).clamp(min=MIN_AMAX) / FP8_MAX  # [M, groups]
    q = (tiles / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * BLOCK)[:, :k].contiguous(), scale


def silu_mul_quant_ref(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] -> act_quant_ref(silu(gate) * up) computed in fp32; gate = the first I columns."""
    check_act(gate_up, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns [M, 2I], got shape {_shape(gate_up)}")
    gate, up = gate_up.float().chunk(2, dim=1)
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
) -> torch.Tensor:
    """Rows of a [R, K] grouped by expert (``counts[e]`` each, in order) times b[e] [N, K]^T -> [R, N]."""
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


# ---- backend choice -----------------------------------------------------------------------------


def _triton() -> ModuleType:
    from epserve.kernels import fp8_triton  # lazy: importing triton costs the CPU engine for nothing

    return fp8_triton


def _on_cuda(t: torch.Tensor) -> bool:
    """Whether a call goes to the CUDA kernels (otherwise the reference)."""
    return is_cuda(t) and env.fp8_backend() != "torch"


def _scaled_mm_eligible(
    a: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> bool:
    """Shapes for which the blockwise ``_scaled_mm`` layouts are unambiguous: K a multiple of 512 (so
    the 128x128 scales' K/128 leading dimension needs no padding to 4), N a multiple of 16."""
    k, n = a.shape[1], b.shape[0]
    return (
        k % (4 * BLOCK) == 0 and n % 16 == 0 and a.shape[0] > 0 and b.is_contiguous()
        and b_scale.is_contiguous() and out_dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def _scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``torch._scaled_mm`` with (BlockWise1x128, BlockWise128x128) scales: mat2 = b^T column-major;
    scale_a [M, nK] M-major (strides (1, M)); scale_b = b_scale^T, i.e. [nK, nN] over b_scale's
    row-major [nN, nK] storage (ATen checks scale_b^T as [ceil(N/128), nK], strides (nK, 1))."""
    m = a.shape[0]
    a = a if a.stride(1) == 1 else a.contiguous()
    if a_scale.stride(1) != m or (m > 1 and a_scale.stride(0) != 1):
        a_scale = a_scale.t().contiguous().t()
    scale_b = b_scale.float().t()
    return torch._scaled_mm(a, b.t(), scale_a=a_scale.float(), scale_b=scale_b, out_dtype=out_dtype)


def _probe_scaled_mm(device: torch.device, out_dtype: torch.dtype) -> None:
    """The ``fp8_gemm`` op's self-test of ``scaled_mm``: blockwise ``_scaled_mm`` with ``out_dtype``
    output (the dtype the runtime asks for: a rejection of bf16 would otherwise go unseen behind an fp32
    probe) on a few small problems (odd M, a partial N tile, scales that differ across tiles so a wrong
    layout shows) against the fp32 reference; raises when it cannot run or is off."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        raise RuntimeError(f"blockwise torch._scaled_mm needs a CUDA device and torch._scaled_mm ({device})")
    if out_dtype not in _GEMM_OUT_DTYPES:
        raise ValueError(f"block FP8 GEMM output must be one of {_GEMM_OUT_DTYPES}, got {out_dtype}")
    tolerance = 1e-3 if out_dtype == torch.float32 else 1e-2  # bf16/fp16 outputs round to 2^-9 / 2^-12
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 256, 512), (5, 144, 1024), (96, 384, 1536)):
        a, a_scale = act_quant_ref(torch.randn(m, k, generator=g).to(device))
        b = (torch.randn(n, k, generator=g) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(device)
        b_scale = torch.rand(cdiv(n, BLOCK), k // BLOCK, generator=g).add_(0.1).to(device)
        want = _gemm_ref_fp32(a, a_scale, b, b_scale)
        got = _scaled_mm(a, a_scale, b, b_scale, out_dtype)
        err, bound = float((got.float() - want).abs().max()), tolerance * float(want.abs().max()) + 1e-6
        if got.dtype != out_dtype or not err <= bound:
            raise backends.KernelMismatch(f"{got.dtype} output off the reference by {err:.3g} (allowed {bound:.3g}) "
                                          f"at M,N,K={m},{n},{k}")


_GEMM_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Block FP8 GEMMs on CUDA: blockwise torch._scaled_mm where its self-test passes for the device and output
# dtype, else Triton; EPSERVE_FP8_BACKEND forces one (``torch``: the reference, decided in ``_on_cuda``).
FP8_GEMM = backends.register(backends.KernelOp(
    "fp8_gemm",
    (backends.KernelBackend("scaled_mm", _probe_scaled_mm), backends.KernelBackend("triton")),
    forced=env.fp8_backend,
    env_var=env.FP8_BACKEND,
))


def scaled_mm_supported(device: torch.device | str, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether blockwise ``torch._scaled_mm`` with ``out_dtype`` output works on ``device`` (its self-test,
    run once per process, device and output dtype, whatever ``EPSERVE_FP8_BACKEND`` forces; False off
    CUDA, and inside a graph capture before the test ran)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return backends.passes("fp8_gemm", "scaled_mm", device, out_dtype)


# ---- front ends ---------------------------------------------------------------------------------


def act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], fp32 [M, ceil(K/128)])."""
    if tracing():
        return torch.ops.epserve.fp8_act_quant(x)
    if _on_cuda(x):
        return _triton().act_quant_triton(x)
    return act_quant_ref(x)


def silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] -> quantized silu(gate) * up: (fp8 [M, I], fp32 [M, ceil(I/128)])."""
    if tracing():
        return torch.ops.epserve.fp8_silu_mul_quant(gate_up)
    if _on_cuda(gate_up):
        return _triton().silu_mul_quant_triton(gate_up)
    return silu_mul_quant_ref(gate_up)


def block_fp8_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """a fp8 [M, K] x b fp8 [N, K]^T with block scales -> [M, N] out_dtype."""
    if tracing():
        return torch.ops.epserve.fp8_block_gemm(a, a_scale, b, b_scale, out_dtype)
    if not _on_cuda(a):
        return block_fp8_gemm_ref(a, a_scale, b, b_scale, out_dtype)
    check_gemm(a, a_scale, b, b_scale)
    backend = env.fp8_backend()
    if backend == "scaled_mm" and _scaled_mm_eligible(a, b, b_scale, out_dtype):
        return _scaled_mm(a, a_scale, b, b_scale, out_dtype)  # forced: errors surface
    if backend == "auto" and _scaled_mm_eligible(a, b, b_scale, out_dtype) and (
            backends.select("fp8_gemm", a.device, out_dtype) == "scaled_mm"):
        try:
            return _scaled_mm(a, a_scale, b, b_scale, out_dtype)
        except (RuntimeError, ValueError) as e:  # a shape the self-test did not cover: Triton from now on
            backends.fall_back("fp8_gemm", a.device, out_dtype, f"M,N,K={a.shape[0]},{b.shape[0]},{a.shape[1]}: "
                               f"{str(e).splitlines()[0][:200]}")
    return _triton().block_fp8_gemm_triton(a, a_scale, b, b_scale, out_dtype)


def grouped_block_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    counts: torch.Tensor | Sequence[int],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows of a [R, K] grouped by expert (counts [E]) times b [E, N, K] -> [R, N] out_dtype."""
    if tracing():
        return torch.ops.epserve.fp8_grouped_gemm(a, a_scale, b, b_scale, _as_counts(counts, a.device), out_dtype)
    if _on_cuda(a):
        return _triton().grouped_block_fp8_gemm_triton(a, a_scale, b, b_scale, counts, out_dtype)
    return grouped_block_fp8_gemm_ref(a, a_scale, b, b_scale, counts, out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) @ w^T, w fp8 [N, K] with scales [ceil(N/128), ceil(K/128)] -> [..., N]
    in x.dtype: x quantized per token and 128 columns, then the block GEMM."""
    want = (cdiv(w.shape[0], BLOCK), cdiv(w.shape[-1], BLOCK)) if w.dim() == 2 else None
    if w.dim() != 2 or x.dim() == 0 or x.shape[-1] != w.shape[1] or _shape(w_scale) != want:
        raise ValueError(
            f"fp8_linear shapes do not match: x {_shape(x)}, w {_shape(w)}, w_scale {_shape(w_scale)}; "
            f"expected x [..., K], w [N, K], w_scale {want or '[ceil(N/128), ceil(K/128)]'}"
        )
    lead = x.shape[:-1]
    q, s = act_quant(x.reshape(-1, x.shape[-1]))
    return block_fp8_gemm(q, s, w, w_scale, x.dtype).view(*lead, w.shape[0])


def _check_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """x [R, H], w13 [E, 2I, H], w2 [E, H, I]."""
    check_act(x)
    e, two_i, h = w13.shape if w13.dim() == 3 else (0, 1, 0)
    if w2.dim() != 3 or two_i % 2 or _shape(w2) != (e, h, two_i // 2) or x.shape[1] != h:
        raise ValueError(f"fp8_moe_swiglu shapes do not match: x {_shape(x)}, w13 {_shape(w13)}, w2 {_shape(w2)}; "
                         "expected x [R, H], w13 [E, 2I, H], w2 [E, H, I]")


def _real_rows(x: torch.Tensor, counts: torch.Tensor) -> int:
    """The rows the experts read: every row on CUDA and in traces (the grouped kernels skip the padding on
    the device); on the reference path, which reads the counts on the host anyway, up to sum(counts)."""
    return x.shape[0] if _on_cuda(x) or tracing() else min(int(counts.sum()), x.shape[0])


def _pad_rows(y: torch.Tensor, rows: int) -> torch.Tensor:  # zero rows up to ``rows``
    return y if y.shape[0] == rows else F.pad(y, (0, 0, 0, rows - y.shape[0]))


def fp8_moe_swiglu(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w13_scale: torch.Tensor,
    w2: torch.Tensor, w2_scale: torch.Tensor,
) -> torch.Tensor:
    """Routed experts on x [R, H] grouped by expert: ``w2[e] @ (silu(gate) * up)`` with
    ``[gate; up] = w13[e] @ x`` (w13 fp8 [E, 2I, H], w2 fp8 [E, H, I], block scales) -> [R, H] in x.dtype,
    rows past sum(counts) zero: x quantized once (``act_quant``), then :func:`fp8_moe_swiglu_quantized`."""
    _check_moe(x, w13, w2)
    counts = _as_counts(counts, x.device)
    rows = _real_rows(x, counts)
    q, s = act_quant(x[:rows])
    return _pad_rows(fp8_moe_swiglu_quantized(q, s, counts, w13, w13_scale, w2, w2_scale, x.dtype), x.shape[0])


def fp8_moe_swiglu_quantized(
    q: torch.Tensor, s: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor,
    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`fp8_moe_swiglu` on rows already quantized (q fp8 [R, H], s fp32 [R, ceil(H/128)] in any
    layout, as ``act_quant`` returns them: an FP8 dispatch payload) -> [R, H] out_dtype, rows past
    sum(counts) zero. SiLU·mul is fused with the re-quantization between the two grouped GEMMs."""
    _check_moe(q, w13, w2)
    want = (q.shape[0], cdiv(q.shape[1], BLOCK))
    if q.dtype != FP8_DTYPE or s.dtype != torch.float32 or _shape(s) != want:
        raise ValueError(f"fp8_moe_swiglu_quantized needs q {FP8_DTYPE} [R, H] and fp32 scales {want}, got q "
                         f"{q.dtype} {_shape(q)} and scales {s.dtype} {_shape(s)}")
    counts = _as_counts(counts, q.device)
    if _on_cuda(q):
        counts = counts.to(q.device, non_blocking=True)  # once for both GEMMs; a no-op for device counts
    rows = _real_rows(q, counts)
    gate_up = grouped_block_fp8_gemm(q[:rows], s[:rows], w13, w13_scale, counts, out_dtype)
    q, s = silu_mul_quant(gate_up)
    return _pad_rows(grouped_block_fp8_gemm(q, s, w2, w2_scale, counts, out_dtype), want[0])
