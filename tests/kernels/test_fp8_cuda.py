"""Block-scaled FP8 kernels on CUDA (``kernels.fp8``, its Triton kernels and blockwise ``_scaled_mm``): the front
ends on the GPU against the reference on the CPU, and a CUDA graph capture of the MoE path. The reference and
the interpreted kernels are checked in ``test_fp8_kernels.py``, whose data and comparisons these reuse."""

from __future__ import annotations

import pytest
import torch
from test_fp8_kernels import assert_gemm_close, assert_quant_close, front_end_errors, make_act, make_weight

from epserve import env
from epserve.kernels import backends, fp8, fp8_layers

cuda = pytest.mark.cuda  # needs a CUDA device: skipped without one (tests/conftest.py), run by gpu_check.sh


# ---- CUDA: the front ends on the GPU against the reference on the CPU ----------------------------


@cuda
@pytest.mark.parametrize("backend", ["auto", "triton", "scaled_mm"])
def test_cuda_block_gemm(backend, monkeypatch):
    monkeypatch.setenv(env.FP8_BACKEND, backend)
    backends.forget("fp8_gemm")  # the op's table reads the variable when it is filled: refilled now
    if backend == "scaled_mm" and not fp8.scaled_mm_supported("cuda"):
        pytest.skip("blockwise torch._scaled_mm is not supported on this device/torch")
    for m, n, k in [(0, 128, 512), (1, 256, 512), (37, 160, 1024), (130, 256, 200), (300, 384, 1536)]:
        q, s = fp8.act_quant_ref(make_act(m, k, seed=m))
        w, ws = make_weight(n, k)
        ref = fp8.block_fp8_gemm_ref(q, s, w, ws, torch.float32)
        out = fp8.block_fp8_gemm(q.cuda(), s.cuda(), w.cuda(), ws.cuda(), torch.bfloat16)
        assert out.is_cuda and out.dtype == torch.bfloat16
        assert_gemm_close(out, ref, rtol=2**-7, atol_rel=1e-3)


@cuda
def test_cuda_quant_grouped_linear_moe():
    for m, k in [(0, 128), (1, 200), (70, 384)]:
        x = make_act(m, k, seed=k)
        assert_quant_close(*fp8.act_quant(x.cuda()), *fp8.act_quant_ref(x), exact=True)
        assert_quant_close(*fp8.silu_mul_quant(x.cuda()), *fp8.silu_mul_quant_ref(x), exact=(m == 0))
    q, s = fp8.act_quant_ref(make_act(150, 384))
    w, ws = make_weight(256, 384, experts=4)
    on_gpu = [t.cuda() for t in (q, s, w, ws)]
    for counts in ([0, 70, 80, 0], [10, 0, 5, 0]):
        ref = fp8.grouped_block_fp8_gemm_ref(q, s, w, ws, counts, torch.float32)
        out = fp8.grouped_block_fp8_gemm(*on_gpu, torch.tensor(counts).cuda(), torch.float32)
        assert_gemm_close(out, ref, rtol=1e-4, atol_rel=1e-5)
    linear_err, moe_err = front_end_errors(on_cuda=True)
    assert linear_err < 1e-2 and moe_err < 3e-2


@cuda
def test_cuda_graph_captures_the_moe_path():
    """No host sync in the grouped path: capture once, then replay with new counts in place."""
    x = make_act(64, 512).cuda()
    w13, s13 = (t.cuda() for t in make_weight(512, 512, experts=8, seed=2))
    w2, s2 = (t.cuda() for t in make_weight(512, 256, experts=8, seed=3))
    counts = torch.tensor([8] * 8, device="cuda")
    fp8_layers.fp8_moe_swiglu(x, counts, w13, s13, w2, s2)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_layers.fp8_moe_swiglu(x, counts, w13, s13, w2, s2)
    for new in ([64, 0, 0, 0, 0, 0, 0, 0], [0, 3, 0, 40, 1, 0, 0, 7], [1, 2, 3, 4, 5, 6, 7, 8]):
        counts.copy_(torch.tensor(new))
        graph.replay()
        torch.testing.assert_close(out, fp8_layers.fp8_moe_swiglu(x, counts, w13, s13, w2, s2), rtol=0, atol=0)
