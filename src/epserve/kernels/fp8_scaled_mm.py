"""Block FP8 GEMMs on CUDA by blockwise ``torch._scaled_mm`` (1x128 activation, 128x128 weight scales), with
its self-test: the ``fp8_gemm`` op of ``kernels.backends`` (``scaled_mm`` where the self-test passes for the
device and output dtype, else ``triton``; ``EPSERVE_FP8_BACKEND`` forces one), and the implementation of
``kernels.fp8.block_fp8_gemm`` on CUDA that its table lists where that choice is ``scaled_mm``. Where both pass
on a GPU, ``kernels.backends`` times each on DeepSeek-V3's decode GEMMs (:data:`BENCH_SHAPES`) and keeps the
faster.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from epserve import env
from epserve.kernels import backends
from epserve.kernels.fp8 import (
    _GEMM_OUT_DTYPES,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    _gemm_ref_fp32,
    act_quant_ref,
    block_fp8_gemm,
    cdiv,
    check_gemm,
)

# the timed self-test's GEMMs (M, N, K): a decode step of 64 rows through DeepSeek-V3's o_proj (7168 x 16384)
# and q_b_proj (24576 x 1536)
BENCH_SHAPES = ((64, 7168, 16384), (64, 24576, 1536))


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


def _bench_cases(device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """(a, a_scale, b, b_scale) of each of ``BENCH_SHAPES`` on ``device`` (random FP8 values)."""
    cases = []
    for m, n, k in BENCH_SHAPES:
        a = torch.randn(m, k, device=device).to(FP8_DTYPE)
        a_scale = torch.rand(k // BLOCK, m, device=device).add_(0.5).t()  # M-major, as act_quant returns it
        b = torch.randn(n, k, device=device).to(FP8_DTYPE)
        cases.append((a, a_scale, b, torch.rand(cdiv(n, BLOCK), k // BLOCK, device=device).add_(0.5)))
    return cases


def _benchmark_scaled_mm(device: torch.device, out_dtype: torch.dtype) -> Callable[[], object]:
    cases = _bench_cases(device)
    return lambda: [_scaled_mm(*case, out_dtype) for case in cases]


def _benchmark_triton(device: torch.device, out_dtype: torch.dtype) -> Callable[[], object]:
    cases = _bench_cases(device)
    return lambda: [block_fp8_gemm.without_backends(*case, out_dtype) for case in cases]


# Block FP8 GEMMs on CUDA: blockwise torch._scaled_mm where its self-test passes for the device and output
# dtype, else Triton (the faster where both pass); EPSERVE_FP8_BACKEND forces one (``torch``: the reference,
# decided in ``fp8._on_cuda``).
FP8_GEMM = backends.register(backends.KernelOp(
    "fp8_gemm",
    (backends.KernelBackend("scaled_mm", _probe_scaled_mm, _benchmark_scaled_mm),
     backends.KernelBackend("triton", benchmark=_benchmark_triton)),
    forced=env.fp8_backend,
    env_var=env.FP8_BACKEND,
))


def block_fp8_gemm_scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor | None:
    """``block_fp8_gemm`` by blockwise ``_scaled_mm`` (listed where ``kernels.backends`` chose ``scaled_mm`` for
    the device and output dtype); None (the op runs Triton) for shapes whose layouts it does not take, and for
    a shape its self-test did not cover and it rejects, which hands the op to Triton from then on (unless
    ``EPSERVE_FP8_BACKEND`` forces it: then errors surface)."""
    check_gemm(a, a_scale, b, b_scale)
    if not _scaled_mm_eligible(a, b, b_scale, out_dtype):
        return None
    try:
        return _scaled_mm(a, a_scale, b, b_scale, out_dtype)
    except (RuntimeError, ValueError) as e:
        if env.fp8_backend() == "scaled_mm":
            raise
        backends.fall_back("fp8_gemm", a.device, out_dtype, f"M,N,K={a.shape[0]},{b.shape[0]},{a.shape[1]}: "
                           f"{str(e).splitlines()[0][:200]}")
        return None
