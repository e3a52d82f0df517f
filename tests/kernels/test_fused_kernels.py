"""The small fused ops on CUDA (``kernels.fused`` front ends, ``kernels.fused_triton`` kernels): RMSNorm,
the rotary embedding of each head's last columns and MLA's latent KV append.

The Triton kernels run against the torch references under Triton's interpreter (in a subprocess with
``TRITON_INTERPRET=1``, so no other test sees interpreted kernels; it also checks that the CPU front ends
leave triton unimported), in fp32 and bf16, at DeepSeek-V3's shapes (hidden 7168, q_lora 1536, kv_lora
512 + rope 64, heads of 128 + 64) and the tiny / small presets' (kv_lora 32 / 128, rope 8 / 32), few rows
and heads. The rotary part is compared bit for bit; the norm bit for bit where its mean is exact in any
order (multiples of 1/4), else within a few fp32 ulps / one bf16 ulp (the mean's order of summation).
A fake-tensor trace on "CUDA" (``trace_as_cuda``) goes through the custom ops without entering Triton;
with CUDA, the front ends on the GPU against the references on the CPU, and under CUDA-graph capture.
Running this file as a script runs the interpreter cases and prints their results as JSON.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import triton_harness

from epserve.kernels import fused

_TRITON_BEFORE_MAIN = "triton" in sys.modules  # after importing the front ends (the script's check)
HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.cuda  # needs a CUDA device: skipped without one (tests/conftest.py), run by gpu_check.sh
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
EPS = 1e-6
NORM_DIMS = (7168, 1536, 512, 64, 48, 1024, 384, 128, 32)  # V3's hidden, q_lora, kv_lora; tiny's; small's
# (tokens, heads, nope, rope): V3's 128 + 64 (all 128 heads for one token), the tiny and small presets'
ROPE_SHAPES = ((1, 128, 128, 64), (3, 4, 128, 64), (3, 4, 16, 8), (3, 8, 64, 32))
LATENT_SHAPES = ((512, 64), (32, 8), (128, 32))  # (kv_lora_rank, rope)
# the norm's mean summed in another order: a few fp32 ulps in a fifth of the rows (most of their
# elements); in bf16 the rounding of h absorbs nearly all of it
MAX_ULPS = {torch.float32: 8, torch.bfloat16: 1}
MAX_DIFFERING = {torch.float32: 1.0, torch.bfloat16: 0.05}


# ---- data and comparisons (also used by the interpreter subprocess) -----------------------------


def rand(*shape: int, seed: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def quarters(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Multiples of 1/4 in [-2, 2]: their squares sum exactly in any order (the norm's mean is exact)."""
    return (torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(seed)) / 4).to(dtype)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Units in the last place between same-dtype bf16/fp32 tensors (an order-preserving integer key)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    int_dtype, magnitude = (torch.int16, 0x7FFF) if a.dtype == torch.bfloat16 else (torch.int32, 0x7FFFFFFF)

    def key(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(int_dtype).long()
        return torch.where(i < 0, -(i & magnitude), i)

    return (key(a) - key(b)).abs()


def assert_norm_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within MAX_ULPS of the output dtype, bf16 nearly all bit-exact."""
    err = ulps(got.cpu(), want)
    assert err.max().item() <= MAX_ULPS[want.dtype], f"{err.max().item()} ulps"
    differing = (err > 0).float().mean().item()
    assert differing <= MAX_DIFFERING[want.dtype], f"{differing:.1%} differ"


def rope_want(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, rope: int) -> torch.Tensor:
    nope, pe = q.split([q.shape[-1] - rope, rope], dim=-1)
    return torch.cat([nope, fused.rope_ref(pe, cos, sin, interleave)], dim=-1)


def latent_case(t: int, r: int, rope: int, dtype: torch.dtype, seed: int, exact: bool = False, rows: int = 12):
    """(latent [t, r + rope] viewed in a wider projection output, weight, cos, sin, slots in shuffled order,
    a cache of ``rows`` > t rows of random contents)."""
    make = quarters if exact else rand
    latent = make(t, r + rope + 8, seed=seed, dtype=dtype)[:, : r + rope]
    cos, sin = rand(t, rope // 2, seed=seed + 1, dtype=dtype), rand(t, rope // 2, seed=seed + 2, dtype=dtype)
    slots = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:t]
    return latent, rand(r, seed=seed + 3, dtype=dtype), cos, sin, slots, rand(rows, r + rope, seed=seed + 4,
                                                                            dtype=torch.float32)


def latent_want(latent, w, cos, sin, interleave, slots, cache, r) -> torch.Tensor:  # noqa: ANN001
    c_kv, k_pe = latent.split([r, latent.shape[1] - r], dim=-1)
    rows = torch.cat([fused.rms_norm_ref(c_kv, w, EPS), fused.rope_ref(k_pe, cos, sin, interleave)], dim=-1)
    return cache.clone().index_copy_(0, slots.long(), rows.to(cache.dtype))


def assert_latent(got: torch.Tensor, want: torch.Tensor, r: int, exact: bool) -> None:
    assert torch.equal(got[:, r:], want[:, r:]), "the rotary part differs"
    if exact:
        assert torch.equal(got, want), "the norm differs"
    else:
        assert_norm_close(got[:, :r], want[:, :r])


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_interpreted(ft) -> None:
    assert type(ft._rms_norm_kernel).__name__ == "InterpretedFunction", type(ft._rms_norm_kernel)


def _norm_case(dtype: torch.dtype):
    """Every dim for 1 and 3 rows (3: a partial block of 4), random and exact-mean rows; a split's strided
    view, a 3-D input, mixed dtypes (promoted as torch does), one row per program (the GPU's layout)."""
    def case(ft) -> None:
        for d in NORM_DIMS:
            w = rand(d, seed=d, dtype=dtype)
            for t in (1, 3):
                x = rand(t, d, seed=d + t, dtype=dtype, scale=3)
                assert_norm_close(ft.rms_norm_triton(x, w, EPS), fused.rms_norm_ref(x, w, EPS))
                x = quarters(t, d, seed=d + t, dtype=dtype)
                assert torch.equal(ft.rms_norm_triton(x, w, EPS), fused.rms_norm_ref(x, w, EPS)), (d, t)
        x, w = quarters(5, 1536 + 576, seed=1, dtype=dtype), rand(1536, seed=2, dtype=dtype)
        view = x[:, :1536]  # q_a of the fused q_a / kv_a projection
        assert torch.equal(ft.rms_norm_triton(view, w, EPS), fused.rms_norm_ref(view, w, EPS))
        x3 = x[:, :1536].reshape(5, 3, 512)
        got = ft.rms_norm_triton(x3, w[:512], EPS)
        assert got.shape == (5, 3, 512) and torch.equal(got, fused.rms_norm_ref(x3, w[:512], EPS))
        other = torch.bfloat16 if dtype == torch.float32 else torch.float32
        got, want = ft.rms_norm_triton(view, w.to(other), EPS), fused.rms_norm_ref(view, w.to(other), EPS)
        assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)
        got = ft.rms_norm_triton(view, w, EPS, rows_per_program=1)
        assert torch.equal(got, fused.rms_norm_ref(view, w, EPS))
        assert ft.rms_norm_triton(x[:0, :64], w[:64], EPS).shape == (0, 64)
    return case


def _rope_case(dtype: torch.dtype):
    """Each shape, interleaved and not, rotated in place bit for bit; 20 heads in blocks of 16 (the GPU's,
    the second masked); an fp32 q with bf16 tables (computed in fp32)."""
    def case(ft) -> None:
        for interleave in (True, False):
            for i, (t, h, nope, rope) in enumerate(ROPE_SHAPES):
                q = rand(t, h, nope + rope, seed=i, dtype=dtype, scale=2)
                cos, sin = rand(t, rope // 2, seed=i + 10, dtype=dtype), rand(t, rope // 2, seed=i + 20, dtype=dtype)
                want, x = rope_want(q, cos, sin, interleave, rope), q.clone()
                got = ft.rope_heads_triton(x, cos, sin, interleave, rope)
                assert got.data_ptr() == x.data_ptr() and torch.equal(x, want), (interleave, t, h, nope, rope)
            q, cos, sin = rand(2, 20, 96, seed=7, dtype=dtype), rand(2, 16, seed=8, dtype=dtype), rand(
                2, 16, seed=9, dtype=dtype)
            got = ft.rope_heads_triton(q.clone(), cos, sin, interleave, 32, heads_per_program=16)
            assert torch.equal(got, rope_want(q, cos, sin, interleave, 32))
        q, cos, sin = rand(3, 4, 96, seed=3, dtype=torch.float32), rand(3, 16, seed=4, dtype=dtype), rand(
            3, 16, seed=5, dtype=dtype)
        assert torch.equal(ft.rope_heads_triton(q.clone(), cos, sin, True, 32), rope_want(q, cos, sin, True, 32))
        assert ft.rope_heads_triton(q[:0].clone(), cos[:0], sin[:0], True, 32).shape == (0, 4, 96)
    return case


def _latent_case(dtype: torch.dtype):
    """Each shape, interleaved and not, 1 and 3 rows to shuffled slots of a 12-row cache (the other rows
    untouched), random and exact-mean latents; caches of both dtypes; int32 slots; one row per program;
    a slot outside the cache skipped; fp32 weights and tables (promoted as torch does)."""
    def case(ft) -> None:
        for interleave in (True, False):
            for r, rope in LATENT_SHAPES:
                for t, exact in ((1, False), (3, False), (3, True)):
                    latent, w, cos, sin, slots, cache = latent_case(t, r, rope, dtype, seed=r + t, exact=exact)
                    for cache_dtype in (torch.float32, torch.bfloat16):
                        start = cache.to(cache_dtype)
                        want, got = latent_want(latent, w, cos, sin, interleave, slots, start, r), start.clone()
                        ft.append_latent_triton(latent, w, EPS, cos, sin, interleave, slots, got, r)
                        assert_latent(got, want, r, exact)
        latent, w, cos, sin, slots, cache = latent_case(4, 512, 64, dtype, seed=1, exact=True)
        want, got = latent_want(latent, w, cos, sin, True, slots, cache, 512), cache.clone()
        ft.append_latent_triton(latent, w, EPS, cos, sin, True, slots.int(), got, 512, rows_per_program=1)
        assert torch.equal(got, want)
        buffer = torch.cat([cache[:1], cache, cache[:1]])  # the cache, with a row either side
        ft.append_latent_triton(latent, w, EPS, cos, sin, True, torch.tensor([3, 12, -1, 5]), buffer[1:-1], 512)
        kept = [0, 1, 2, 4, 6, 7, 8, 9, 10, 11]
        assert torch.equal(buffer[[0, -1]], cache[[0, 0]]) and torch.equal(buffer[1:-1][kept], cache[kept])
        assert torch.equal(buffer[[4, 6]], latent_want(latent, w, cos, sin, True, slots, cache, 512)[slots[[0, 3]]])
        w32, cos32, sin32 = w.float(), cos.float(), sin.float()
        want, got = latent_want(latent, w32, cos32, sin32, False, slots, cache, 512), cache.clone()
        ft.append_latent_triton(latent, w32, EPS, cos32, sin32, False, slots, got, 512)
        assert torch.equal(got, want)
        ft.append_latent_triton(latent[:0], w, EPS, cos[:0], sin[:0], True, slots[:0], got, 512)
        assert torch.equal(got, want)
    return case


def _case_bad_block_sizes(ft) -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="power of two"):
        ft.rms_norm_triton(x, torch.ones(64), EPS, rows_per_program=3)
    with pytest.raises(ValueError, match="power of two"):
        ft.rope_heads_triton(x.view(2, 2, 32), torch.ones(2, 4), torch.ones(2, 4), True, 8, heads_per_program=6)


def _case_custom_ops(ft) -> None:
    """The custom ops' own implementations (what a compiled CUDA graph runs: the CUDA table, Triton here on CPU
    tensors under the interpreter), eager: rope_heads out of place."""
    for op in (fused.rms_norm, fused.rope_heads, fused.append_latent):
        op.device_of = lambda *args, **kwargs: "cuda"
    assert fused.rms_norm.chosen("cuda") == ["epserve.kernels.fused_triton:rms_norm_triton"]
    x, w = quarters(3, 576, seed=1, dtype=torch.bfloat16), rand(512, seed=2, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.epserve.rms_norm(x[:, :512], w, EPS), fused.rms_norm_ref(x[:, :512], w, EPS))
    q, cos, sin = rand(3, 4, 192, seed=3, dtype=torch.bfloat16), x[:, :32], x[:, 32:64]
    before = q.clone()
    got = torch.ops.epserve.rope_heads(q, cos, sin, True, 64)
    assert torch.equal(q, before) and torch.equal(got, rope_want(q, cos, sin, True, 64))
    latent, w, cos, sin, slots, cache = latent_case(3, 512, 64, torch.bfloat16, seed=4, exact=True)
    want, got = latent_want(latent, w, cos, sin, False, slots, cache, 512), cache.clone()
    assert torch.ops.epserve.append_latent(latent, w, EPS, cos, sin, False, slots, got, 512) is None
    assert torch.equal(got, want)


INTERP_CASES = {"interpreted": _case_interpreted, "bad_block_sizes": _case_bad_block_sizes,
                "custom_ops": _case_custom_ops}
for _name, _dtype in DTYPES.items():
    INTERP_CASES |= {f"rms_norm_{_name}": _norm_case(_dtype), f"rope_heads_{_name}": _rope_case(_dtype),
                     f"append_latent_{_name}": _latent_case(_dtype)}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(
    __file__, [*INTERP_CASES, "cpu_path_is_triton_free"])


def test_triton_kernels_compile_for_sm90():
    """DeepSeek-V3's specializations (rows, heads as the GPU launches them), fp32 and bf16, lower to
    Hopper code without a GPU (Triton's own ptxas): no FMA contraction (fp32: ``x1 cos - x2 sin`` would
    round once), a barrier between the in-place rotation's loads and stores."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import fused_triton as ft

    kernels = [(ft._rms_norm_kernel, {"D": 7168, "BLOCK_D": 8192, "BT": 1}, 8),
               (ft._rope_kernel, {"D": 192, "HALF": 32, "BLOCK_HALF": 32, "BLOCK_H": 16}, 2),
               (ft._append_latent_kernel, {"R": 512, "BLOCK_R": 512, "HALF": 32, "BLOCK_HALF": 32, "BT": 1}, 1)]
    for bf16 in (False, True):
        flags = dict.fromkeys(("X_BF16", "OUT_BF16", "NORM_BF16", "ROPE_BF16", "CACHE_BF16", "BF16"), bf16)
        for kernel, consts, warps in kernels:
            names = list(inspect.signature(kernel.fn).parameters)
            consts = {**{k: v for k, v in flags.items() if k in names}, "EMULATE": False, **consts}
            consts |= {"INTERLEAVE": True} if "INTERLEAVE" in names else {}
            ptrs = {"slots_ptr": "*i64", "eps": "fp32"}
            data = "*bf16" if bf16 else "*fp32"
            sig = {n: "constexpr" if n in consts else ptrs.get(n, data if n.endswith("_ptr") else "i32") for n in names}
            compiled = compile(ASTSource(kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, **ft._OPTS})
            ptx = compiled.asm["ptx"]
            assert "st.global" in ptx and "fma.rn.f32" not in ptx, kernel.fn.__name__
            assert kernel is not ft._rope_kernel or "bar.sync" in ptx


# ---- CUDA: the front ends on the GPU against the references on the CPU ---------------------------


@cuda
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_cuda_matches_reference(dtype):
    dt = DTYPES[dtype]
    for t in (1, 7, 300):
        for d in (7168, 1536, 512):
            x, w = rand(t, d, seed=d + t, dtype=dt, scale=3), rand(d, seed=d, dtype=dt)
            got = fused.rms_norm(x.cuda(), w.cuda(), EPS)
            assert got.is_cuda and got.dtype == dt
            assert_norm_close(got, fused.rms_norm_ref(x, w, EPS))
        for interleave in (True, False):
            q, cos, sin = rand(t, 128, 192, seed=t, dtype=dt), rand(t, 32, seed=1, dtype=dt), rand(t, 32, seed=2,
                                                                                                   dtype=dt)
            q_gpu = q.cuda()
            got = fused.rope_heads(q_gpu, cos.cuda(), sin.cuda(), interleave, 64)
            assert got.data_ptr() == q_gpu.data_ptr() and torch.equal(got.cpu(), rope_want(q, cos, sin, interleave, 64))
            latent, w, cos, sin, slots, cache = latent_case(t, 512, 64, dt, seed=t, rows=t + 40)
            want = latent_want(latent, w, cos, sin, interleave, slots, cache.to(dt), 512)
            got = cache.to(dt).cuda()
            fused.append_latent(latent.cuda(), w.cuda(), EPS, cos.cuda(), sin.cuda(), interleave, slots.cuda(), got,
                                512)
            assert_latent(got.cpu(), want, 512, exact=False)


@cuda
def test_cuda_graph_captures_the_fused_ops():
    """No host sync: captured once, replayed with new rows, tables and slots written in place."""
    t, dt = 16, torch.bfloat16
    latent, w, cos, sin, slots, cache = (x.cuda() for x in latent_case(t, 512, 64, dt, seed=0, rows=64))
    cache = cache.to(dt)
    x, wx, q = rand(t, 7168, seed=1, dtype=dt).cuda(), rand(7168, seed=2, dtype=dt).cuda(), rand(t, 128, 192, seed=3,
                                                                                                dtype=dt).cuda()

    def step():
        fused.append_latent(latent, w, EPS, cos, sin, True, slots, cache, 512)
        return fused.rms_norm(x, wx, EPS), fused.rope_heads(q, cos, sin, True, 64)

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, rotated = step()
    for seed in (4, 5):
        new = latent_case(t, 512, 64, dt, seed=seed, rows=64)
        for dst, src in zip((latent, w, cos, sin, slots), new[:5]):
            dst.copy_(src)
        x.copy_(rand(t, 7168, seed=seed, dtype=dt))
        q_before = rand(t, 128, 192, seed=seed, dtype=dt)
        q.copy_(q_before)
        before = cache.cpu()
        graph.replay()
        assert_norm_close(normed, fused.rms_norm_ref(x.cpu(), wx.cpu(), EPS))
        assert torch.equal(rotated.cpu(), rope_want(q_before, *new[2:4], True, 64))
        assert_latent(cache.cpu(), latent_want(*new[:4], True, new[4], before, 512), 512, exact=False)


def _interpreter_main() -> None:
    # this file imported kernels.fused; the CPU front ends ran, still without triton (not traced here:
    # FakeTensorMode's first use imports torch's compiler stack, which imports triton)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(64, generator=g)
    fused.rms_norm(x, w, EPS)
    fused.rope_heads(torch.randn(3, 4, 24), torch.randn(3, 4), torch.randn(3, 4), True, 8)
    fused.append_latent(torch.randn(3, 40), torch.randn(32), EPS, torch.randn(3, 4), torch.randn(3, 4), False,
                        torch.tensor([2, 0, 1]), torch.zeros(4, 40), 32)
    early = _TRITON_BEFORE_MAIN or "triton" in sys.modules
    from epserve.kernels import fused_triton

    triton_harness.report_cases(INTERP_CASES, fused_triton,
                                {"cpu_path_is_triton_free": "the CPU front ends imported triton" if early else None})


if __name__ == "__main__":
    _interpreter_main()
