"""Block-scaled FP8 kernels (``kernels.fp8``, ``kernels.fp8_triton``).

The torch reference is checked against plain dequantize-everything fp32 math; the Triton kernels
against the reference under Triton's interpreter (in a subprocess with ``TRITON_INTERPRET=1``, so no
other test sees interpreted kernels); with CUDA, ``test_fp8_cuda.py`` checks the front ends on the GPU
against the reference on the CPU. Running this file as a script runs the interpreter cases and prints
their results as JSON.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import triton_harness

from epserve import env
from epserve.checkpoint import fp8_block_dequantize, fp8_block_quantize
from epserve.kernels import fp8, fp8_layers
from epserve.kernels.fp8 import BLOCK, FP8_DTYPE, FP8_MAX, MIN_AMAX, cdiv

SHAPES_NK = [(128, 128), (160, 200), (256, 384), (160, 384)]
HAS_TRITON = importlib.util.find_spec("triton") is not None


# ---- data and comparisons (also used by the interpreter subprocess) -----------------------------


def make_act(m: int, k: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Gaussian rows with column magnitudes spread over ~4 decades; row 1 starts with a zero group."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(1, k, generator=g))
    if m > 2:
        x[1, : min(k, BLOCK)] = 0
    return x.to(dtype)


def make_weight(n: int, k: int, experts: int | None = None, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """fp8 [N, K] (or [E, N, K]) and its 128x128 scales, tile magnitudes spread over 3 decades."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(experts or 1):
        tiles = 10 ** (3 * torch.rand(cdiv(n, BLOCK), cdiv(k, BLOCK), generator=g) - 2)
        tiles = tiles.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
        pairs.append(fp8_block_quantize(torch.randn(n, k, generator=g) * tiles))
    return pairs[0] if experts is None else tuple(torch.stack(t) for t in zip(*pairs))


def deq_act(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.float().repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]


def assert_quant_close(q, s, q_ref, s_ref, exact: bool) -> None:
    """Exact: same scales, same fp8 values. Else (another exp/amax rounding): scales within 1e-5 and
    values at most one e4m3 step apart (<= 2^-3 |v| + 2^-9) in at most 1% of the elements."""
    assert q.dtype == FP8_DTYPE and q.shape == q_ref.shape and s.shape == s_ref.shape
    v, v_ref, s = q.float().cpu(), q_ref.float(), s.float().cpu()
    torch.testing.assert_close(s, s_ref, rtol=0 if exact else 1e-5, atol=0)
    diff = (v - v_ref).abs()
    assert bool((diff <= v_ref.abs() * 2**-3 + 2**-9).all())
    assert diff.gt(0).float().mean().item() <= (0 if exact else 0.01) if diff.numel() else True


def assert_gemm_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol_rel: float) -> None:
    """|out - ref| <= rtol |ref| + atol_rel max|ref| elementwise."""
    assert out.shape == ref.shape
    out, ref = out.float().cpu(), ref.float()
    if ref.numel():
        bound = rtol * ref.abs() + atol_rel * ref.abs().max() + 1e-30
        assert bool(((out - ref).abs() <= bound).all()), f"max err {(out - ref).abs().max().item():.3g}"


def dense_gemm(q, s, w, ws) -> torch.Tensor:
    """Dequantize everything, multiply in fp64."""
    return (deq_act(q, s).double() @ fp8_block_dequantize(w, ws).double().t()).float()


# ---- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [128, 200, 384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_quant_ref_round_trip(k, dtype):
    """Per element |x - deq(q(x))| <= 2^-4 |x| + 2^-10 s: RNE to e4m3 (3 mantissa bits) errs by at most
    half a step, 2^-4 of |x|'s binade, or half the subnormal step 2^-9 (x/s below 2^-6)."""
    x = make_act(7, k, dtype=dtype)
    q, s = fp8.act_quant_ref(x)
    assert (q.dtype, q.shape, s.dtype, s.shape) == (FP8_DTYPE, (7, k), torch.float32, (7, cdiv(k, BLOCK)))
    groups = F.pad(x.float(), (0, cdiv(k, BLOCK) * BLOCK - k)).view(7, -1, BLOCK)
    torch.testing.assert_close(s, groups.abs().amax(2).clamp(min=MIN_AMAX) / FP8_MAX, rtol=0, atol=0)
    assert s[1, 0] == torch.tensor(MIN_AMAX) / FP8_MAX and not q[1, :BLOCK].float().any()  # the zero group
    bound = 2**-4 * x.float().abs() + 2**-10 * s.repeat_interleave(BLOCK, 1)[:, :k]
    assert bool(((x.float() - deq_act(q, s)).abs() <= bound * (1 + 1e-6)).all())
    q_amax = F.pad(q.float().abs(), (0, cdiv(k, BLOCK) * BLOCK - k)).view(7, -1, BLOCK).amax(2)
    assert bool(((q_amax == FP8_MAX) | (s == s[1, 0])).all())  # every nonzero group reaches +-448


def test_silu_mul_quant_ref():
    gu = make_act(5, 400)
    want = fp8.act_quant_ref(F.silu(gu[:, :200].float()) * gu[:, 200:].float())
    assert_quant_close(*fp8.silu_mul_quant_ref(gu), *want, exact=True)


@pytest.mark.parametrize("m", [0, 1, 5, 130])
@pytest.mark.parametrize("n,k", SHAPES_NK)
def test_block_gemm_ref_matches_dequantized(m, n, k):
    q, s = fp8.act_quant_ref(make_act(m, k))
    w, ws = make_weight(n, k)
    out = fp8.block_fp8_gemm_ref(q, s, w, ws, torch.float32)
    assert_gemm_close(out, dense_gemm(q, s, w, ws), rtol=1e-5, atol_rel=1e-6)
    assert fp8.block_fp8_gemm_ref(q, s, w, ws, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("counts", [[3, 0, 9, 5], [17, 0, 0, 0], [0, 0, 0, 0], [1, 2, 0, 4]])
def test_grouped_ref_matches_per_expert(counts):
    """Experts with no rows are skipped; rows past sum(counts) (padding) come out zero."""
    q, s = fp8.act_quant_ref(make_act(17, 200))
    w, ws = make_weight(160, 200, experts=4)
    out = fp8.grouped_block_fp8_gemm_ref(q, s, w, ws, torch.tensor(counts), torch.float32)
    start, want = 0, torch.zeros(17, 160)
    for e, c in enumerate(counts):
        want[start : start + c] = dense_gemm(q[start : start + c], s[start : start + c], w[e], ws[e])
        start += c
    assert_gemm_close(out, want, rtol=1e-5, atol_rel=1e-6)


def test_fp8_linear_close_to_bf16_linear():
    """Against F.linear(x, bf16(dequantized w)) the differences are x's quantization, bounded per output
    by |w| @ (2^-4 |x| + 2^-10 s) (see the round trip), the weight's bf16 rounding, 2^-9 |w| @ |x|, and
    both outputs' bf16 rounding, 2^-8 |ref|. Typical relative error is ~2.5%, so Frobenius < 5%."""
    x = make_act(33, 384)
    w, ws = make_weight(160, 384)
    w_bf16 = fp8_block_dequantize(w, ws).bfloat16()
    out, ref = fp8_layers.fp8_linear(x, w, ws), F.linear(x, w_bf16)
    assert out.dtype == torch.bfloat16 and out.shape == (33, 160)
    _, s = fp8.act_quant_ref(x)
    xa, wa = x.float().abs(), w_bf16.float().abs()
    bound = (2**-4 * xa + 2**-10 * s.repeat_interleave(BLOCK, 1)) @ wa.t() + 2**-9 * xa @ wa.t()
    err = (out.float() - ref.float()).abs()
    assert bool((err <= bound + 2**-8 * ref.float().abs() + 1e-6 * ref.float().abs().max()).all())
    assert (err.norm() / ref.float().norm()).item() < 0.05
    assert fp8_layers.fp8_linear(x.view(3, 11, 384), w, ws).shape == (3, 11, 160)  # leading dims kept


def test_fp8_moe_swiglu_matches_dense():
    """The reference chain exactly; and fp32 dense math on the dequantized weights within the two
    activation quantizations' error (~2.5% each)."""
    counts = [4, 0, 9, 3]
    x = make_act(16, 256)
    (w13, s13), (w2, s2) = make_weight(320, 256, experts=4, seed=2), make_weight(256, 160, experts=4, seed=3)
    out = fp8_layers.fp8_moe_swiglu(x, torch.tensor(counts), w13, s13, w2, s2)
    q, s = fp8.act_quant_ref(x)
    h = fp8.grouped_block_fp8_gemm_ref(q, s, w13, s13, counts, torch.bfloat16)
    want = fp8.grouped_block_fp8_gemm_ref(*fp8.silu_mul_quant_ref(h), w2, s2, counts, torch.bfloat16)
    assert torch.equal(out, want) and out.dtype == torch.bfloat16
    dense, start = torch.zeros(16, 256), 0
    for e, c in enumerate(counts):
        rows = x[start : start + c].float()
        gate, up = (rows @ fp8_block_dequantize(w13[e], s13[e]).t()).chunk(2, dim=1)
        dense[start : start + c] = (F.silu(gate) * up) @ fp8_block_dequantize(w2[e], s2[e]).t()
        start += c
    assert ((out.float() - dense).norm() / dense.norm()).item() < 0.08


def test_non_contiguous_inputs():
    x = make_act(200, 9).t()  # [9, 200], column-major
    (q, s), (q2, s2) = fp8.act_quant(x), fp8.act_quant(x.contiguous())
    assert torch.equal(q.float(), q2.float()) and torch.equal(s, s2)
    w, ws = make_weight(160, 200)
    wide = torch.zeros(160, 256, dtype=FP8_DTYPE)
    wide[:, :200] = w
    out = fp8.block_fp8_gemm(q, s.t().contiguous().t(), wide[:, :200], ws, torch.float32)
    assert torch.equal(out, fp8.block_fp8_gemm(q2, s2, w, ws, torch.float32))


def shape_errors(mod) -> None:
    """Mismatched shapes raise ValueError naming them (``mod``: the fp8 module or fp8_triton)."""
    gemm, grouped, quant, silu = (getattr(mod, n + ("" if mod is fp8 else "_triton")) for n in
                                  ("block_fp8_gemm", "grouped_block_fp8_gemm", "act_quant", "silu_mul_quant"))
    q, s = fp8.act_quant_ref(make_act(4, 200))
    w, ws = make_weight(160, 200)
    f32 = torch.float32
    cases = [
        (lambda: gemm(q, s, w, ws[:1], f32), r"b_scale \(1, 2\)"),
        (lambda: gemm(q, s[:, :1], w, ws, f32), r"a_scale \(4, 1\)"),
        (lambda: gemm(q, s, w[:, :128], ws, f32), r"b \(160, 128\)"),
        (lambda: gemm(q.float(), s, w, ws, f32), "float8_e4m3fn"),
        (lambda: grouped(q, s, w[None], ws[None], [2, 2], f32), r"counts \(2,\)"),
        (lambda: grouped(q, s, w[None], ws, [4], f32), r"b_scale \(2, 2\)"),
        (lambda: quant(torch.zeros(8)), r"shape \(8,\)"),
        (lambda: silu(torch.zeros(2, 7)), r"shape \(2, 7\)"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_shape_mismatch_errors():
    shape_errors(fp8)
    w, ws = make_weight(160, 200)
    with pytest.raises(ValueError, match=r"w_scale \(2, 1\)"):
        fp8_layers.fp8_linear(make_act(3, 200), w, ws[:, :1])
    with pytest.raises(ValueError, match=r"x \(3, 256\)"):
        fp8_layers.fp8_linear(make_act(3, 256), w, ws)
    q, s = fp8.act_quant_ref(make_act(4, 200))
    with pytest.raises(ValueError, match="sum to at most the 4 rows"):
        fp8.grouped_block_fp8_gemm_ref(q, s, w[None], ws[None], [5], torch.float32)
    w13, s13 = make_weight(256, 200, experts=2)
    w2, s2 = make_weight(200, 100, experts=2)
    with pytest.raises(ValueError, match=r"w2 \(2, 200, 100\)"):
        fp8_layers.fp8_moe_swiglu(make_act(4, 200), [2, 2], w13, s13, w2, s2)


def test_backend_variable(monkeypatch):
    monkeypatch.delenv(env.FP8_BACKEND, raising=False)
    assert env.fp8_backend() == "auto" and not fp8.scaled_mm_supported("cpu")
    monkeypatch.setenv(env.FP8_BACKEND, "cublas")
    with pytest.raises(ValueError, match="auto, triton, scaled_mm, torch"):
        env.fp8_backend()


def test_importing_fp8_does_not_import_triton():
    code = "import sys, epserve.kernels.fp8; assert 'triton' not in sys.modules, 'triton imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=triton_harness.subprocess_env())
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_interpreted(ft) -> None:
    assert type(ft._gemm_kernel).__name__ == "InterpretedFunction", type(ft._gemm_kernel)


def _case_quant(ft) -> None:
    for m in (0, 1, 17, 40):
        for k in (128, 200, 384):
            x = make_act(m, k, seed=m + k)
            assert_quant_close(*ft.act_quant_triton(x), *fp8.act_quant_ref(x), exact=True)
            gu = make_act(m, 2 * k, seed=m + k + 1, dtype=torch.float32) * 0.3
            assert_quant_close(*ft.silu_mul_quant_triton(gu), *fp8.silu_mul_quant_ref(gu), exact=False)


def _case_gemm(ft) -> None:
    for m in (0, 1, 17, 70):
        for n, k in SHAPES_NK:
            q, s = fp8.act_quant_ref(make_act(m, k, seed=m))
            w, ws = make_weight(n, k)
            ref = fp8.block_fp8_gemm_ref(q, s, w, ws, torch.float32)
            assert_gemm_close(ft.block_fp8_gemm_triton(q, s, w, ws, torch.float32), ref, 1e-5, 1e-6)
            out = ft.block_fp8_gemm_triton(q, s.t().contiguous().t(), w, ws, torch.bfloat16)  # M-major scales
            assert out.dtype == torch.bfloat16
            assert_gemm_close(out, ref, 2**-7, 1e-6)  # the interpreter truncates fp32 -> bf16


def _case_grouped(ft) -> None:
    w, ws = make_weight(160, 200, experts=4)
    for r, counts in [(17, [3, 0, 9, 5]), (17, [17, 0, 0, 0]), (17, [0, 2, 0, 4]), (1, [0, 0, 1, 0]),
                      (0, [0, 0, 0, 0]), (150, [0, 70, 80, 0])]:
        q, s = fp8.act_quant_ref(make_act(r, 200, seed=r))
        for c in (torch.tensor(counts), counts):
            ref = fp8.grouped_block_fp8_gemm_ref(q, s, w, ws, c, torch.float32)
            out = ft.grouped_block_fp8_gemm_triton(q, s, w, ws, c, torch.float32)
            assert_gemm_close(out, ref, 1e-5, 1e-6)


def front_end_errors(on_cuda: bool) -> list[float]:
    """fp8_linear and fp8_moe_swiglu by their CUDA route (on the GPU; or, ``on_cuda=False``, forced on
    CPU tensors under the interpreter) against the CPU reference: relative Frobenius errors. The MoE
    re-quantizes a bf16 intermediate, whose rounding flips a few fp8 codes: a looser bound."""
    x, (w, ws), counts = make_act(50, 512), make_weight(384, 512), torch.tensor([20, 0, 25, 5])
    moe = (*make_weight(512, 512, experts=4, seed=2), *make_weight(512, 256, experts=4, seed=3))
    refs = fp8_layers.fp8_linear(x, w, ws), fp8_layers.fp8_moe_swiglu(x, counts, *moe)
    move = (lambda t: t.cuda()) if on_cuda else (lambda t: t)
    if not on_cuda:
        fp8._on_cuda = lambda t: True  # (in the interpreter subprocess only)
    outs = fp8_layers.fp8_linear(*map(move, (x, w, ws))), fp8_layers.fp8_moe_swiglu(*map(move, (x, counts, *moe)))
    return [((o.float().cpu() - r.float()).norm() / r.float().norm()).item() for o, r in zip(outs, refs)]


def _case_front_ends(ft) -> None:
    linear_err, moe_err = front_end_errors(on_cuda=False)
    assert linear_err < 1e-2 and moe_err < 3e-2, (linear_err, moe_err)


INTERP_CASES = {"interpreted": _case_interpreted, "quant": _case_quant, "gemm": _case_gemm,
                "grouped": _case_grouped, "shape_errors": shape_errors, "front_ends": _case_front_ends}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


def test_triton_kernels_compile_for_sm90():
    """The kernels lower to Hopper PTX (wgmma for 64-row tiles) without a GPU: Triton's own ptxas."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import fp8_triton as ft

    ints = "M N K stride_am stride_asm stride_ask stride_bn stride_bsn stride_bsk stride_cm".split()
    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16",
           **dict.fromkeys(ints, "i32"), **dict.fromkeys(["BM", "BN", "BK", "GROUP_M"], "constexpr")}
    d16 = {(list(sig).index(a),): [["tt.divisibility", 16]] for a in "a_ptr b_ptr c_ptr K stride_am".split()}
    src = ASTSource(ft._gemm_kernel, sig, {"BM": 64, "BN": 128, "BK": 128, "GROUP_M": 8}, d16)
    assert "wgmma" in compile(src, target=GPUTarget("cuda", 90, 32), options=ft._OPTS).asm["ptx"]


def _interpreter_main() -> None:
    from epserve.kernels import fp8_triton

    triton_harness.report_cases(INTERP_CASES, fp8_triton)


if __name__ == "__main__":
    _interpreter_main()
