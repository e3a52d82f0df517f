"""Grouped SwiGLU experts (``kernels.grouped``, ``kernels.grouped_triton``) and the FP8 experts on a
quantized payload (``kernels.fp8_layers.fp8_moe_swiglu_quantized``, ``moe.experts.GroupedExperts``).

The torch reference is checked against each row computed on its own; the Triton grouped GEMM against
the reference under Triton's interpreter (in a subprocess with ``TRITON_INTERPRET=1``, so no other test
sees interpreted kernels) for fp32, fp16 and bf16, experts with no rows and trailing padding rows
included; with CUDA, the front end on the GPU and under CUDA-graph capture. Running this file as a
script runs the interpreter cases and prints their results as JSON.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
import triton_harness

from epserve.checkpoint import fp8_block_quantize
from epserve.kernels import fp8, fp8_layers, grouped
from epserve.moe.dispatch.base import ExpertInput
from epserve.moe.experts import GroupedExperts

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py), selected by the GPU check
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (rows, counts): empty experts, trailing padding rows, all padding, one expert with every row, no rows
CASES = [(17, [3, 0, 9, 4]), (20, [0, 5, 0, 2]), (9, [0, 0, 0, 0]), (6, [6, 0, 0, 0]), (1, [0, 0, 1, 0]),
         (0, [0, 0, 0, 0])]
# tolerance of the kernel (fp32 accumulation, one rounding of silu(gate) * up) against the reference
# (the model dtype after each op), relative to the output's largest value
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


# ---- data and comparisons (also used by the interpreter subprocess) -----------------------------


def make_experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(dtype)
    return w13, (torch.randn(e, h, i, generator=g) / i**0.5).to(dtype)


def make_rows(r: int, h: int, dtype: torch.dtype, counts: list[int], seed: int = 1) -> torch.Tensor:
    """Rows grouped by expert; the padding rows past sum(counts) are NaN, so any read of them shows."""
    x = torch.randn(r, h, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x[sum(counts):] = float("nan")
    return x


def assert_grouped_close(out: torch.Tensor, ref: torch.Tensor, counts: list[int]) -> None:
    total = sum(counts)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.equal(out[total:], torch.zeros_like(out[total:])), "padding rows must come out zero"
    if total:
        err = (out[:total].float() - ref[:total].float()).abs().max().item()
        scale = ref[:total].float().abs().max().item()
        assert err <= TOLERANCE[out.dtype] * scale, (out.dtype, counts, err, scale)


# ---- the reference and the FP8 payload (CPU) ----------------------------------------------------


@pytest.mark.parametrize("rows,counts", CASES)
def test_reference_matches_each_row_alone(rows, counts):
    w13, w2 = make_experts(4, 48, 40, torch.float32)
    x = make_rows(rows, 48, torch.float32, counts)
    out = grouped.grouped_swiglu_ref(x, torch.tensor(counts), w13, w2)
    experts = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    for row, e in enumerate(experts.tolist()):
        gate, up = (w13[e].double() @ x[row].double()).chunk(2)
        torch.testing.assert_close(out[row].double(), w2[e].double() @ (F.silu(gate) * up), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[sum(counts):], torch.zeros(rows - sum(counts), 48))


def test_bad_input_is_named():
    w13, w2 = make_experts(4, 48, 40, torch.float32)
    x, counts = torch.zeros(5, 48), torch.tensor([1, 1, 1, 1])
    with pytest.raises(ValueError, match="counts"):
        grouped.check_grouped_swiglu(x, counts[:3], w13, w2)
    with pytest.raises(ValueError, match="dtype"):
        grouped.check_grouped_swiglu(x, counts, w13.half(), w2)
    with pytest.raises(ValueError, match="shapes do not match"):
        grouped.check_grouped_swiglu(torch.zeros(5, 32), counts, w13, w2)
    with pytest.raises(ValueError, match="sum to at most"):
        grouped.grouped_swiglu_ref(x, [2, 2, 2, 0], w13, w2)


def fp8_experts(e: int = 4, h: int = 256, i: int = 128, seed: int = 2) -> tuple[torch.Tensor, ...]:
    """w13 fp8 [E, 2I, H], its scales, w2 fp8 [E, H, I], its scales."""
    w13, w2 = make_experts(e, h, i, torch.float32, seed)
    q13, q2 = [fp8_block_quantize(w) for w in w13], [fp8_block_quantize(w) for w in w2]
    return tuple(torch.stack(t) for t in (*zip(*q13), *zip(*q2)))


@pytest.mark.parametrize("rows,counts", [(20, [3, 0, 9, 4]), (8, [0, 0, 0, 0]), (5, [0, 5, 0, 0])])
def test_fp8_on_a_quantized_payload_is_fp8_moe_swiglu(rows, counts):
    """act_quant(x), then the experts on (q, scales): the same bits as fp8_moe_swiglu(x), padding rows too."""
    w13, s13, w2, s2 = fp8_experts()
    x = make_rows(rows, 256, torch.bfloat16, counts)
    want = fp8_layers.fp8_moe_swiglu(x, torch.tensor(counts), w13, s13, w2, s2)
    q, s = fp8.act_quant(x)
    got = fp8_layers.fp8_moe_swiglu_quantized(q, s, torch.tensor(counts), w13, s13, w2, s2, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(got[sum(counts):], torch.zeros(rows - sum(counts), 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32 scales"):
        fp8_layers.fp8_moe_swiglu_quantized(q, s[:, :1], counts, w13, s13, w2, s2, torch.bfloat16)


def test_experts_take_an_fp8_payload():
    counts = torch.tensor([3, 0, 9, 4])
    x = make_rows(20, 256, torch.bfloat16, counts.tolist())
    q, s = fp8.act_quant(x)
    payload = ExpertInput(q, counts, scales=s)
    experts = GroupedExperts(4, 256, 128, fp8=True)
    experts.w13.data, experts.w13_scale_inv.data, experts.w2.data, experts.w2_scale_inv.data = fp8_experts()
    with pytest.raises(ValueError, match="act_dtype"):
        experts(payload)
    experts.act_dtype = torch.bfloat16
    want = experts(ExpertInput(x, counts))
    got = experts(payload)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # experts in the model dtype dequantize the payload: close to the same experts on x itself
    plain = GroupedExperts(4, 256, 128)
    plain.w13.data, plain.w2.data = make_experts(4, 256, 128, torch.bfloat16)
    ref, out = plain(ExpertInput(x, counts)), plain(payload)
    assert out.dtype == torch.bfloat16 and torch.equal(out[16:], torch.zeros(4, 256, dtype=torch.bfloat16))
    assert ((out[:16].float() - ref[:16].float()).norm() / ref[:16].float().norm()).item() < 0.05


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_interpreted(gt) -> None:
    assert type(gt._grouped_gemm_kernel).__name__ == "InterpretedFunction", type(gt._grouped_gemm_kernel)


def _case_grouped_swiglu(gt) -> None:
    for dtype in DTYPES:
        w13, w2 = make_experts(4, 48, 40, dtype, seed=3)  # neither dimension a multiple of a tile
        for rows, counts in CASES:
            x = make_rows(rows, 48, dtype, counts, seed=rows)
            ref = grouped.grouped_swiglu_ref(x, counts, w13, w2)
            for c in (torch.tensor(counts), counts):
                assert_grouped_close(gt.grouped_swiglu_triton(x, c, w13, w2), ref, counts)


def _case_plain_gemm(gt) -> None:
    """The down projection alone (no SwiGLU), against one matmul per expert, and skewed tiles (64 rows)."""
    b = torch.randn(3, 24, 72, generator=torch.Generator().manual_seed(4))
    for rows, counts in [(150, [70, 0, 75]), (10, [0, 0, 4])]:
        a = make_rows(rows, 72, torch.float32, counts, seed=5)
        out = gt.grouped_gemm_triton(a, b, torch.tensor(counts))
        experts = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
        ref = torch.cat([torch.bmm(a[: sum(counts), None], b[experts].transpose(1, 2))[:, 0],
                         torch.zeros(rows - sum(counts), 24)])
        assert_grouped_close(out, ref, counts)


def _case_fp8_front_end_on_a_payload(gt) -> None:
    """Through the CUDA route (Triton quantization and grouped FP8 GEMMs, forced on CPU tensors): the
    quantized payload gives the same bits as fp8_moe_swiglu on the rows it came from."""
    on_cuda = fp8._on_cuda
    fp8._on_cuda = lambda t: True
    try:
        w13, s13, w2, s2 = fp8_experts(e=3, h=128, i=128)
        counts = [4, 0, 7]
        x = make_rows(13, 128, torch.bfloat16, counts)
        want = fp8_layers.fp8_moe_swiglu(x, torch.tensor(counts), w13, s13, w2, s2)
        q, s = fp8.act_quant(x)
        assert s.stride() == (1, 13)  # the CUDA route's M-major scales
        got = fp8_layers.fp8_moe_swiglu_quantized(q, s, torch.tensor(counts), w13, s13, w2, s2, torch.bfloat16)
        assert torch.equal(got, want) and torch.equal(got[11:], torch.zeros(2, 128, dtype=torch.bfloat16))
    finally:
        fp8._on_cuda = on_cuda


def _case_masked_decode_tile(gt) -> None:
    """A decode-shaped masked input: 32 experts, 2 real rows each expected, 24x as many padding rows (the
    symm_mem dispatcher's N). The tile comes from the expected real rows (16, not the padded rows' 64); the
    tile map gives the padding rows (NaN) no tile, so they are neither read nor written, and the real rows
    equal the unmasked call's bit for bit."""
    from epserve.kernels import fp8_triton

    experts, h, i = 32, 64, 32
    counts = [2] * 30 + [0, 4]
    rows = 48 * experts  # N: ep * tokens * min(K, S) with heavy padding
    assert fp8_triton.grouped_tile_m(rows, experts) == 64  # what the padded rows alone would pick
    assert fp8_triton.grouped_tile_m(rows, experts, rows_per_expert=2.0) == 16
    w13, w2 = make_experts(experts, h, i, torch.float32, seed=6)
    x = make_rows(rows, h, torch.float32, counts, seed=7)
    ref = gt.grouped_swiglu_triton(x, torch.tensor(counts), w13, w2)
    total = sum(counts)
    for hint in (None, 2.0):
        got = gt.grouped_swiglu_triton(x, torch.tensor(counts), w13, w2, rows_per_expert=hint, masked=True)
        assert torch.equal(got[:total], ref[:total]), hint
    # the tile map: no tile for the padding rows when masked
    expert, first, end = fp8_triton._tile_map(torch.tensor(counts), rows, rows // 16 + experts, 16, masked=True)
    assert int((expert == experts).sum()) == 0 and int((expert < experts).sum()) == 31
    expert, _, _ = fp8_triton._tile_map(torch.tensor(counts), rows, rows // 16 + experts, 16)
    assert int((expert == experts).sum()) == -(-(rows - total) // 16)


def _case_fp8_masked_tile(gt) -> None:
    """The grouped FP8 GEMM on a masked input with NaN padding: the real rows equal the unpadded call's."""
    from epserve.kernels import fp8_triton

    w13, s13, _, _ = fp8_experts(e=3, h=128, i=128)
    counts = [1, 0, 2]
    x = make_rows(60, 128, torch.bfloat16, counts)
    q, s = fp8.act_quant(x[:3])
    q = torch.cat([q, torch.full((57, 128), 0x7F, dtype=torch.uint8).view(q.dtype)])  # NaN padding
    s = torch.cat([s, torch.full((57, 1), float("nan"))])
    want = fp8_triton.grouped_block_fp8_gemm_triton(q[:3], s[:3], w13, s13, torch.tensor(counts), torch.bfloat16)
    got = fp8_triton.grouped_block_fp8_gemm_triton(q, s, w13, s13, torch.tensor(counts), torch.bfloat16,
                                                   rows_per_expert=1.0, masked=True)
    assert torch.equal(got[:3], want)


def _case_gather_real_rows(gt) -> None:
    """The symm_mem dispatcher's masked gather: the real rows (a count on the device) from a wider buffer at
    a column offset, the rest untouched."""
    from epserve.kernels import moe_triton

    src = torch.arange(7 * 600, dtype=torch.float32).view(7, 600)
    index = torch.tensor([5, 0, 3, 6, 6, 6])
    out = torch.full((6, 520), -1.0)
    moe_triton.gather_real_rows_triton(out, src, index, torch.tensor([3]), 40)
    assert torch.equal(out[:3], src[[5, 0, 3], 40:560]) and torch.equal(out[3:], torch.full((3, 520), -1.0))
    bytes_out = torch.zeros(6, 9, dtype=torch.uint8)
    moe_triton.gather_real_rows_triton(bytes_out, src.view(torch.uint8), index, torch.tensor([0]), 0)
    assert not bytes_out.any()


INTERP_CASES = {"interpreted": _case_interpreted, "grouped_swiglu": _case_grouped_swiglu,
                "plain_gemm": _case_plain_gemm, "fp8_payload": _case_fp8_front_end_on_a_payload,
                "masked_decode_tile": _case_masked_decode_tile, "fp8_masked_tile": _case_fp8_masked_tile,
                "gather_real_rows": _case_gather_real_rows}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


@pytest.mark.parametrize("dtype,arch", [("fp32", 80), ("bf16", 80), ("fp16", 90)])
def test_triton_grouped_kernel_compiles_for_the_gpu(dtype, arch):
    """The kernel lowers for Ampere and Hopper in each dtype without a GPU (Triton's own ptxas): the fused
    SwiGLU tile, IEEE fp32 dots, 16-bit dots."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernel)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import grouped_triton as gt

    ints = "R N K E stride_am stride_be stride_bn stride_cm".split()
    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}", "tile_expert_ptr": "*i32",
           "tile_row_ptr": "*i32", "tile_end_ptr": "*i32", **dict.fromkeys(ints, "i32"),
           **dict.fromkeys(["SWIGLU", "PRECISION", "EMULATE", "BM", "BN", "BK"], "constexpr")}
    consts = {"SWIGLU": True, "PRECISION": "ieee" if dtype == "fp32" else "tf32", "EMULATE": False, "BM": 16,
              "BN": gt.BN, "BK": 32 if dtype == "fp32" else 64}
    kernel = compile(ASTSource(gt._grouped_gemm_kernel, sig, consts), target=GPUTarget("cuda", arch, 32),
                     options=gt._OPTS)
    assert ".entry" in kernel.asm["ptx"]


@pytest.mark.parametrize("dtype,arch", [("u8", 90), ("bf16", 80)])
def test_masked_gather_kernel_compiles_for_the_gpu(dtype, arch):
    """The symm_mem dispatcher's masked gather (``kernels.moe_triton``) lowers without a GPU: the early return
    on the real-row count read on the device, 64-bit row offsets."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernel)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import moe_triton

    sig = {"out_ptr": f"*{dtype}", "src_ptr": f"*{dtype}", "index_ptr": "*i64", "total_ptr": "*i64",
           **dict.fromkeys("N C col0 stride_out stride_src".split(), "i32"), "BR": "constexpr", "BC": "constexpr"}
    kernel = compile(ASTSource(moe_triton._gather_rows_kernel, sig, {"BR": moe_triton.ROWS, "BC": moe_triton.COLS}),
                     target=GPUTarget("cuda", arch, 32), options=moe_triton._OPTS)
    assert ".entry" in kernel.asm["ptx"]


# ---- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_front_end_matches_the_reference(dtype):
    w13, w2 = make_experts(4, 256, 128, dtype)
    for rows, counts in CASES:
        x = make_rows(rows, 256, dtype, counts)
        out = grouped.grouped_swiglu(x.cuda(), torch.tensor(counts).cuda(), w13.cuda(), w2.cuda())
        assert_grouped_close(out.cpu(), grouped.grouped_swiglu_ref(x, counts, w13, w2), counts)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_graph_captures_the_grouped_experts(dtype):
    """No host read: capture once, replay with new counts written in place (padding rows NaN)."""
    w13, w2 = (w.cuda() for w in make_experts(8, 256, 128, dtype))
    x = make_rows(64, 256, dtype, [8] * 8).cuda()
    counts = torch.tensor([8] * 8, device="cuda")
    grouped.grouped_swiglu(x, counts, w13, w2)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped.grouped_swiglu(x, counts, w13, w2)
    for new in ([64, 0, 0, 0, 0, 0, 0, 0], [0, 3, 0, 40, 1, 0, 0, 7], [1, 2, 3, 4, 5, 6, 7, 8]):
        counts.copy_(torch.tensor(new))
        x[sum(new):] = float("nan")
        graph.replay()
        assert_grouped_close(out.cpu(), grouped.grouped_swiglu_ref(x.cpu(), new, w13.cpu(), w2.cpu()), new)


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_masked_experts_capture_and_keep_the_real_rows(dtype):
    """A masked decode-shaped input, captured: the real rows equal the unmasked call's on every replay."""
    w13, w2 = (w.cuda() for w in make_experts(16, 256, 128, dtype))
    x = make_rows(16 * 32, 256, dtype, [2] * 16).cuda()
    counts = torch.tensor([2] * 16, device="cuda")
    grouped.grouped_swiglu(x, counts, w13, w2, 2.0, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped.grouped_swiglu(x, counts, w13, w2, 2.0, True)
    for new in ([2] * 16, [0, 5, 0, 1] * 4, [32] + [0] * 15):
        counts.copy_(torch.tensor(new))
        x[sum(new):] = float("nan")
        graph.replay()
        total = sum(new)
        assert_grouped_close(out[:total].cpu(), grouped.grouped_swiglu_ref(x[:total].cpu(), new, w13.cpu(),
                                                                            w2.cpu()), new)


def _interpreter_main() -> None:
    from epserve.kernels import grouped_triton

    triton_harness.report_cases(INTERP_CASES, grouped_triton)


if __name__ == "__main__":
    _interpreter_main()
