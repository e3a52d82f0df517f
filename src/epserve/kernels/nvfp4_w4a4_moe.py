"""NVFP4 W4A4 for the routed experts: each expert's rows quantized to NVFP4 with that expert's input scale, then
the grouped SwiGLU on four-bit operands, as ``kernels.nvfp4_w4a4`` runs the linears.

``nvfp4_w4a4_moe_swiglu`` (declared once, ``kernels.opdef``; the custom op ``epserve::nvfp4_w4a4_moe_swiglu`` in a
trace) takes the experts' layout of ``kernels.nvfp4.nvfp4_moe_swiglu`` (x [R, H] grouped by local expert, the
counts [E] on the device, padding rows past their sum) and the checkpoint's activation scales per expert:
``w13_input_scale`` [E, 2] (gate's, up's) and ``w2_input_scale`` [E, 1]. As the ModelOpt MoE kernels of vLLM and
SGLang (their default, CUTLASS, path) quantize, expert e's rows use the larger of its gate's and up's input
scales as the global scale before w13, and its own w2 input scale before w2 (per expert, not the largest over
the experts). Its reference :func:`nvfp4_w4a4_moe_ref`, per expert over its rows (counts read on the host):
quantize (``nvfp4_act_quant_ref``), dequantize, times the dequantized w13 in fp32 (gate and up rounded to x's
dtype, as the GEMM writes them), ``silu(gate) * up`` in fp32 rounded to x's dtype, quantize with w2's input
scale, dequantize, times w2 in fp32. Rows past sum(counts) zero. W4A4 is lossy against the checkpoint's W4A16
oracle; it is tested against this reference.

On CUDA where the ``nvfp4_gemm`` op chose ``scaled_mm`` (FP4 tensor cores; the self-test runs
:func:`experts_self_test` too): :func:`nvfp4_w4a4_moe_scaled_mm` (:func:`experts_on_slabs`, which the tests also
run on the CPU with the GEMM's arithmetic), per local expert one quantization of all R
rows and one ``scaled_mm`` per GEMM part (``kernels.nvfp4_fp4_gemm``) on that fixed [R, K] slab, the expert's
rows selected from its output by their position against the counts' running sum on the device. Static shapes,
no host read: capturable. A row outside the expert's range (another expert's, a padding row, NaN or not) is
computed and discarded by a select, never mixed into a row that is read; padding rows come out zero. Its cost
is E x R rows per GEMM: a decode step's (reading each expert's weight once, which bounds it) is what it is for;
a large prefill pays E times the arithmetic. Elsewhere the reference runs (the model switches its experts to
W4A4 only where ``kernels.nvfp4_w4a4.w4a4_supported`` and the GEMM takes their shapes, :func:`fp4_experts_take`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from epserve.kernels import backends
from epserve.kernels.nvfp4 import GROUP, SCALE_DTYPE, check_nvfp4_experts, first_expert, nvfp4_linear_ref
from epserve.kernels.nvfp4_act import nvfp4_act_dequant_ref, nvfp4_act_quant, nvfp4_act_quant_ref
from epserve.kernels.nvfp4_fp4_gemm import OUT_DTYPES, fp4_gemm, fp4_gemm_takes
from epserve.kernels.opdef import declare

# the self-test's experts: E, H, I (K multiples of 32), its counts (one expert without rows) and NaN padding rows
TEST_EXPERTS = (3, 64, 32)
TEST_COUNTS = (2, 0, 5)
TEST_ROWS = 9


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_w4a4_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
                       w13_input_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                       w2_scale_2: torch.Tensor, w2_input_scale: torch.Tensor) -> None:
    """The experts' NVFP4 weights as ``kernels.nvfp4.check_nvfp4_experts`` checks them, x in bf16/fp16/fp32, fp32
    input scales [E, S] (one per expert and part)."""
    check_nvfp4_experts(x, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    if x.dtype not in OUT_DTYPES:
        raise ValueError(f"nvfp4_w4a4_moe_swiglu needs x in {OUT_DTYPES}, got {x.dtype}")
    for name, scale in (("w13_input_scale", w13_input_scale), ("w2_input_scale", w2_input_scale)):
        if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape[0] != w13.shape[0] or not scale.shape[1]:
            raise ValueError(f"nvfp4_w4a4_moe_swiglu needs {name} fp32 [{w13.shape[0]}, S], got {scale.dtype} "
                             f"{_shape(scale)}")


def expert_act_scales(w13_input_scale: torch.Tensor, w2_input_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each expert's activation global scales, fp32 [E] each: before w13 the larger of its parts' input scales,
    before w2 its own (device reductions)."""
    return w13_input_scale.amax(dim=1), w2_input_scale.amax(dim=1)


def _fp4_values(rows: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """rows quantized to NVFP4 with global scale g [1] and dequantized, fp32."""
    return nvfp4_act_dequant_ref(*nvfp4_act_quant_ref(rows, g), g, torch.float32)


def nvfp4_w4a4_moe_ref(
    x: torch.Tensor, counts: torch.Tensor | Sequence[int], w13: torch.Tensor, w13_scale: torch.Tensor,
    w13_scale_2: torch.Tensor, w13_input_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
    w2_scale_2: torch.Tensor, w2_input_scale: torch.Tensor, rows_per_expert: float | None = None,
    masked: bool = False,
) -> torch.Tensor:
    """The experts one at a time over their rows (see the module docstring; the tile hint unused, padding rows
    never read and zero)."""
    check_w4a4_experts(x, w13, w13_scale, w13_scale_2, w13_input_scale, w2, w2_scale, w2_scale_2, w2_input_scale)
    sizes = [int(n) for n in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if len(sizes) != w13.shape[0] or min(sizes, default=0) < 0 or sum(sizes) > x.shape[0]:
        raise ValueError(f"counts {sizes} must be {w13.shape[0]} values >= 0 summing to at most the {x.shape[0]} "
                         "rows of x")
    g13, g2 = expert_act_scales(w13_input_scale, w2_input_scale)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    start = 0
    for e, n in enumerate(sizes):
        if n:
            rows = _fp4_values(x[start : start + n], g13[e : e + 1])
            gate_up = nvfp4_linear_ref(rows, w13[e], w13_scale[e], w13_scale_2[e]).to(x.dtype)
            gate, up = gate_up.float().chunk(2, dim=-1)
            hidden = _fp4_values((F.silu(gate) * up).to(x.dtype), g2[e : e + 1])
            out[start : start + n] = nvfp4_linear_ref(hidden, w2[e], w2_scale[e], w2_scale_2[e]).to(x.dtype)
            start += n
    return out


def _fake(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
          w13_scale_2: torch.Tensor, w13_input_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
          w2_scale_2: torch.Tensor, w2_input_scale: torch.Tensor, rows_per_expert: float | None = None,
          masked: bool = False) -> torch.Tensor:
    check_w4a4_experts(x, w13, w13_scale, w13_scale_2, w13_input_scale, w2, w2_scale, w2_scale_2, w2_input_scale)
    return x.new_empty(x.shape[0], w2.shape[1])


@declare("nvfp4_w4a4_moe_swiglu", fake=_fake, opaque=True)
def nvfp4_w4a4_moe_swiglu(
    x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
    w13_input_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
    w2_input_scale: torch.Tensor, rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """Routed experts W4A4 on x [R, H] grouped by expert (counts [E]; a list of ints in eager calls): the NVFP4
    weights of ``kernels.nvfp4.nvfp4_moe_swiglu`` with the activations' input scales (``w13_input_scale`` [E, 2],
    ``w2_input_scale`` [E, 1], fp32) -> [R, H] in x's dtype, rows past sum(counts) zero (``masked`` too: the
    padding rows are never mixed into a real one). ``rows_per_expert``: unused (the GPU's tile hint)."""
    return nvfp4_w4a4_moe_ref(x, counts, w13, w13_scale, w13_scale_2, w13_input_scale, w2, w2_scale, w2_scale_2,
                              w2_input_scale)


# ---- on FP4 tensor cores ------------------------------------------------------------------------


def fp4_experts_take(w13: torch.Tensor, w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale_2: torch.Tensor) -> bool:
    """Whether the FP4 GEMM takes both of the experts' weights (H and I multiples of 32, each part's rows a
    multiple of 16): shapes only. Experts it does not take would run the reference, which reads the counts on the
    host, so the model keeps them W4A16 (``model.layers.use_w4a4``)."""
    return (fp4_gemm_takes(first_expert(w13), first_expert(w13_scale_2))
            and fp4_gemm_takes(first_expert(w2), first_expert(w2_scale_2)))


def scaled_mm_takes(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                    w13_scale_2: torch.Tensor, w13_input_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, w2_scale_2: torch.Tensor, w2_input_scale: torch.Tensor,
                    rows_per_expert: float | None = None, masked: bool = False) -> bool:
    """Weights the FP4 GEMM takes (:func:`fp4_experts_take`), an output dtype it writes and counts on x's
    device."""
    return (x.dtype in OUT_DTYPES and isinstance(counts, torch.Tensor) and counts.device == x.device
            and fp4_experts_take(w13, w13_scale_2, w2, w2_scale_2))


def nvfp4_w4a4_moe_scaled_mm(
    x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
    w13_input_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
    w2_input_scale: torch.Tensor, rows_per_expert: float | None = None, masked: bool = False,
) -> torch.Tensor:
    """:func:`nvfp4_w4a4_moe_swiglu` on FP4 tensor cores: :func:`experts_on_slabs` with ``fp4_gemm``."""
    return experts_on_slabs(fp4_gemm, x, counts, w13, w13_scale, w13_scale_2, w13_input_scale, w2, w2_scale,
                            w2_scale_2, w2_input_scale)


def experts_on_slabs(
    gemm: Callable[..., torch.Tensor], x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
    w13_scale: torch.Tensor, w13_scale_2: torch.Tensor, w13_input_scale: torch.Tensor, w2: torch.Tensor,
    w2_scale: torch.Tensor, w2_scale_2: torch.Tensor, w2_input_scale: torch.Tensor,
) -> torch.Tensor:
    """Per expert, all R rows quantized with its scale (``nvfp4_act_quant``), its two GEMMs on them by ``gemm``
    (``fp4_gemm``'s signature: on the GPU ``fp4_gemm`` itself, ``fp4_gemm_ref`` its arithmetic anywhere), its rows
    kept by a select against the counts' running sum (no host read)."""
    check_w4a4_experts(x, w13, w13_scale, w13_scale_2, w13_input_scale, w2, w2_scale, w2_scale_2, w2_input_scale)
    g13, g2 = expert_act_scales(w13_input_scale, w2_input_scale)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    row = torch.arange(x.shape[0], device=x.device).unsqueeze(1)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    # each expert's weights, scales and range as views (unbind, narrow: no integer index, so fake tensors run it)
    per_expert = zip(*(t.unbind(0) for t in (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)))
    for e, (w_13, s_13, s2_13, w_2, s_2, s2_2) in enumerate(per_expert):
        g = g13.narrow(0, e, 1)
        gate, up = gemm(*nvfp4_act_quant(x, g), g, w_13, s_13, s2_13, x.dtype).float().chunk(2, dim=1)
        g = g2.narrow(0, e, 1)
        y = gemm(*nvfp4_act_quant((F.silu(gate) * up).to(x.dtype), g), g, w_2, s_2, s2_2, x.dtype)
        out = torch.where((row >= starts.narrow(0, e, 1)) & (row < ends.narrow(0, e, 1)), y, out)
    return out


def _random_nvfp4(g: torch.Generator, e: int, n: int, k: int, parts: int) -> list[torch.Tensor]:
    """Random NVFP4 weights [e, n, k] with a global scale per expert and part, sized so an output is about as large
    as its input."""
    weight = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(e, n, k // GROUP, generator=g) * 4 + 0.05).to(SCALE_DTYPE)
    return [weight, scale, (torch.rand(e, parts, generator=g) + 0.5) / (16 * k**0.5)]


def experts_self_test(device: torch.device, out_dtype: torch.dtype, tolerance: float) -> None:
    """The experts' part of the ``nvfp4_gemm`` op's self-test of ``scaled_mm`` (``kernels.nvfp4_w4a4``): a few
    experts, one without rows, each with its own input scales (a wrong expert's scale shows), NaN padding rows,
    counts on the device, against :func:`nvfp4_w4a4_moe_ref` there; padding rows must come out zero."""
    (e, h, i), total = TEST_EXPERTS, sum(TEST_COUNTS)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(TEST_ROWS, h, generator=g) * torch.exp(torch.randn(1, h, generator=g))).to(out_dtype)
    x[total:] = float("nan")
    w13, w2 = _random_nvfp4(g, e, 2 * i, h, 2), _random_nvfp4(g, e, h, i, 1)
    amax = float(x[:total].float().abs().amax()) / (6 * 448)
    scales = [amax * (torch.rand(e, 2, generator=g) + 0.75), amax * (torch.rand(e, 1, generator=g) + 0.25) / 16]
    args = [t.to(device) for t in (x, *w13, scales[0], *w2, scales[1])]
    want = nvfp4_w4a4_moe_ref(args[0], TEST_COUNTS, *args[1:]).float()
    got = nvfp4_w4a4_moe_scaled_mm(args[0], torch.tensor(TEST_COUNTS, device=device), *args[1:])
    err = float((got.float() - want).abs().max())
    bound = tolerance * float(want.abs().max()) + 1e-6
    if got.dtype != out_dtype or not err <= bound:
        raise backends.KernelMismatch(f"W4A4 experts: {got.dtype} output off the reference by {err:.3g} (allowed "
                                      f"{bound:.3g}), counts {TEST_COUNTS}")


# CUDA: scaled_mm where the nvfp4_gemm op chose it for the device and dtype, else the reference (which reads the
# counts on the host: the model runs its experts W4A4 only where scaled_mm was chosen)
nvfp4_w4a4_moe_swiglu.implement("cuda", f"{__name__}:nvfp4_w4a4_moe_scaled_mm", takes=scaled_mm_takes, traced="op",
                                backend=("nvfp4_gemm", "scaled_mm"))
nvfp4_w4a4_moe_swiglu.implement("cuda", f"{__name__}:nvfp4_w4a4_moe_ref", traced="op")
