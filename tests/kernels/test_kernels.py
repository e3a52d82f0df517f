"""CPU decode kernels against torch: bf16 (skipped where the CPU lacks AVX512-BF16) and fp32 (skipped
without AVX2 and FMA); every library's signature table against its C sources."""

from __future__ import annotations

import dataclasses
import re
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from epserve import env
from epserve.kernels import cpu, cpu_abi
from epserve.kernels.ops import linear

DTYPES = [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not cpu.available(torch.bfloat16),
                                                         reason="bf16 kernels need AVX512-BF16 and a C compiler")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not cpu.available(torch.float32),
                                                        reason="fp32 kernels need AVX2, FMA and a C compiler")),
]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16])
def test_linear_matches_torch(m, dtype):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g).to(dtype)
    w = (torch.randn(98, 256, generator=g) * 0.05).to(dtype)  # not a multiple of the kernel's 4-row groups
    assert cpu.linear_takes(x, w)  # the op runs the C kernel
    ours = linear(x, w)
    ref = x.double() @ w.double().T
    assert ours.dtype == dtype and ours.shape == (m, 98)
    assert torch.allclose(ours.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("k", [1, 31, 48, 100])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_bf16_linear_takes_any_inner_dimension(m, k):
    """The last K % 32 columns run zero-filled through the same dot products (the tiny test presets' 48)."""
    if not cpu.available(torch.bfloat16):
        pytest.skip("bf16 kernels need AVX512-BF16 and a C compiler")
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(9, k, generator=g) * 0.1).to(torch.bfloat16)
    ours = cpu.linear(x, w)  # the kernel itself
    ref = x.double() @ w.double().T
    assert torch.allclose(ours.double(), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_falls_back_outside_its_domain(dtype):
    x = torch.randn(17, 64).to(dtype)  # too many rows for one weight pass
    w = torch.randn(8, 64).to(dtype)
    assert torch.equal(linear(x, w), F.linear(x, w))
    if dtype == torch.float32:
        x, w = torch.randn(2, 36), torch.randn(8, 36)  # K not a multiple of the fp32 kernel's 8
        assert torch.equal(linear(x, w), F.linear(x, w))
    x16, w16 = x.half(), w.half()  # no kernel for fp16
    assert torch.equal(linear(x16, w16), F.linear(x16, w16))


def per_expert_torch(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    start, rows = 0, []
    for e, n in enumerate(counts):
        gate, up = F.linear(x[start : start + n], w13[e]).chunk(2, dim=-1)
        rows.append(F.linear(F.silu(gate) * up, w2[e]))
        start += n
    return torch.cat(rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_swiglu_matches_per_expert_torch(dtype):
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 6, 128, 64
    tol = 2 * TOL[dtype]
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).to(dtype)
    counts = [2, 0, 5, 1, 0, 3]
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    ours = cpu.moe_swiglu(x, counts, w13, w2)
    ref = per_expert_torch(x, counts, w13, w2)
    assert ours is not None and ours.shape == ref.shape and ours.dtype == dtype
    assert torch.allclose(ours.float(), ref.float(), rtol=tol, atol=tol)
    # One skewed expert past the kernel's row tile runs through torch inside the call.
    skew = [17, 5, 3, 6, 4, 2]
    xs = torch.randn(sum(skew), hidden, generator=g).to(dtype)
    got = cpu.moe_swiglu(xs, skew, w13, w2)
    ref = per_expert_torch(xs, skew, w13, w2)
    assert got is not None and torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol)
    assert cpu.moe_swiglu(xs, [24], w13[:1], w2[:1]) is None  # mostly large groups: the grouped GEMM


@pytest.mark.timing
@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_a_few_rows_cost_about_one_row(dtype):
    """The point of the kernel: the weight is streamed once, so four rows take well under the four times
    one row's time a pass per row would (BLAS's small-M GEMM took about twice one row for two rows on a
    two-core AVX2 machine). On one core four rows' multiply-adds take 2.1-2.6 times one row's stream here: a
    loose bound, which a busy machine must not fail."""
    w = torch.randn(8192, 4096, dtype=dtype)  # 64 MiB: beyond the caches (8 MiB sat in this host's 32 MiB L3)

    def seconds(m: int) -> float:
        x = torch.randn(m, 4096, dtype=dtype)
        linear(x, w)
        start = time.perf_counter()
        for _ in range(5):
            linear(x, w)
        return time.perf_counter() - start

    # one thread (the kernels split rows over torch's threads: another process on the second core would slow
    # only the split call), interleaved, the best of seven each: a burst of load slows the worst runs, not the best
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [(seconds(1), seconds(4)) for _ in range(7)]
    finally:
        torch.set_num_threads(threads)
    one, four = min(r[0] for r in runs), min(r[1] for r in runs)
    assert four < 3.2 * one, (one, four)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unbuildable_kernels_fall_back_to_torch(tmp_path, monkeypatch, dtype):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(blocker))  # the kernels' folder cannot be created
    build = cpu._KINDS[dtype]
    source = build.sources[0].read_bytes() + b"\n/* rebuild */\n"
    monkeypatch.setitem(cpu._KINDS, dtype, dataclasses.replace(build, sources=(tmp_path / "kernels.c",)))
    (tmp_path / "kernels.c").write_bytes(source)  # a new hash, so nothing cached is reused
    cpu._library.cache_clear()
    monkeypatch.setattr(cpu, "_available", {})
    try:
        assert not cpu.available(dtype)
        x, w = torch.randn(2, 64).to(dtype), torch.randn(8, 64).to(dtype)
        assert not cpu.linear_takes(x, w)
        assert torch.equal(linear(x, w), F.linear(x, w))
    finally:
        cpu._library.cache_clear()


# ---- the signature tables (kernels/cpu_abi.py) against the C definitions ----

_DEFINITION = re.compile(r"^(?!static\b|typedef\b)([A-Za-z_][\w \t*]*?)\s*\b(epserve_\w+)\s*\(([^)]*)\)\s*\{", re.M)
_SCALARS = {"int64_t": cpu_abi.I64, "int": cpu_abi.INT, "float": cpu_abi.F32}
_RETURNS = {"void": None, **_SCALARS}


def _kind(declaration: str) -> str:
    """An argument's kind from its C declaration (``const float *q`` -> ptr); "?" for a type the table has no
    kind for."""
    if "*" in declaration:
        return cpu_abi.PTR
    return _SCALARS.get(" ".join(w for w in declaration.split()[:-1] if w != "const"), "?")


def _definitions(source: str) -> dict[str, tuple[tuple[str, ...], str | None]]:
    """The exported functions a C source defines: name -> (its arguments' kinds, its return's)."""
    found = {}
    for ret, name, params in _DEFINITION.findall(source):
        args = tuple(_kind(p) for p in params.split(",")) if params.strip() not in ("", "void") else ()
        found[name] = (args, _RETURNS.get(ret.strip(), "?"))
    return found


def _mismatches(table: tuple[cpu_abi.Signature, ...], source: str) -> list[str]:
    defined, declared = _definitions(source), {s.name: (s.args, s.returns) for s in table}
    wrong = [f"{n}: not in the table" for n in defined.keys() - declared.keys()]
    wrong += [f"{n}: not defined in C" for n in declared.keys() - defined.keys()]
    for name in defined.keys() & declared.keys():
        if defined[name] != declared[name]:
            wrong.append(f"{name}: C {defined[name]}, table {declared[name]}")
    return sorted(wrong)


def _source(build: cpu._Build) -> str:
    return "\n".join(path.read_text() for path in build.sources)


@pytest.mark.parametrize("kind", list(cpu._KINDS), ids=str)
def test_each_signature_table_matches_its_libraries_c_definitions(kind):
    build = cpu._KINDS[kind]
    assert _mismatches(build.table, _source(build)) == []
    assert len(_definitions(_source(build))) == len(build.table) >= 3


@pytest.mark.skipif(not env.cpu_kernels_enabled() or shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("kind", list(cpu._KINDS), ids=str)
def test_every_library_builds_with_its_twins_where_the_cpu_takes_it(kind):
    """A library that fails to build or bind (a twin missing) would only make the kernels' tests skip."""
    build = cpu._KINDS[kind]
    if not cpu._cpu_has(*build.cpu_flags):
        pytest.skip(f"the {build.name} kernels need {build.cpu_flags}")
    lib = cpu._library(kind)
    assert lib is not None
    recorded = {s.name for s in build.table if s.recorded}
    assert set(cpu._twins[kind]) == recorded and all(t.address for t in cpu._twins[kind].values())
    assert all(getattr(lib, f"{s.name}").argtypes is not None for s in build.table)


def test_the_signature_check_catches_a_c_signature_the_table_does_not_follow():
    source = _source(cpu._KINDS[cpu.OPS])
    assert _mismatches(cpu_abi.OPS_TABLE, source) == []
    changed = {  # an argument's type, an argument more, a return type, a new function, a renamed one
        "float eps, int is_bf16,\n                      void *out)": "int64_t eps, int is_bf16,\n void *out)",
        "int64_t n, int is_bf16, void *out)": "int64_t n, int is_bf16, void *out, int extra)",
        "void epserve_silu_mul(": "int epserve_silu_mul(",
        "int epserve_index_add_i64(": "int epserve_index_add_i32(int *p) { return 0; }\nint epserve_index_add_i64(",
        "int64_t epserve_replay(": "int64_t epserve_replay_all(",
    }
    expected = ["epserve_rms_norm", "epserve_add", "epserve_silu_mul", "epserve_index_add_i32", "epserve_replay"]
    for (old, new), name in zip(changed.items(), expected):
        assert old in source
        found = _mismatches(cpu_abi.OPS_TABLE, source.replace(old, new))
        assert found and all(name in m or "epserve_replay_all" in m for m in found), (name, found)
