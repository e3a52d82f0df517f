"""Paged MLA decode attention (``kernels.mla_decode``, ``kernels.mla_decode_triton``).

The torch reference is checked against a dense gather-everything computation (the math of
``MLAttention._decode_mqa``, in fp64); the Triton kernels against the reference under Triton's
interpreter (in a subprocess with ``TRITON_INTERPRET=1``, so no other test sees interpreted kernels;
it also checks that importing the front end did not import triton);
with CUDA, the front end on the GPU against the reference on the CPU. Small dims: kv_lora_rank 64 +
rope 16. Block tables are shuffled block ids padded with ids of other blocks, and every cache slot is
random, so reading past a sequence's length shows. Running this file as a script runs the
interpreter cases and prints their results as JSON.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import triton_harness

from epserve.kernels import mla_decode as md
from epserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, cdiv

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
R, PE = 64, 16
SOFTMAX_SCALE = (R + PE) ** -0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8_DTYPE}


# ---- data and the dense computation (also used by the interpreter subprocess) -------------------


def lens_for(batch: int, bs: int) -> list[int]:
    """Context lengths: 1, bs - 1, bs, several blocks, long; padding rows (0) in padded batches."""
    if batch == 1:
        return [9 * bs + 7]
    if batch == 3:
        return [bs - 1, 0, 3 * bs + 5]
    return [1, bs - 1, bs, 0, 3 * bs + 5, 9 * bs + 7, 2 * bs, 0][:batch]


def make_case(
    lens: list[int], heads: int, bs: int, dtype: torch.dtype, seed: int = 0, r: int = R, pe: int = PE
) -> tuple:
    """(q [B, h, r + pe], cache, block_tables, seq_lens, kv_scale | None). Each sequence's blocks are
    distinct shuffled ids; the table's tail holds ids of random (other) blocks; tables are int32 for
    even seeds, int64 for odd. FP8: latent / 0.02 rounded to e4m3 (values up to ~300), kv_scale 0.02."""
    g = torch.Generator().manual_seed(seed)
    need = [cdiv(n, bs) for n in lens]
    num_blocks, width = sum(need) + 3, max(need, default=0) + 1
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(0, num_blocks, (len(lens), width), generator=g)
    start = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[start : start + n]
        start += n
    latent = torch.randn(num_blocks, bs, r + pe, generator=g) * 1.5
    q = torch.randn(len(lens), heads, r + pe, generator=g) * 2
    kv_scale = None
    if dtype == FP8_DTYPE:
        kv_scale = torch.tensor(0.02)
        cache = (latent / kv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        cache = latent.to(dtype)
    return q, cache, tables.to(torch.int32 if seed % 2 == 0 else torch.int64), torch.tensor(lens), kv_scale


def dense(q, cache, tables, seq_lens, scale, r, kv_scale) -> torch.Tensor:
    """``_decode_mqa``'s math in fp64 (gather the padded context of the whole batch); 0-length rows 0."""
    lens = seq_lens.tolist()
    out = torch.zeros(q.shape[0], q.shape[1], r, dtype=torch.float64)
    max_len, bs = max(lens, default=0), cache.shape[1]
    if max_len == 0:
        return out.float()
    nb = cdiv(max_len, bs)
    blocks = cache.view(torch.uint8)[tables[:, :nb].long()].view(FP8_DTYPE) if cache.dtype == FP8_DTYPE \
        else cache[tables[:, :nb].long()]
    kv = blocks.double().view(q.shape[0], nb * bs, -1)[:, :max_len]
    if kv_scale is not None:
        kv = kv * kv_scale.double()
    scores = torch.bmm(q.double(), kv.transpose(1, 2)) * scale
    pad = torch.arange(max_len)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(pad[:, None, :], float("-inf"))
    full = torch.bmm(torch.softmax(scores, dim=-1), kv[..., :r])
    live = seq_lens > 0
    out[live] = full[live]
    return out.float()


def value_max(cache: torch.Tensor, r: int, kv_scale) -> float:
    v = cache[..., :r].float()
    return v.abs().max().item() * (kv_scale.item() if kv_scale is not None else 1.0)


def assert_decode_close(out, want, lens, atol: float, rtol: float = 1e-5) -> None:
    assert out.shape == want.shape and out.dtype == torch.float32
    out = out.float().cpu()
    assert bool(torch.isfinite(out).all())
    zero = torch.tensor(lens) == 0
    assert not out[zero].any(), "rows with seq_len 0 must be zeros"
    err = (out - want).abs()
    assert bool((err <= atol + rtol * want.abs()).all()), f"max err {err.max().item():.3g} (atol {atol:.3g})"


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
        (lambda: md.paged_mla_decode(q, cache.half(), tables, seq_lens, 1.0, R), "dtype must be one of"),
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


# ---- Triton under the interpreter ---------------------------------------------------------------


def _triton_vs_ref(mt, lens, heads, bs, dtype, splits, seed) -> None:
    q, cache, tables, seq_lens, kv_scale = make_case(lens, heads, bs, dtype, seed=seed)
    ref = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale)
    out = mt.paged_mla_decode_triton(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, kv_scale, splits)
    # bf16 P (the interpreter truncates: 2^-8 per weight) -> |err| <= 2^-8 max|v|; fp32: IEEE dots
    atol = (1e-5 if dtype == torch.float32 else 2**-8) * value_max(cache, R, kv_scale)
    assert_decode_close(out, ref, lens, atol)


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


def _case_all_empty(mt) -> None:
    for splits in (None, 1, 2):  # None: the default from the shapes
        _triton_vs_ref(mt, [0, 0], 4, 16, torch.bfloat16, splits, seed=0)


def _case_hi_lo_query(mt) -> None:
    """Large logits (q x 40): a bf16-rounded query would be off by ~2^-9 * 40 * |q.k| in the exponent."""
    q, cache, tables, seq_lens, _ = make_case([40], 4, 16, torch.bfloat16, seed=3)
    q = q * 40
    ref = md.paged_mla_decode_ref(q, cache, tables, seq_lens, SOFTMAX_SCALE, R)
    out = mt.paged_mla_decode_triton(q, cache, tables, seq_lens, SOFTMAX_SCALE, R, None, 1)
    assert_decode_close(out, ref, [40], 2**-8 * value_max(cache, R, None))


INTERP_CASES = {"interpreted": _case_interpreted, "fp32": _matrix_case("fp32"), "bf16": _matrix_case("bf16"),
                "fp8": _matrix_case("fp8"), "all_empty": _case_all_empty, "hi_lo_query": _case_hi_lo_query}


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, str | None]:
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    return triton_harness.interpreter_results(__file__)


@pytest.mark.parametrize("case", sorted([*INTERP_CASES, "lazy_import"]))
def test_triton_under_interpreter(case, interpreter_results):
    assert interpreter_results[case] is None, interpreter_results[case]


def test_split_kernel_compiles_for_sm90():
    """DeepSeek-V3's dims (512 + 64, 64-token blocks) with an FP8 cache lower to Hopper PTX with MMAs,
    without a GPU (Triton's own ptxas)."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import mla_decode_triton as mt

    consts = {"PAGE": 64, "R": 512, "PE": 64, "BLOCK_R": 512, "BLOCK_PE": 64, "BLOCK_H": md.BLOCK_H,
              "BLOCK_N": mt.BLOCK_N, "HAS_SCALE": True, "KV_F32": False, "FINAL": False, "EMULATE": False}
    ptrs = {"q_ptr": "*fp32", "kv_ptr": "*fp8e4nv", "tables_ptr": "*i32", "lens_ptr": "*i32",
            "scale_ptr": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"}
    names = list(inspect.signature(mt._split_kernel.fn).parameters)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    d16 = {(names.index(a),): [["tt.divisibility", 16]] for a in "q_ptr kv_ptr o_ptr stride_kvb".split()}
    src = ASTSource(mt._split_kernel, sig, consts, d16)
    compiled = compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, **mt._OPTS})
    assert "mma" in compiled.asm["ptx"]


# ---- CUDA: the front end on the GPU against the reference on the CPU -----------------------------


@cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_matches_ref(dtype):
    """Real dims (512 + 64, 16 and 128 heads), both block sizes, default and forced splits."""
    for bs in (16, 64):
        for batch, heads in ((1, 128), (3, 16), (8, 16)):
            lens = lens_for(batch, bs)
            case = make_case(lens, heads, bs, DTYPES[dtype], seed=batch, r=512, pe=64)
            ref = md.paged_mla_decode_ref(*case[:4], 512**-0.5, 512, case[4])
            q, cache, tables, seq_lens, kv_scale = (t.cuda() if t is not None else None for t in case)
            for splits in (None, 1, 7):
                out = md.paged_mla_decode(q, cache, tables, seq_lens, 512**-0.5, 512, kv_scale, splits)
                assert out.is_cuda
                atol = (1e-5 if dtype == "fp32" else 2**-9) * value_max(case[1], 512, case[4])
                assert_decode_close(out, ref, lens, atol)


@cuda
def test_cuda_graph_replays_new_lengths_and_tables():
    """No host sync: capture once, then change seq_lens and block_tables in place and replay."""
    bs = 16
    case = make_case([300, 0, 17, 1], 16, bs, FP8_DTYPE, r=512, pe=64)
    q, cache, tables, seq_lens, kv_scale = (t.cuda() for t in case)
    args = (q, cache, tables, seq_lens, 0.05, 512, kv_scale)
    md.paged_mla_decode(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = md.paged_mla_decode(*args)
    g = torch.Generator().manual_seed(1)
    for new_lens in ([1, 2, 3, 4], [0, 0, 0, 0], [tables.shape[1] * bs, 31, 0, 200]):
        seq_lens.copy_(torch.tensor(new_lens))
        tables.copy_(torch.randint(0, cache.shape[0], tuple(tables.shape), generator=g))
        graph.replay()
        ref = md.paged_mla_decode_ref(*(t.cpu() for t in args[:4]), 0.05, 512, kv_scale.cpu())
        assert_decode_close(out, ref, new_lens, 2**-9 * value_max(cache.cpu(), 512, kv_scale.cpu()))


def _interpreter_main() -> None:
    # this file imported kernels.mla_decode (the front end), which must not have imported triton
    early = "triton" in sys.modules
    from epserve.kernels import mla_decode_triton

    triton_harness.report_cases(INTERP_CASES, mla_decode_triton,
                                {"lazy_import": "kernels.mla_decode imported triton" if early else None})


if __name__ == "__main__":
    _interpreter_main()
