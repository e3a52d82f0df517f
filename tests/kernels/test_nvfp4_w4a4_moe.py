"""NVFP4 W4A4 routed experts (``kernels.nvfp4_w4a4_moe``): each expert's rows quantized to NVFP4 with that
expert's input scales, then the grouped SwiGLU on four-bit operands.

On the CPU: the reference against a plain loop over the rows (quantize one row, dequantize, GEMM with the
dequantized weights), per expert's scales (the largest of its gate's and up's before w13, its own before w2);
the CUDA implementation's slabs and select with the FP4 GEMM's arithmetic (``fp4_gemm_ref``) against the
reference; its calls on meta tensors (torch's meta kernels check each ``scaled_mm`` as a GPU would; a value read
on the host would raise there) and the implementations listed. With a GPU (``-m cuda``):
the op against the reference, by ``scaled_mm`` where the device passed its self-test, with NaN padding rows,
and captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_nvfp4_triton import make_experts, make_rows

from epserve.kernels import nvfp4_w4a4_moe
from epserve.kernels.nvfp4 import dequantize_rows
from epserve.kernels.nvfp4_act import nvfp4_act_dequant_ref, nvfp4_act_quant_ref
from epserve.kernels.nvfp4_fp4_gemm import fp4_gemm_ref
from epserve.kernels.nvfp4_w4a4_moe import nvfp4_w4a4_moe_ref, nvfp4_w4a4_moe_scaled_mm, nvfp4_w4a4_moe_swiglu

cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py), selected by the GPU check
E, H, INTER = 3, 64, 32


def _input_scales(x: torch.Tensor, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Input scales per expert and part, an expert's a few times another's (so using the wrong one shows)."""
    g = torch.Generator().manual_seed(seed)
    amax = float(x[~x.isnan().any(1)].float().abs().amax()) / (6 * 448)
    base = amax * torch.tensor([1.0, 4.0, 0.3]).unsqueeze(1)
    return base * (torch.rand(E, 2, generator=g) + 0.5), base * (torch.rand(E, 1, generator=g) + 0.5) / 4


def _row_by_row(x: torch.Tensor, counts: list[int], experts: tuple[torch.Tensor, ...], s13: torch.Tensor,
                s2: torch.Tensor) -> torch.Tensor:
    """The definition, one row at a time: the row quantized alone with its expert's scale, dequantized, times the
    dequantized weights in fp32 (gate and up, then the intermediate, rounded to x's dtype)."""
    w13, w13_s, w13_s2, w2, w2_s, w2_s2 = experts
    out = torch.zeros(x.shape[0], H, dtype=x.dtype)
    expert_of = [e for e, n in enumerate(counts) for _ in range(n)]
    for r, e in enumerate(expert_of):
        g13, g2 = s13[e].max().reshape(1), s2[e].reshape(1)
        a = nvfp4_act_dequant_ref(*nvfp4_act_quant_ref(x[r : r + 1], g13), g13, torch.float32)
        gate_up = (a @ dequantize_rows(w13[e], w13_s[e], w13_s2[e]).T).to(x.dtype).float()
        hidden = (F.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]).to(x.dtype)
        b = nvfp4_act_dequant_ref(*nvfp4_act_quant_ref(hidden, g2), g2, torch.float32)
        out[r] = (b @ dequantize_rows(w2[e], w2_s[e], w2_s2[e]).T).to(x.dtype)[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_row_by_row_definition(dtype):
    """Per expert, its own scales (not the largest over the experts: those differ fourfold here); padding rows
    (NaN) never read and zero; an expert without rows skipped; the op on the CPU is the reference."""
    counts = [3, 0, 4]
    experts = make_experts(E, H, INTER)
    x = make_rows(10, H, dtype, counts)
    s13, s2 = _input_scales(x)
    out = nvfp4_w4a4_moe_ref(x, torch.tensor(counts), experts[0], experts[1], experts[2], s13, *experts[3:], s2)
    want = _row_by_row(x, counts, experts, s13, s2)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-5}
    torch.testing.assert_close(out, want, **tol)
    assert out.dtype == dtype and not out[7:].any() and out[:7].abs().amin(dim=1).gt(0).all()
    one_scale = (s13.amax().expand(E, 2).contiguous(), s2.amax().expand(E, 1).contiguous())
    shared = nvfp4_w4a4_moe_ref(x, counts, *experts[:3], one_scale[0], *experts[3:], one_scale[1])
    assert not torch.allclose(shared[:7], out[:7], **tol)  # the convention is visible
    assert torch.equal(nvfp4_w4a4_moe_swiglu(x, counts, *experts[:3], s13, *experts[3:], s2), out)
    with pytest.raises(ValueError, match="w2_input_scale"):
        nvfp4_w4a4_moe_ref(x, counts, *experts[:3], s13, *experts[3:], s2.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slabs_and_select_equal_the_reference(dtype):
    """The CUDA implementation's structure (all rows per expert, the expert's rows selected against the counts'
    running sum on the device) with the FP4 GEMM's arithmetic (``fp4_gemm_ref``) on the CPU: the reference's
    output, NaN padding rows zero (never mixed in), an expert without rows and one with all but one."""
    experts = make_experts(E, H, INTER)
    for counts in ([3, 0, 4], [0, 9, 1]):
        x = make_rows(12, H, dtype, counts)
        s13, s2 = _input_scales(x)
        args = (*experts[:3], s13, *experts[3:], s2)
        got = nvfp4_w4a4_moe.experts_on_slabs(fp4_gemm_ref, x, torch.tensor(counts), *args)
        want = nvfp4_w4a4_moe_ref(x, counts, *args)
        torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-5)
        assert not got[sum(counts):].any() and got.dtype == dtype


def _meta_call(r: int, dtype: torch.dtype, reference: bool = False) -> torch.Tensor:
    """The CUDA implementation on meta tensors (as fake CUDA tensors, which a torch without CUDA cannot index)."""
    on = {"device": "meta"}
    x = torch.empty(r, H, dtype=dtype, **on)
    w13, w13_s = torch.empty(E, 2 * INTER, H // 2, dtype=torch.uint8, **on), torch.empty(E, 2 * INTER, H // 16, **on)
    w2, w2_s = torch.empty(E, H, INTER // 2, dtype=torch.uint8, **on), torch.empty(E, H, INTER // 16, **on)
    args = (x, torch.empty(E, dtype=torch.int64, **on), w13, w13_s.to(torch.float8_e4m3fn),
            torch.empty(E, 2, **on), torch.empty(E, 2, **on), w2, w2_s.to(torch.float8_e4m3fn),
            torch.empty(E, 1, **on), torch.empty(E, 1, **on))
    assert nvfp4_w4a4_moe.scaled_mm_takes(*args)
    return (nvfp4_w4a4_moe_ref if reference else nvfp4_w4a4_moe_scaled_mm)(*args, 2.0, True)


@pytest.mark.parametrize("r,dtype", [(1, torch.bfloat16), (24, torch.float16), (130, torch.float32)])
def test_scaled_mm_experts_pass_torch_checks_on_meta_tensors(r, dtype):
    """Each expert's two GEMMs (one per part of w13) through torch's meta checks of ``scaled_mm`` (what cuBLAS
    would be given: the swizzled scales' sizes, the layouts, the recipes): an [R, H] output in x's dtype, no value
    read on the host (a meta tensor has none: the reference, which reads the counts, raises there)."""
    out = _meta_call(r, dtype)
    assert tuple(out.shape) == (r, H) and out.dtype == dtype and out.is_meta
    if r == 1:
        with pytest.raises(Exception, match="meta"):
            _meta_call(r, dtype, reference=True)


def test_shapes_and_implementations():
    """scaled_mm only for shapes its GEMM takes and counts on the device; on CUDA it is listed only where the
    nvfp4_gemm op chose scaled_mm, the reference after it."""
    experts = make_experts(E, 48, INTER)  # H = 48: not a multiple of 32
    x = torch.zeros(4, 48)
    assert not nvfp4_w4a4_moe.scaled_mm_takes(x, torch.zeros(E), *experts[:3], torch.ones(E, 2), *experts[3:],
                                              torch.ones(E, 1))
    experts = make_experts(E, H, INTER)
    x = torch.zeros(4, H)
    assert nvfp4_w4a4_moe.scaled_mm_takes(x, torch.zeros(E), *experts[:3], torch.ones(E, 2), *experts[3:],
                                          torch.ones(E, 1))
    assert not nvfp4_w4a4_moe.scaled_mm_takes(x, [1, 1, 2], *experts[:3], torch.ones(E, 2), *experts[3:],
                                              torch.ones(E, 1))
    impls = nvfp4_w4a4_moe_swiglu.impls["cuda"]
    assert [(impl.target.rsplit(":", 1)[1], impl.backend) for impl in impls] == [
        ("nvfp4_w4a4_moe_scaled_mm", ("nvfp4_gemm", "scaled_mm")), ("nvfp4_w4a4_moe_ref", None)]
    assert "cpu" not in nvfp4_w4a4_moe_swiglu.impls


# ---- CUDA ---------------------------------------------------------------------------------------


def _cuda_case(dtype: torch.dtype, counts: list[int], r: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    experts = make_experts(E, H, INTER)
    x = make_rows(r, H, dtype, counts)
    s13, s2 = _input_scales(x)
    args = [t.cuda() for t in (x, torch.tensor(counts), *experts[:3], s13, *experts[3:], s2)]
    return args, nvfp4_w4a4_moe_ref(x, counts, *experts[:3], s13, *experts[3:], s2).float()


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_experts_op_matches_the_reference(dtype):
    """By ``scaled_mm`` where the device passed its self-test (FP4 tensor cores), else the reference: the real
    rows up to the GEMMs' summation order and the output rounding, the NaN padding rows zero."""
    from epserve.kernels.nvfp4_w4a4 import w4a4_supported
    from epserve.kernels.opdef import record_calls

    counts = [5, 0, 9]
    args, want = _cuda_case(dtype, counts, 20)
    with record_calls() as calls:
        got = nvfp4_w4a4_moe_swiglu(*args, 2.0, True).float().cpu()
    assert (got[:14] - want[:14]).abs().max() <= 2e-2 * want.abs().max() and not got[14:].any()
    used = "nvfp4_w4a4_moe_scaled_mm" if w4a4_supported("cuda", dtype) else "nvfp4_w4a4_moe_ref"
    assert {impl.rsplit(":", 1)[1] for name, impl in calls if name == "nvfp4_w4a4_moe_swiglu"} == {used}


@cuda
def test_cuda_graph_captures_the_w4a4_experts():
    from epserve.kernels.nvfp4_w4a4 import w4a4_supported

    if not w4a4_supported("cuda", torch.bfloat16):
        pytest.skip("no FP4 tensor cores: the experts run the reference, which reads the counts on the host")
    args, _ = _cuda_case(torch.bfloat16, [2, 3, 1], 8)
    nvfp4_w4a4_moe_swiglu(*args, 1.0, True)  # decided outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_w4a4_moe_swiglu(*args, 1.0, True)
    for counts in ([0, 4, 2], [6, 0, 0]):
        args[1].copy_(torch.tensor(counts))
        graph.replay()
        assert torch.equal(out, nvfp4_w4a4_moe_swiglu(*args, 1.0, True))
