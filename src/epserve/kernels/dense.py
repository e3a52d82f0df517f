"""The model-dtype linear, ``x @ w^T``, as a kernel op declared once (``kernels.opdef``): ``F.linear`` is its
reference; on the CPU the decode GEMM of ``kernels.cpu`` (bf16 with AVX512-BF16, fp32 with AVX2 + FMA) takes
the calls with few rows, streaming the weight once. A CPU trace (``torch.compile`` of the CPU decode) sees
that kernel as the custom op ``epserve::linear`` where it takes the call, ``F.linear`` elsewhere; on CUDA
the reference (cuBLAS) runs. FP8 block-scaled weights are ``kernels.fp8_layers.fp8_linear``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels import cpu
from epserve.kernels.opdef import declare


def _fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


@declare("linear", fake=_fake)
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] in x's dtype (bf16, fp32 or fp16; one dtype for both): one C call
    for a decode's few rows on the CPU."""
    return F.linear(x, w)


linear.implement("cpu", "epserve.kernels.cpu:linear", takes=cpu.linear_takes, traced="op")
