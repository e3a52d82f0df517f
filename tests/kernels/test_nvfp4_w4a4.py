"""NVFP4 W4A4 (``kernels.nvfp4_w4a4``): activations quantized to NVFP4 with the checkpoint's input scale, then a
GEMM on four-bit operands.

On the CPU: the reference (lossless where x is NVFP4 already, so the input scale multiplies as ModelOpt's global
scales do; an FP4-sized error otherwise; parts with their own global scales, the largest input scale), the
swizzled block-scale layout against cuBLAS's index formula, and ``scaled_mm``'s call on fake CUDA tensors, whose
shape, stride, dtype and scale-size checks torch's meta kernel runs as a GPU would (the GEMM itself needs FP4
tensor cores). The self-test refuses Hopper. Under Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``,
as in ``test_nvfp4_triton.py``): the Triton emulation used where FP4 tensor cores are not, against the
reference. With a GPU (``-m cuda``): the op against the reference, by ``scaled_mm`` where the device passed its
self-test, and captured in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
import triton_harness
from test_nvfp4_triton import _host_reads, make_linear

from epserve.kernels import backends, nvfp4_w4a4
from epserve.kernels.device import assume_capability
from epserve.kernels.nvfp4 import GROUP, SCALE_DTYPE, nvfp4_linear_ref
from epserve.kernels.nvfp4_fp4_gemm import fp4_gemm, swizzle_scales
from epserve.kernels.nvfp4_w4a4 import nvfp4_w4a4_linear, nvfp4_w4a4_ref

cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py), selected by the GPU check
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nvfp4_rows(m: int, k: int, g: float, seed: int = 0) -> torch.Tensor:
    """fp32 rows [m, k] that NVFP4 with global scale ``g`` (a power of two) holds exactly: e2m1 magnitudes with
    random signs times e4m3 block scales times g, each block holding a 6 (so the quantizer finds that scale)."""
    gen = torch.Generator().manual_seed(seed)
    values = E2M1[torch.randint(0, 8, (m, k), generator=gen)] * (torch.randint(0, 2, (m, k), generator=gen) * 2 - 1)
    values.view(m, k // GROUP, GROUP)[:, :, 0] = 6.0
    scales = (torch.rand(m, k // GROUP, generator=gen) * 100 + 0.01).to(SCALE_DTYPE).float()
    return (values.view(m, k // GROUP, GROUP) * scales.unsqueeze(-1) * g).view(m, k)


def test_reference_is_lossless_on_nvfp4_activations():
    """x already NVFP4 with global scale g: W4A4 equals W4A16 bit for bit (x dequantizes to itself), whichever
    part's input scale is g (the largest is used); a wrong convention (g divided, not multiplied) would not."""
    w, ws, ws2 = make_linear(48, 64, parts=2)
    g = 2.0**-5
    x = nvfp4_rows(7, 64, g)
    for input_scale in (torch.tensor([g, g / 4]), torch.tensor([g / 2, g])):
        out = nvfp4_w4a4_ref(x, w, ws, ws2, input_scale)
        assert out.dtype == torch.float32 and torch.equal(out, nvfp4_linear_ref(x, w, ws, ws2))
    assert not torch.equal(nvfp4_w4a4_ref(x, w, ws, ws2, torch.tensor([g * 3])), nvfp4_linear_ref(x, w, ws, ws2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_error_is_an_fp4_rounding(dtype):
    """Random activations lose bits to e2m1 (a few percent, not more): W4A4 against W4A16 on the same weight; the
    rows are quantized one by one (one row alone gives the same output row); leading dimensions kept."""
    w, ws, ws2 = make_linear(40, 96, parts=2)
    x = torch.randn(2, 5, 96).to(dtype)
    input_scale = (x.float().abs().amax() / (6 * 448)).reshape(1)
    out = nvfp4_w4a4_ref(x, w, ws, ws2, input_scale)
    exact = nvfp4_linear_ref(x.float(), w, ws, ws2)
    assert out.shape == (2, 5, 80) and out.dtype == dtype
    err = ((out.float() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.15, err
    alone = nvfp4_w4a4_ref(x[1, 3:4], w, ws, ws2, input_scale)  # (the GEMM's summation order aside)
    torch.testing.assert_close(alone, out[1, 3:4], rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-4)
    assert torch.equal(nvfp4_w4a4_linear(x, w, ws, ws2, input_scale), out)  # the op on the CPU: the reference
    with pytest.raises(ValueError, match="input scales"):
        nvfp4_w4a4_ref(x, w, ws, ws2, input_scale.double())


@pytest.mark.parametrize("rows,cols", [(1, 1), (130, 6), (256, 8), (17, 128)])
def test_swizzled_scales_follow_cublas_layout(rows, cols):
    """Scale (r, c) at ``(r // 128 * ceil(C/4) + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4`` (the
    cuBLAS block-scaling-factor layout), every other byte of the padded tiles zero."""
    scales = (torch.rand(rows, cols, generator=torch.Generator().manual_seed(rows)) * 400 + 0.01).to(SCALE_DTYPE)
    flat = swizzle_scales(scales)
    col_tiles = -(-cols // 4)
    assert flat.dtype == SCALE_DTYPE and flat.numel() == -(-rows // 128) * 128 * col_tiles * 4
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    at = (r // 128 * col_tiles + c // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    bytes_ = flat.view(torch.uint8)
    assert torch.equal(bytes_[at.reshape(-1)], scales.view(torch.uint8).reshape(-1))
    rest = torch.ones(flat.numel(), dtype=torch.bool)
    rest[at.reshape(-1)] = False
    assert not bytes_[rest].any()


@pytest.mark.parametrize("m,rows,k,parts", [(1, 128, 256, 1), (5, 144, 512, 2), (130, 256, 1024, 1), (3, 7168, 96, 1)])
def test_scaled_mm_call_passes_torch_checks_on_fake_cuda(m, rows, k, parts):
    """The FP4 GEMM's call on fake CUDA tensors (torch's meta kernel checks what cuBLAS would be given: row-major
    A, column-major B, float4_e2m1fn_x2 data, the swizzled scales' sizes, the recipes): an [M, N] output, one GEMM
    per part; unswizzled scales are refused there, so the check sees a wrong layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    n = rows * parts
    with FakeTensorMode():
        on = {"device": "cuda"}
        q, s = torch.empty(m, k // 2, dtype=torch.uint8, **on), torch.empty(m, k // GROUP, dtype=SCALE_DTYPE, **on)
        w, ws = torch.empty(n, k // 2, dtype=torch.uint8, **on), torch.empty(n, k // GROUP, dtype=SCALE_DTYPE, **on)
        out = fp4_gemm(q, s, torch.empty(1, **on), w, ws, torch.empty(parts, **on), torch.bfloat16)
        assert tuple(out.shape) == (m, n) and out.dtype == torch.bfloat16
        assert nvfp4_w4a4.scaled_mm_takes(torch.empty(m, k, dtype=torch.bfloat16, **on), w, ws,
                                          torch.empty(parts, **on), torch.empty(parts, **on))
        if m % 128:  # the unswizzled scales have fewer than the padded tiles' elements
            from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

            recipe = [ScalingType.BlockWise1x16, ScalingType.TensorWise]
            swizzle = [SwizzleType.SWIZZLE_32_4_4, SwizzleType.NO_SWIZZLE]
            g = torch.empty(1, **on)
            with pytest.raises(RuntimeError, match="scale_a must have"):
                scaled_mm(q.view(torch.float4_e2m1fn_x2), w.view(torch.float4_e2m1fn_x2).t(), [s, g], recipe,
                          [swizzle_scales(ws), g], recipe, swizzle_a=swizzle, swizzle_b=swizzle)


def test_shapes_the_fp4_gemm_does_not_take():
    x, w, ws, ws2 = torch.empty(3, 48), torch.empty(32, 24, dtype=torch.uint8), torch.empty(32, 3), torch.ones(1)
    assert not nvfp4_w4a4.scaled_mm_takes(x, w, ws, ws2, ws2)  # K = 48: not a multiple of 32
    x, w = torch.empty(3, 64), torch.empty(40, 32, dtype=torch.uint8)
    assert not nvfp4_w4a4.scaled_mm_takes(x, w, ws, torch.ones(2), ws2)  # parts of 20 rows


def test_self_test_refuses_hopper_and_the_cpu():
    """W4A4 runs on FP4 tensor cores only: the self-test raises below compute capability 10.0 before touching
    the device, the CPU never supports it, and the op's fallback is the Triton emulation."""
    with assume_capability((9, 0)), pytest.raises(RuntimeError, match="compute capability"):
        nvfp4_w4a4._probe_scaled_mm(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(RuntimeError, match="FP4 tensor cores"):
        nvfp4_w4a4._probe_scaled_mm(torch.device("cpu"), torch.bfloat16)
    assert not nvfp4_w4a4.w4a4_supported("cpu")
    assert backends.get_op("nvfp4_gemm").fallback == "triton"
    assert [impl.target.rsplit(":", 1)[1] for impl in nvfp4_w4a4_linear.impls["cuda"]] == [
        "nvfp4_w4a4_scaled_mm", "nvfp4_w4a4_triton", "nvfp4_w4a4_ref"]
    # the emulation only where the W4A16 Triton kernels passed their own self-test; else the reference
    assert [impl.backend for impl in nvfp4_w4a4_linear.impls["cuda"]] == [
        ("nvfp4_gemm", "scaled_mm"), ("nvfp4_w4a16", "triton"), None]


def test_fake_implementation_gives_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y = torch.ops.epserve.nvfp4_w4a4_linear(torch.empty(2, 3, 64), torch.empty(96, 32, dtype=torch.uint8),
                                                torch.empty(96, 4, dtype=SCALE_DTYPE), torch.empty(2), torch.empty(2))
    assert tuple(y.shape) == (2, 3, 96)


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_triton_emulation(nt) -> None:
    """Where FP4 tensor cores are not: the quantized activations through the W4A16 kernel in fp32, as the
    reference computes them (fp32 to a summation order; bf16 to an output rounding), no value read on the
    host."""
    for n, k, parts, m in [(48, 64, 2, 7), (70, 144, 1, 33)]:
        w, ws, ws2 = make_linear(n, k, parts, seed=k)
        for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2**-7)):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            input_scale = (x.float().abs().amax() / (6 * 448) * torch.linspace(1, 1.25, parts)).float()
            ref = nvfp4_w4a4_ref(x, w, ws, ws2, input_scale)
            out = nt.nvfp4_w4a4_triton(x, w, ws, ws2, input_scale)
            err, scale = (out.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
            assert out.dtype == dtype and out.shape == ref.shape and err <= tolerance * scale, (n, k, dtype, err)
    x = torch.randn(2, 3, 64)
    out, reads = _host_reads(lambda: nt.nvfp4_w4a4_triton(x, *make_linear(16, 64), torch.tensor([0.01])))
    assert out.shape == (2, 3, 16) and reads == [], reads  # capturable: no value read on the host


INTERP_CASES = {"triton_emulation": _case_triton_emulation}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


# ---- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_op_matches_the_reference(dtype):
    """By ``scaled_mm`` where the device passed its self-test (FP4 tensor cores), else the Triton emulation: the
    reference's output up to the GEMM's summation order and the output rounding."""
    from epserve.kernels.opdef import record_calls

    w, ws, ws2 = make_linear(160, 512, parts=2)
    with record_calls() as calls:
        for m in (1, 17, 130):
            x = torch.randn(m, 512).to(dtype)
            input_scale = (x.float().abs().amax() / (6 * 448) * torch.tensor([1.0, 1.2])).float()
            want = nvfp4_w4a4_ref(x, w, ws, ws2, input_scale).float()
            got = nvfp4_w4a4_linear(*(t.cuda() for t in (x, w, ws, ws2, input_scale))).float().cpu()
            assert (got - want).abs().max() <= 1e-2 * want.abs().max()
    fp4 = nvfp4_w4a4.w4a4_supported("cuda", dtype)
    used = "nvfp4_w4a4_scaled_mm" if fp4 else "nvfp4_w4a4_triton"
    assert {impl.rsplit(":", 1)[1] for name, impl in calls if name == "nvfp4_w4a4_linear"} == {used}


@cuda
def test_cuda_graph_captures_the_w4a4_linear():
    w, ws, ws2 = (t.cuda() for t in make_linear(128, 256))
    x = torch.randn(8, 256, dtype=torch.bfloat16, device="cuda")
    input_scale = (x.float().abs().amax() / (6 * 448)).reshape(1)
    nvfp4_w4a4_linear(x, w, ws, ws2, input_scale)  # decide and compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4_w4a4_linear(x, w, ws, ws2, input_scale)
    for _ in range(2):
        x.copy_(torch.randn(8, 256, dtype=torch.bfloat16, device="cuda") / 2)
        graph.replay()
        assert torch.equal(out, nvfp4_w4a4_linear(x, w, ws, ws2, input_scale))


def _interpreter_main() -> None:
    from epserve.kernels import nvfp4_triton

    triton_harness.report_cases(INTERP_CASES, nvfp4_triton)


if __name__ == "__main__":
    _interpreter_main()
