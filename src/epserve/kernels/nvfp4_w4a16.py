"""The ``nvfp4_w4a16`` op of ``kernels.backends``: what runs NVFP4 weights with activations in the model dtype
(W4A16: ``kernels.nvfp4``'s ``nvfp4_linear`` and ``nvfp4_moe_swiglu``) on CUDA, decided once per device and dtype
at start-up. ``triton``, the kernels of ``kernels.nvfp4_triton``, where their self-test passes; else ``torch``,
the ops' torch references (:func:`linear_torch`, :func:`moe_swiglu_torch`: the implementations ``kernels.nvfp4``
lists after the kernels on CUDA).

The self-test (:func:`self_test`) runs the Triton linear and the grouped SwiGLU experts on a few small problems in
the dtype asked, on the device, against the torch references there: the linear with one row and several, K not a
multiple of the K tile, two parts each with its own global scale (a decade apart, so a part's rows scaled by
another's show); the experts with an expert without rows and NaN padding rows past ``sum(counts)``, their counts
on the device, padded (those rows must come out zero) and masked with a row-tile hint (the real rows compared).
Every row count keeps the kernels' smallest row tile, the one a decode step runs, so the test compiles no kernel
the engine would not. No benchmark: where the kernels pass they are used (the reference dequantizes a chunk of
the weight at a time and reads the experts' counts on the host).

The Triton experts read their counts on the device, so a decode step can be captured in a CUDA graph; the
reference cannot be (:func:`capturable`): the runner decodes eagerly where it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epserve.kernels import backends
from epserve.kernels.nvfp4 import GROUP, SCALE_DTYPE, nvfp4_linear_ref, nvfp4_moe_swiglu_ref

OP = "nvfp4_w4a16"
TRITON, TORCH = "triton", "torch"
# allowed error, of the output's largest value: fp32 sums in another order; a rounding of the output (fp16, bf16)
# and of the experts' intermediate in the dtype. A wrong decode, scale or row is off by the output's magnitude.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}
LINEAR_CASES = ((1, 40, 96, 2), (13, 64, 272, 1))  # (M, rows per part, K, parts)
EXPERTS = (4, 48, 32)  # E, H, I: H/16 = 3 block scales, I = 32, neither a multiple of a tile
COUNTS = (3, 0, 9, 2)  # the experts' rows (one without any) of 20 rows: 6 padding rows
ROWS = 20


def _nvfp4(g: torch.Generator, lead: tuple[int, ...], n: int, k: int, parts: int) -> list[torch.Tensor]:
    """A random NVFP4 weight ``[*lead, n * parts, k]``: packed codes, e4m3 block scales (never NaN) and a global
    scale per part, a decade apart, sized so an output is about as large as its input."""
    rows = n * parts
    weight = torch.randint(0, 256, (*lead, rows, k // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(*lead, rows, k // GROUP, generator=g) * 4 + 0.05).to(SCALE_DTYPE)
    decades = torch.logspace(0, parts - 1, parts)
    scale_2 = (torch.rand(*lead, parts, generator=g) + 0.5) * decades / (16 * k**0.5)
    return [weight, scale, scale_2]


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    bound = TOLERANCE[dtype] * float(want.float().abs().max()) + 1e-6
    if got.dtype != dtype or got.shape != want.shape or not err <= bound:
        raise backends.KernelMismatch(f"{what}: {got.dtype} {tuple(got.shape)} output off the reference by {err:.3g} "
                                      f"(allowed {bound:.3g})")


def self_test(device: torch.device, dtype: torch.dtype) -> None:
    """The ``triton`` backend's self-test (see the module docstring); raises where the kernels cannot run
    (triton missing, a compile or launch error) or answer off the reference."""
    from epserve.kernels import nvfp4_triton as nt  # (an ImportError without triton: not this backend)

    if dtype not in TOLERANCE:
        raise ValueError(f"NVFP4 W4A16 runs activations in {tuple(TOLERANCE)}, got {dtype}")
    g = torch.Generator().manual_seed(0)
    for m, n, k, parts in LINEAR_CASES:
        x = torch.randn(m, k, generator=g).to(dtype).to(device)
        weight = [t.to(device) for t in _nvfp4(g, (), n, k, parts)]
        _check(nt.nvfp4_linear_triton(x, *weight), nvfp4_linear_ref(x, *weight), dtype,
               f"linear M,N,K={m},{n * parts},{k}")
    (e, h, i), total = EXPERTS, sum(COUNTS)
    moe = [t.to(device) for t in (*_nvfp4(g, (e,), i, h, 2), *_nvfp4(g, (e,), h, i, 1))]
    x = torch.randn(ROWS, h, generator=g).to(dtype)
    x[total:] = float("nan")  # padding rows: never read
    x = x.to(device)
    want = nvfp4_moe_swiglu_ref(x, COUNTS, *moe)  # padding rows zero
    counts = torch.tensor(COUNTS, device=device)
    _check(nt.nvfp4_moe_swiglu_triton(x, counts, *moe), want, dtype, f"experts, counts {COUNTS}")
    masked = nt.nvfp4_moe_swiglu_triton(x, counts, *moe, rows_per_expert=2.0, masked=True)
    _check(masked[:total], want[:total], dtype, f"masked experts, counts {COUNTS}")


def linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor) -> torch.Tensor:
    """``nvfp4_linear`` by the ``torch`` backend: the reference."""
    return nvfp4_linear_ref(x, weight, weight_scale, weight_scale_2)


def moe_swiglu_torch(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
    rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """``nvfp4_moe_swiglu`` by the ``torch`` backend: the reference (the counts read on the host; the tile hint
    unused, the padding rows never read)."""
    return nvfp4_moe_swiglu_ref(x, counts, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)


def capturable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the W4A16 ops decided for ``device`` and ``dtype`` can be captured in a CUDA graph: the Triton
    kernels can (the experts' counts read on the device); the torch reference cannot (read on the host), nor can
    an op not decided yet."""
    return backends.decided(OP, device, dtype) == TRITON


# NVFP4 W4A16 on CUDA: the Triton kernels where their self-test passes for the device and dtype, else the torch
# references (``kernels.nvfp4`` lists the kernels as the implementations of its ops only where chosen).
NVFP4_W4A16 = backends.register(backends.KernelOp(OP, (backends.KernelBackend(TRITON, self_test),
                                                       backends.KernelBackend(TORCH))))
