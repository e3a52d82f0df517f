"""Paged MLA decode attention (``kernels.mla_decode``, ``kernels.mla_decode_triton``, ``kernels.mla_decode_wide``).

The torch reference is checked against a dense gather-everything computation (the math of
``MLAttention._decode_mqa``, in fp64); the Triton kernels against the reference under Triton's
interpreter (in a subprocess with ``TRITON_INTERPRET=1``, so no other test sees interpreted kernels;
it also checks that importing the front end did not import triton): the split-K kernel at its
tolerance, the many-head kernel at the same tolerance against the reference fed its 16-bit-rounded
query, and against the fp32 query within its contract's bound (``wide_bound``). With CUDA (``-m cuda``),
the front end and both kernels on the GPU at DeepSeek's dims (``test_mla_decode_hopper.py``: at
DeepSeek-V3's batch and context, and lowered for sm_90 without a GPU). Small dims under the interpreter:
kv_lora_rank 64 + rope 16. The cases (``tests/mla_cases.py``): block tables are shuffled block ids padded
with ids of other blocks, and every cache slot is random, so reading past a sequence's length shows.
Running this file as a script runs the interpreter cases and prints their results as JSON.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton_harness
from mla_cases import (
    DTYPES,
    PE,
    SOFTMAX_SCALE,
    R,
    assert_decode_close,
    assert_wide_contract,
    cuda_case,
    dense,
    lens_for,
    make_case,
    rounded_query,
    value_max,
    wide_bound,
    wide_refs,
)

from epserve.kernels import mla_decode as md
from epserve.kernels.fp8 import FP8_DTYPE, cdiv

# ---- the reference ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_ref_matches_dense(dtype, bs, batch):
    """Whole, chunked and one-block-at-a-time (every chunk merged by log-sum-exp) against dense."""
    lens = lens_for(batch, bs)
    heads = 4 if batch == 8 else 12
    q, cache, tables, seq_lens, kv_scale = make_case(lens, heads, bs, DTYPES[dtype], seed=batch)
    want = dense(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)
    atol = 1e-5 * value_max(cache, R, kv_scale)
    for chunk in (None, 1, 3):
        out = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale, chunk)
        assert_decode_close(out, want, lens, atol)
    out = md.paged_mla_decode(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)  # CPU: the reference
    assert_decode_close(out, want, lens, atol)


def test_ref_edge_cases():
    q, cache, tables, seq_lens, _ = make_case([0, 0], 4, 16, torch.bfloat16)
    out = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R)
    assert out.shape == (2, 4, R) and not out.any()
    out = md.paged_mla_decode(q[:0], cache, tables[:0], seq_lens[:0], SOFTMAX_SCALE, R)
    assert out.shape == (0, 4, R)
    # the cache's scale is applied: an FP8 cache read with kv_scale 1 gives 1/0.02 larger values
    q, cache, tables, seq_lens, kv_scale = make_case([5], 4, 16, FP8_DTYPE)
    scaled = md.paged_mla_decode_ref(q * 50, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)
    raw = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R)
    torch.testing.assert_close(raw * kv_scale, scaled, rtol=1e-4, atol=1e-5)


def test_shape_errors():
    q, cache, tables, seq_lens, _ = make_case([5, 20], 4, 16, torch.bfloat16)
    cases = [
        (lambda: md.paged_mla_decode(q[0], cache, tables, seq_lens, 1.0, R), r"q_latent \[B, h"),
        (lambda: md.paged_mla_decode(q[..., :-1], cache, tables, seq_lens, 1.0, R), "share the last dim"),
        (lambda: md.paged_mla_decode(q, cache, tables, seq_lens, 1.0, R + PE), "kv_lora_rank"),
        (lambda: md.paged_mla_decode(q, cache, tables[:1], seq_lens, 1.0, R), r"block_tables \(1, 3\)"),
        (lambda: md.paged_mla_decode(q, cache, tables, seq_lens[:1], 1.0, R), r"seq_lens \(1,\)"),
        (lambda: md.paged_mla_decode(q, cache, tables.float(), seq_lens, 1.0, R), "int32/int64"),
        (lambda: md.paged_mla_decode(q, cache.double(), tables, seq_lens, 1.0, R), "dtype must be one of"),
        (lambda: md.paged_mla_decode(q, cache, tables, seq_lens, 1.0, R, torch.ones(2)), "scalar tensor"),
        (lambda: md.paged_mla_decode(q, cache, tables, torch.tensor([5, 49]), 1.0, R), r"lie in \[0, 48\]"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_default_num_splits():
    """From shapes only: more splits for small batches and long tables, never past the caps."""
    assert md.default_num_splits(1, 16, 128 * 1024) == md.MAX_SPLITS
    assert md.default_num_splits(1, 16, 100) == 1  # short tables: one split
    assert md.default_num_splits(256, 16, 128 * 1024) == 1  # enough programs already
    assert md.default_num_splits(8, 128, 8192) == cdiv(md.TARGET_PROGRAMS, 8 * 8)
    assert md.default_num_splits(32, 16, 4096) == 8
    assert md.default_num_splits(0, 16, 4096) >= 1
    # the many-head kernel's grid: 64 heads a program, about one program per SM
    assert md.default_num_splits(64, 128, 4096, 64, 128) == 1  # V3 at B=64: 128 programs already
    assert md.default_num_splits(8, 128, 4096, 64, 128) == 8
    assert md.default_num_splits(1, 128, 128 * 1024, 64, 128) == md.MAX_SPLITS


def test_many_heads_take_the_wide_kernel():
    """CUDA's implementations in order (FlashInfer where chosen, then the many-head kernel for calls with
    WIDE_MIN_HEADS heads or more it fits, then split-K), and the many-head kernel's choice from shapes only."""
    targets = [impl.target.rsplit(".", 1)[-1] for impl in md.paged_mla_decode.impls["cuda"]]
    assert targets == ["mla_flashinfer:paged_mla_decode_fi", "mla_decode_wide:paged_mla_decode_wide",
                       "mla_decode_triton:paged_mla_decode_triton"]
    q, cache, tables, seq_lens, _ = make_case([5, 20], 128, 16, torch.bfloat16)
    args = (tables, seq_lens, SOFTMAX_SCALE, R)
    assert md.takes_wide(q, cache, *args)
    assert md.takes_wide(q, cache.half(), *args) and md.takes_wide(q, cache.to(FP8_DTYPE), *args)
    assert not md.takes_wide(q[:, : md.WIDE_MIN_HEADS - 1], cache, *args)  # few heads: split-K
    assert not md.takes_wide(q, cache.float(), *args)  # fp32 caches: split-K's IEEE dots
    assert not md.takes_wide(q[..., 8:], cache[..., 8:], tables, seq_lens, SOFTMAX_SCALE, R - 8)  # r not 2^k
    with torch.device("meta"):  # shapes only: nothing read
        assert md.takes_wide(torch.empty(2, 128, 576), torch.empty(9, 64, 576, dtype=torch.bfloat16),
                             torch.empty(2, 4, dtype=torch.int32), torch.empty(2, dtype=torch.int32), 0.1, 512)


# ---- Triton under the interpreter ---------------------------------------------------------------


def _triton_vs_ref(mt, lens, heads, bs, dtype, splits, seed) -> None:
    q, cache, tables, seq_lens, kv_scale = make_case(lens, heads, bs, dtype, seed=seed)
    ref = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)
    out = mt.paged_mla_decode_triton(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale, splits)
    # 16-bit P (the interpreter truncates: 2^-8 per weight) -> |err| <= 2^-8 max|v|; fp32: IEEE dots
    atol = (1e-5 if dtype == torch.float32 else 2**-8) * value_max(cache, R, kv_scale)
    assert_decode_close(out, ref, lens, atol)


def _wide_vs_ref(lens, heads, bs, dtype, splits, seed, q_times: float = 1.0, pe: int = PE) -> None:
    """The many-head kernel: at the split-K kernel's tolerance given its rounded query, and within its
    contract's bound for the fp32 query."""
    from epserve.kernels import mla_decode_wide as mw

    q, cache, tables, seq_lens, kv_scale = make_case(lens, heads, bs, dtype, seed=seed, pe=pe)
    q = q * q_times
    out = mw.paged_mla_decode_wide(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale, splits)
    p_atol = 2**-8 * value_max(cache, R, kv_scale)
    rounded = md.paged_mla_decode_ref(rounded_query(q, cache), cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)
    assert_decode_close(out, rounded, lens, p_atol)
    ref = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)
    assert_decode_close(out, ref, lens, wide_bound(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale, p_atol))


def _case_interpreted(mt) -> None:
    assert type(mt._split_kernel).__name__ == "InterpretedFunction", type(mt._split_kernel)


def _matrix_case(dtype: str):
    """Block sizes 16 and 64; batches 1 (a long context in 3 splits), 3 (2 splits: short sequences get
    an empty one; 20 heads, two head blocks, the second masked) and 8 (one split: no merge pass)."""
    def case(mt) -> None:
        for bs in (16, 64):
            for batch, heads, splits in ((1, 4, 3), (3, 20, 2), (8, 4, 1)):
                _triton_vs_ref(mt, lens_for(batch, bs), heads, bs, DTYPES[dtype], splits, seed=batch + bs)
    return case


def _wide_case(dtype: str, shapes: tuple[tuple[int, int, int | None, int], ...]):
    """The many-head kernel on (batch, heads, splits, block size): 128 heads (two head blocks), 16 and 20
    (one, masked), a long context in 3 splits, empty splits, no merge pass; int32 and int64 tables."""
    def case(mt) -> None:
        for i, (batch, heads, splits, bs) in enumerate(shapes):
            _wide_vs_ref(lens_for(batch, bs), heads, bs, DTYPES[dtype], splits, seed=batch + bs + i)
    return case


def _case_all_empty(mt) -> None:
    for splits in (None, 1, 2):  # None: the default from the shapes
        _triton_vs_ref(mt, [0, 0], 4, 16, torch.bfloat16, splits, seed=0)
        _wide_vs_ref([0, 0], 128, 16, torch.bfloat16, splits, seed=0)


def _case_hi_lo_query(mt) -> None:
    """Large logits (q x 40): a bf16-rounded query would be off by ~2^-9 * 40 * |q.k| in the exponent."""
    q, cache, tables, seq_lens, _ = make_case([40], 4, 16, torch.bfloat16, seed=3)
    q = q * 40
    ref = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R)
    out = mt.paged_mla_decode_triton(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, None, 1)
    assert_decode_close(out, ref, [40], 2**-8 * value_max(cache, R, None))


def _case_wide_large_logits(mt) -> None:
    """The many-head kernel's rounded query at large logits (q x 40): its contract's bound grows with them."""
    _wide_vs_ref([40, 70], 128, 16, torch.bfloat16, 2, seed=3, q_times=40.0)


def _case_wide_odd_rope(mt) -> None:
    """A rope width that is no power of two (24 of a 32-column tile): the masked rope loads."""
    _wide_vs_ref([5, 0, 37], 128, 16, FP8_DTYPE, 2, seed=4, pe=24)


def _case_wide_refuses(mt) -> None:
    from epserve.kernels import mla_decode_wide as mw

    q, cache, tables, seq_lens, _ = make_case([5, 20], 64, 16, torch.bfloat16)
    for bad in ((q, cache.float(), R), (q[..., 8:], cache[..., 8:], R - 8)):
        try:
            mw.paged_mla_decode_wide(bad[0], bad[1], tables, seq_lens, SOFTMAX_SCALE, bad[2])
        except ValueError as e:
            assert "many-head MLA kernel takes" in str(e), e
        else:
            raise AssertionError(f"the many-head kernel took a {bad[1].dtype} cache, r {bad[2]}")


INTERP_CASES = {
    "interpreted": _case_interpreted, "fp32": _matrix_case("fp32"), "bf16": _matrix_case("bf16"),
    "fp16": _matrix_case("fp16"), "fp8": _matrix_case("fp8"), "all_empty": _case_all_empty,
    "hi_lo_query": _case_hi_lo_query,
    "wide_bf16": _wide_case("bf16", ((1, 128, 3, 16), (3, 20, 2, 64), (8, 128, 1, 64), (8, 16, None, 16))),
    "wide_fp8": _wide_case("fp8", ((1, 128, 3, 64), (3, 128, 2, 16), (8, 16, 1, 16))),
    "wide_fp16": _wide_case("fp16", ((3, 128, 2, 16), (8, 16, 1, 64))),
    "wide_large_logits": _case_wide_large_logits, "wide_odd_rope": _case_wide_odd_rope,
    "wide_refuses": _case_wide_refuses,
}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(
    __file__, [*INTERP_CASES, "lazy_import"])


# ---- CUDA: the front end and both kernels on the GPU ----------------------------------------------


@pytest.fixture
def triton_mla(monkeypatch):
    """The op on Triton's kernels (FlashInfer, where installed, has tests of its own): the backend forced,
    the op's table refilled."""
    from epserve import env
    from epserve.kernels import backends

    monkeypatch.setenv(env.MLA_BACKEND, "triton")
    backends.forget("mla_decode")
    yield
    backends.forget("mla_decode")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_matches_ref(dtype, triton_mla):
    """Real dims (512 + 64, 16 and 128 heads), both block sizes, default and forced splits: the op (the
    many-head kernel at 128 heads) within the contract of the kernel that runs; the split-K kernel at 128
    heads too, at its own tolerance."""
    from epserve.kernels import mla_decode_triton as mt
    from epserve.kernels import mla_decode_wide as mw

    for bs in (16, 64):
        for batch, heads in ((1, 128), (3, 16), (8, 16)):
            lens = lens_for(batch, bs)
            q, cache, tables, seq_lens, kv_scale = cuda_case(lens, heads, bs, DTYPES[dtype], seed=batch)
            atol = (1e-5 if dtype == "fp32" else 2**-9) * value_max(cache, 512, kv_scale)
            wide = md.takes_wide(q, cache, tables, seq_lens, 512**-0.5, 512)
            refs = wide_refs(q, cache, tables, seq_lens, 512**-0.5, kv_scale, atol) if wide else None
            ref = refs[1] if wide else md.paged_mla_decode_ref(q, cache, tables, seq_lens, 512**-0.5, 512, kv_scale)
            for splits in (None, 1, 7):
                args = (q, cache, tables, seq_lens, 512**-0.5, 512, kv_scale, splits)
                out = md.paged_mla_decode(*args)
                assert out.is_cuda
                if wide:
                    assert_wide_contract(out, refs, lens, atol)
                    assert_wide_contract(mw.paged_mla_decode_wide(*args), refs, lens, atol)
                    assert_decode_close(mt.paged_mla_decode_triton(*args), ref, lens, atol)
                else:
                    assert_decode_close(out, ref, lens, atol)


@pytest.mark.cuda
@pytest.mark.parametrize("heads", [16, 128])
def test_cuda_graph_replays_new_lengths_and_tables(heads, triton_mla):
    """No host sync: capture once, then change seq_lens and block_tables in place and replay (16 heads: the
    split-K kernel; 128: the many-head one)."""
    bs = 16
    q, cache, tables, seq_lens, kv_scale = cuda_case([300, 0, 17, 1], heads, bs, FP8_DTYPE)
    args = (q, cache, tables, seq_lens, 0.05, 512, kv_scale)
    md.paged_mla_decode(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = md.paged_mla_decode(*args)
    g = torch.Generator().manual_seed(1)
    atol = 2**-9 * value_max(cache, 512, kv_scale)
    for new_lens in ([1, 2, 3, 4], [0, 0, 0, 0], [tables.shape[1] * bs, 31, 0, 200]):
        seq_lens.copy_(torch.tensor(new_lens))
        tables.copy_(torch.randint(0, cache.shape[0], tuple(tables.shape), generator=g))
        graph.replay()
        if md.takes_wide(*args):
            assert_wide_contract(out, wide_refs(q, cache, tables, seq_lens, 0.05, kv_scale, atol), new_lens, atol)
        else:
            ref = md.paged_mla_decode_ref(*args)
            assert_decode_close(out, ref, new_lens, atol)


def _interpreter_main() -> None:
    # this file imported kernels.mla_decode (the front end), which must not have imported triton
    early = "triton" in sys.modules
    from epserve.kernels import mla_decode_triton

    triton_harness.report_cases(INTERP_CASES, mla_decode_triton,
                                {"lazy_import": "kernels.mla_decode imported triton" if early else None})


if __name__ == "__main__":
    _interpreter_main()
