"""NVFP4 W4A4, as TensorRT-LLM and vLLM run ModelOpt's NVFP4 checkpoints on Blackwell: the activations quantized
to NVFP4 with the checkpoint's ``input_scale`` as their global scale (``kernels.nvfp4_act.nvfp4_act_quant``: e2m1
codes, one e4m3 block scale per 16 values), then one GEMM on four-bit operands with both block scales and both
global scales (``torch.nn.functional.scaled_mm`` on ``float4_e2m1fn_x2`` data: BlockWise1x16 e4m3 scales in
cuBLAS's swizzled 128x4 layout and a TensorWise fp32 scale each, ``kernels.nvfp4_fp4_gemm``). The routed experts'
W4A4 op is ``kernels.nvfp4_w4a4_moe``'s, on the same GEMM and decided by the same self-test.

``nvfp4_w4a4_linear(x, weight, weight_scale, weight_scale_2, input_scale)`` (declared once, ``kernels.opdef``;
the custom op ``epserve::nvfp4_w4a4_linear`` in a trace): its reference :func:`nvfp4_w4a4_ref` quantizes x
exactly as the kernels do, dequantizes both operands and multiplies in fp32. A linear fusing several parts (gate
and up) quantizes x once with the largest of its parts' input scales (as vLLM and SGLang do) and keeps each
part's weight global scale: on the GPU one GEMM per part, so the result is exact for any fusion. W4A4 is lossy
against the checkpoint's W4A16 oracle (the activations lose bits); it is tested against its own reference.

On CUDA: ``scaled_mm`` (the ``nvfp4_gemm`` op of ``kernels.backends``) where its self-test against the
reference passes for the device and output dtype, which needs FP4 tensor cores (compute capability 10.0 and
up: never Hopper), and for shapes it takes (K a multiple of 32, each part's rows a multiple of 16); otherwise the
same arithmetic by the Triton W4A16 kernel on the dequantized fp32 activations (``kernels.nvfp4_triton``) where
the ``nvfp4_w4a16`` op chose its Triton kernels (their self-test passed), else the reference. None reads a value
on the host, so each can be captured in a CUDA graph. :func:`w4a4_supported` says whether a device runs the real
W4A4 GEMM; the model runs W4A4 only there (elsewhere its NVFP4 layers and experts stay W4A16).
"""

from __future__ import annotations

import torch

from epserve import env
from epserve.kernels import backends
from epserve.kernels.device import capability
from epserve.kernels.nvfp4 import GROUP, SCALE_DTYPE, check_nvfp4_weight, nvfp4_linear_ref
from epserve.kernels.nvfp4_act import nvfp4_act_dequant_ref, nvfp4_act_quant, nvfp4_act_quant_ref
from epserve.kernels.nvfp4_fp4_gemm import MIN_CAPABILITY, OUT_DTYPES, fp4_gemm, fp4_gemm_takes
from epserve.kernels.nvfp4_w4a4_moe import experts_self_test
from epserve.kernels.opdef import declare


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_w4a4(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
               input_scale: torch.Tensor) -> tuple[int, int]:
    """x [..., K] in bf16/fp16/fp32, an NVFP4 weight [N, K] (``check_nvfp4_weight``), input_scale fp32 [S'] (one
    per part, the largest used) -> (N, K)."""
    n, k = check_nvfp4_weight(weight, weight_scale, weight_scale_2)
    if x.dim() == 0 or x.shape[-1] != k or x.dtype not in OUT_DTYPES:
        raise ValueError(f"nvfp4_w4a4_linear needs x [..., {k}] in {OUT_DTYPES} for the weight {_shape(weight)}, "
                         f"got x {x.dtype} {_shape(x)}")
    if input_scale.dtype != torch.float32 or input_scale.dim() != 1 or not input_scale.numel():
        raise ValueError(f"nvfp4_w4a4_linear needs fp32 input scales [S], got {input_scale.dtype} "
                         f"{_shape(input_scale)}")
    return n, k


def act_global_scale(input_scale: torch.Tensor) -> torch.Tensor:
    """The activations' global scale, fp32 [1]: the largest of the parts' input scales (a device reduction)."""
    return input_scale.amax().reshape(1)


def nvfp4_w4a4_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                   input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] quantized to NVFP4 as the kernels quantize it (``nvfp4_act_quant_ref``, global scale
    :func:`act_global_scale`), dequantized to fp32 and multiplied by the dequantized weight in fp32 (a chunk of
    rows at a time, ``nvfp4_linear_ref``) -> [..., N] in x's dtype."""
    n, k = check_w4a4(x, weight, weight_scale, weight_scale_2, input_scale)
    g = act_global_scale(input_scale)
    rows = x.reshape(-1, k)
    values = nvfp4_act_dequant_ref(*nvfp4_act_quant_ref(rows, g), g, torch.float32)
    return nvfp4_linear_ref(values, weight, weight_scale, weight_scale_2).to(x.dtype).view(*x.shape[:-1], n)


def _fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
          input_scale: torch.Tensor) -> torch.Tensor:
    n, _ = check_w4a4(x, weight, weight_scale, weight_scale_2, input_scale)
    return x.new_empty(*x.shape[:-1], n)


@declare("nvfp4_w4a4_linear", fake=_fake, opaque=True)
def nvfp4_w4a4_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      weight_scale_2: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) quantized to NVFP4 with the input scale, times an NVFP4 weight (uint8 [N, K/2],
    e4m3 [N, K/16], fp32 per-part global scales [S]) -> [..., N] in x's dtype (W4A4)."""
    return nvfp4_w4a4_ref(x, weight, weight_scale, weight_scale_2, input_scale)


# ---- the GEMM on FP4 tensor cores ---------------------------------------------------------------


def scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor,
                    input_scale: torch.Tensor) -> bool:
    """The shapes the FP4 GEMM takes: K a multiple of 32 (the packed K a multiple of 16), each part's rows a
    multiple of 16, an output dtype it writes."""
    return fp4_gemm_takes(weight, weight_scale_2) and x.dtype in OUT_DTYPES and x.shape[-1] == 2 * weight.shape[-1]


def nvfp4_w4a4_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         weight_scale_2: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """:func:`nvfp4_w4a4_linear` on FP4 tensor cores: x quantized once (``nvfp4_act_quant``), then
    :func:`fp4_gemm`."""
    n, k = check_w4a4(x, weight, weight_scale, weight_scale_2, input_scale)
    g = act_global_scale(input_scale)
    q, s = nvfp4_act_quant(x.reshape(-1, k), g)
    return fp4_gemm(q, s, g, weight, weight_scale, weight_scale_2, x.dtype).view(*x.shape[:-1], n)


def _probe_scaled_mm(device: torch.device, out_dtype: torch.dtype) -> None:
    """The ``nvfp4_gemm`` op's self-test of ``scaled_mm``: on FP4 tensor cores only (capability >= 10.0), a few
    small problems (one row, two parts with their own global and input scales, more than 128 rows) against
    :func:`nvfp4_w4a4_ref` on the same device, then the routed experts' path once
    (``kernels.nvfp4_w4a4_moe.experts_self_test``); raises where it cannot run or is off."""
    if device.type != "cuda" or capability(device) < MIN_CAPABILITY:
        found = capability(device) if device.type == "cuda" else device.type
        raise RuntimeError(f"W4A4 needs FP4 tensor cores (compute capability >= {MIN_CAPABILITY}), got {found}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"W4A4 outputs one of {OUT_DTYPES}, got {out_dtype}")
    tolerance = 1e-3 if out_dtype == torch.float32 else 1e-2
    g = torch.Generator().manual_seed(0)
    for m, rows, k, parts in ((1, 128, 256, 1), (5, 144, 512, 2), (130, 256, 1024, 1)):
        n = rows * parts
        x = (torch.randn(m, k, generator=g) * torch.exp(torch.randn(1, k, generator=g))).to(out_dtype)
        weight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        weight_scale = (torch.rand(n, k // GROUP, generator=g) * 4 + 0.05).to(SCALE_DTYPE)
        weight_scale_2 = torch.rand(parts, generator=g) + 0.5
        input_scale = x.float().abs().amax() / (6 * 448) * torch.linspace(1.0, 1.5, parts)
        args = [t.to(device) for t in (x, weight, weight_scale, weight_scale_2, input_scale)]
        want = nvfp4_w4a4_ref(*args).float()
        got = nvfp4_w4a4_scaled_mm(*args)
        err, bound = float((got.float() - want).abs().max()), tolerance * float(want.abs().max()) + 1e-6
        if got.dtype != out_dtype or not err <= bound:
            raise backends.KernelMismatch(f"{got.dtype} output off the reference by {err:.3g} (allowed {bound:.3g}) "
                                          f"at M,N,K={m},{n},{k}")
    experts_self_test(device, out_dtype, tolerance)


# W4A4 GEMMs on CUDA: scaled_mm on FP4 operands where its self-test passes for the device and output dtype, else
# the same arithmetic by the Triton W4A16 kernel on the dequantized activations.
NVFP4_GEMM = backends.register(backends.KernelOp(
    "nvfp4_gemm", (backends.KernelBackend("scaled_mm", _probe_scaled_mm), backends.KernelBackend("triton")),
    forced=env.nvfp4_backend,
    env_var=env.NVFP4_BACKEND,
))


def w4a4_supported(device: torch.device | str, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``device`` runs W4A4 on FP4 tensor cores for ``out_dtype`` (``scaled_mm``'s self-test, run once per
    process, device and dtype; False off CUDA and below compute capability 10.0; inside a CUDA graph capture
    before the test ran it raises ``backends.KernelUndecided``)."""
    device = torch.device(device)
    return device.type == "cuda" and backends.passes("nvfp4_gemm", "scaled_mm", device, out_dtype)


nvfp4_w4a4_linear.implement("cuda", f"{__name__}:nvfp4_w4a4_scaled_mm", takes=scaled_mm_takes, traced="op",
                            backend=("nvfp4_gemm", "scaled_mm"))
# where scaled_mm is not chosen: the emulation on the W4A16 Triton kernel where the nvfp4_w4a16 op chose it, else
# the reference
nvfp4_w4a4_linear.implement("cuda", "epserve.kernels.nvfp4_triton:nvfp4_w4a4_triton", traced="op",
                            backend=("nvfp4_w4a16", "triton"))
nvfp4_w4a4_linear.implement("cuda", f"{__name__}:nvfp4_w4a4_ref", traced="op")
