"""The paged MLA decode kernels on Hopper: lowered for sm_90 without a GPU (Triton's own ptxas: what the
kernels compile to, checked here on the CPU), and the many-head kernel at DeepSeek-V3's shapes on one
(``-m cuda``, in the GPU check's kernels stage; ``test_mla_decode_kernel.py`` holds the smaller CUDA cases
that also run under compute-sanitizer)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from mla_cases import DTYPES, assert_wide_contract, cuda_case, value_max, wide_refs

from epserve.kernels import mla_decode as md

HAS_TRITON = importlib.util.find_spec("triton") is not None


def _compile_sm90(kernel, consts: dict, kv_type: str, q_type: str, num_warps: int, num_stages: int = 2):
    """``kernel`` lowered for Hopper without a GPU (Triton's own ptxas), integer arguments typed as a launch
    at DeepSeek-V3's dims types them (the strides a multiple of 16)."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import mla_decode_triton as mt

    ptrs = {"q_ptr": q_type, "kv_ptr": kv_type, "tables_ptr": "*i32", "lens_ptr": "*i32",
            "scale_ptr": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    aligned = "q_ptr kv_ptr o_ptr stride_qb stride_qh stride_kvb stride_kvt stride_ob stride_oh stride_os".split()
    d16 = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(kernel, sig, consts, d16)
    return compile(src, target=GPUTarget("cuda", 90, 128),
                   options={"num_warps": num_warps, "num_stages": num_stages, **mt._OPTS})


def test_split_kernel_compiles_for_sm90():
    """DeepSeek-V3's dims (512 + 64, 64-token blocks) with an FP8 cache lower to Hopper PTX with MMAs,
    without a GPU (Triton's own ptxas)."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    from epserve.kernels import mla_decode_triton as mt

    consts = {"PAGE": 64, "R": 512, "PE": 64, "BLOCK_R": 512, "BLOCK_PE": 64, "BLOCK_H": md.BLOCK_H,
              "BLOCK_N": mt.BLOCK_N, "HAS_SCALE": True, "KV_F32": False, "HALF": False, "FINAL": False,
              "EMULATE": False}
    compiled = _compile_sm90(mt._split_kernel, consts, "*fp8e4nv", "*fp32", 8)
    assert "mma" in compiled.asm["ptx"]


@pytest.mark.parametrize("cache", ["bf16", "fp16", "fp8e4nv"])
def test_wide_kernel_compiles_for_sm90(cache):
    """The many-head kernel at DeepSeek-V3's dims lowers to Hopper's wgmma with its KV tiles copied
    asynchronously (cp.async), the 16-bit query read as a shared-memory operand, and fits one SM's
    shared memory (227 KB)."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    from epserve.kernels import mla_decode_wide as mw

    consts = {"PAGE": 64, "R": 512, "PE": 64, "BLOCK_R": 512, "BLOCK_PE": 64, "BLOCK_H": mw.BLOCK_H,
              "BLOCK_N": mw.BLOCK_N, "HAS_SCALE": cache == "fp8e4nv", "HALF": cache == "fp16", "FINAL": False,
              "EMULATE": False}
    compiled = _compile_sm90(mw._wide_kernel, consts, f"*{cache}", "*fp16" if cache == "fp16" else "*bf16", 8)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async" in ptx
    assert compiled.metadata.shared <= 227 * 1024, compiled.metadata.shared
    # S = Q K^T reads Q from shared memory: the three score wgmmas (two latent halves, rope) take their A
    # operand [64 heads, k] as a shared-memory descriptor, not in registers
    dots = [line.split("} : ", 1)[1] for line in compiled.asm["ttgir"].splitlines() if "warp_group_dot " in line]
    assert sum(d.startswith("!ttg.memdesc<64x") for d in dots) == 3, dots


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp16"])
def test_cuda_wide_at_deepseek_v3_shapes(dtype):
    """DeepSeek-V3 with DP attention: 128 heads, 512 + 64, 64-token blocks, batch 64 of ragged contexts up to
    4k (padding rows among them), int32 and int64 tables, default and forced splits."""
    from epserve.kernels import mla_decode_wide as mw

    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 4097, (64,), generator=g)
    lens[[3, 40]] = 0
    lens[[0, 1]] = torch.tensor([4096, 1])
    for tables_dtype, splits in ((torch.int32, None), (torch.int64, 5)):
        q, cache, tables, seq_lens, kv_scale = cuda_case(lens.tolist(), 128, 64, DTYPES[dtype], seed=2,
                                                          tables_dtype=tables_dtype)
        out = mw.paged_mla_decode_wide(q, cache, tables, seq_lens, 192**-0.5, 512, kv_scale, splits)
        atol = 2**-9 * value_max(cache, 512, kv_scale)
        refs = wide_refs(q, cache, tables, seq_lens, 192**-0.5, kv_scale, atol)
        assert_wide_contract(out, refs, lens.tolist(), atol)
