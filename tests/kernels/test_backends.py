"""The kernel-backend registry (``kernels.backends``): a backend is used only after its self-test against
the torch reference passed; a missing package, a raising run or a wrong answer logs one line and falls
back. On the CPU the self-tests run real MLA decodes (the reference computed another way, and with
real bugs: the rope columns dropped, a wrong softmax scale, reads past a sequence's length) through
``mla_flashinfer.check_against_reference``, the check FlashInfer's self-test runs on a GPU; FlashInfer
itself and blockwise ``torch._scaled_mm`` are checked against the reference on CUDA only.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from functools import partial

import pytest
import torch

from epserve import env
from epserve.kernels import backends, fp8
from epserve.kernels import mla_flashinfer as mf
from epserve.kernels.mla_decode import paged_mla_decode, paged_mla_decode_ref

cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py); the GPU check selects them
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
CPU = torch.device("cpu")
BF16 = torch.bfloat16


# ---- MLA decodes for the self-test: correct ones computed another way, and real bugs ------------


def online_softmax(q, kv, tables, lens, scale, r):  # noqa: ANN001, ANN201
    """The reference's chunked path (one block per chunk, an online softmax): right, computed another way."""
    return paged_mla_decode_ref(q, kv, tables, lens, scale, r, chunk_blocks=1)


def bf16_query(q, kv, tables, lens, scale, r):  # noqa: ANN001, ANN201
    """Right at FlashInfer's precision: the query and the output rounded to bf16."""
    return online_softmax(q.to(BF16).float(), kv, tables, lens, scale, r).to(BF16).float()


def rope_dropped(q, kv, tables, lens, scale, r):  # noqa: ANN001, ANN201
    q = q.clone()
    q[..., r:] = 0  # the k_pe columns never scored
    return paged_mla_decode_ref(q, kv, tables, lens, scale, r)


def wrong_scale(q, kv, tables, lens, scale, r):  # noqa: ANN001, ANN201
    return paged_mla_decode_ref(q, kv, tables, lens, scale * 3**0.5, r)  # the absorbed head dim's scale


def past_length(q, kv, tables, lens, scale, r):  # noqa: ANN001, ANN201
    bs = kv.shape[1]
    return paged_mla_decode_ref(q, kv, tables, (lens + bs - 1) // bs * bs, scale, r)  # whole last blocks


def raises(q, kv, tables, lens, scale, r):  # noqa: ANN001, ANN201
    raise RuntimeError("no kernel image is available for execution on the device")


def _op(name: str, impl, **check) -> backends.KernelOp:  # noqa: ANN001
    test = partial(lambda device, dtype, impl: mf.check_against_reference(impl, device, dtype, heads=(2,), **check),
                   impl=impl)
    return backends.register(backends.KernelOp(name, (backends.KernelBackend(impl.__name__, test),
                                                      backends.KernelBackend("triton"))))


@pytest.fixture
def registry_lines(caplog):  # noqa: ANN001, ANN201
    """The registry's log lines, and the test ops registered, removed afterwards."""
    caplog.set_level(logging.INFO, logger=backends.__name__)
    yield lambda: [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    for name in ("test_mla", "test_speed"):
        backends.unregister(name)
    backends.forget()


@pytest.mark.parametrize("impl", [rope_dropped, wrong_scale, past_length, raises])
def test_a_wrong_or_raising_backend_logs_one_line_and_falls_back(impl, registry_lines):  # noqa: ANN001
    _op("test_mla", impl)
    assert backends.select("test_mla", CPU, BF16) == "triton"
    error = "RuntimeError: no kernel image" if impl is raises else "KernelMismatch: off the torch reference by"
    lines = registry_lines()
    assert len(lines) == 1 and lines[0].startswith(f"test_mla: {impl.__name__} unavailable on cpu, bfloat16 ({error}")
    assert lines[0].endswith("; using triton")
    assert backends.select("test_mla", CPU, BF16) == "triton" and len(registry_lines()) == 1  # decided once
    assert not backends.passes("test_mla", impl.__name__, CPU, BF16)


@pytest.mark.parametrize("impl", [online_softmax, bf16_query])
def test_a_backend_that_matches_the_reference_is_used(impl, registry_lines):  # noqa: ANN001
    """The same check passes a right answer, also one at FlashInfer's bf16 precision (the tolerance
    admits bf16 rounding, not the bugs above)."""
    _op("test_mla", impl)
    assert backends.select("test_mla", CPU, BF16) == impl.__name__
    assert registry_lines() == [f"test_mla on cpu, bfloat16: {impl.__name__} (self-test passed)"]
    assert backends.decisions()["test_mla[cpu, bfloat16]"] == impl.__name__
    # a failure on a case the self-test did not cover: the fallback from then on, one warning
    assert backends.fall_back("test_mla", CPU, BF16, "M=7: illegal memory access") == "triton"
    assert backends.select("test_mla", CPU, BF16) == "triton"
    assert registry_lines()[-1] == (f"test_mla: {impl.__name__} failed on cpu, bfloat16 (M=7: illegal memory "
                                    "access); using triton from now on")


def test_the_check_catches_a_bf16_answer_at_a_tight_tolerance():
    """The tolerance matters: bf16 rounding is itself caught when the bound is below it."""
    with pytest.raises(backends.KernelMismatch, match="off the torch reference"):
        mf.check_against_reference(bf16_query, CPU, BF16, heads=(2,), tolerance=1e-5)


def test_flashinfer_missing_falls_back_to_triton_in_one_line(monkeypatch, registry_lines):  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # the optional package is not installed
    monkeypatch.delenv(env.MLA_BACKEND, raising=False)
    backends.forget("mla_decode")
    assert backends.select("mla_decode", CPU, BF16) == "triton"
    lines = registry_lines()
    assert len(lines) == 1
    assert re.fullmatch(r"mla_decode: flashinfer unavailable on cpu, bfloat16 \((ModuleNotFound|Import)Error: .*\); "
                        r"using triton", lines[0]), lines


def test_forced_backends_skip_the_self_test(monkeypatch, registry_lines):  # noqa: ANN001
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    monkeypatch.setenv(env.MLA_BACKEND, "flashinfer")
    assert backends.select("mla_decode", CPU, BF16) == "flashinfer"  # forced: not tested, errors surface
    assert registry_lines() == ["mla_decode on cpu, bfloat16: flashinfer (forced by EPSERVE_MLA_BACKEND)"]
    monkeypatch.setenv(env.MLA_BACKEND, "Triton ")
    assert backends.select("mla_decode", CPU, BF16) == "triton"  # read on every call
    monkeypatch.setenv(env.MLA_BACKEND, "flashmla")
    with pytest.raises(ValueError, match="EPSERVE_MLA_BACKEND='flashmla': expected one of auto, flashinfer, triton"):
        backends.select("mla_decode", CPU, BF16)


def test_fp8_gemm_is_decided_per_output_dtype(monkeypatch, registry_lines):  # noqa: ANN001
    """``fp8_gemm``'s ``scaled_mm`` self-test runs per (device, output dtype): bf16 is tested as bf16,
    not through an fp32 probe. Off CUDA it cannot run: each dtype gets Triton with its own line."""
    monkeypatch.delenv(env.FP8_BACKEND, raising=False)
    backends.forget("fp8_gemm")
    assert [backends.select("fp8_gemm", CPU, dt) for dt in (BF16, torch.float32, BF16)] == ["triton"] * 3
    lines = registry_lines()
    assert [line.split(" (")[0] for line in lines] == ["fp8_gemm: scaled_mm unavailable on cpu, bfloat16",
                                                       "fp8_gemm: scaled_mm unavailable on cpu, float32"]
    assert all(line.endswith("; using triton") for line in lines)
    assert not fp8.scaled_mm_supported("cpu") and not fp8.scaled_mm_supported("cpu", torch.float32)
    monkeypatch.setenv(env.FP8_BACKEND, "scaled_mm")
    assert backends.select("fp8_gemm", CPU, BF16) == "scaled_mm"
    assert not fp8.scaled_mm_supported("cpu")  # what the self-test says, whatever is forced


# ---- chosen on speed where several pass (timings injected: nothing is timed off CUDA) ------------------

TIMES = {"fails": 1e-6, "slow": 63e-6, "triton": 41e-6}


def _speed_op(monkeypatch, times, fast_fails=True) -> list[str]:  # noqa: ANN001
    """``test_speed``: ``fails`` (fastest, its self-test fails when ``fast_fails``), ``slow`` (passes), then the
    fallback ``triton``; each benchmark's time from ``times`` (an exception: the timing raises). The CPU is
    timed as CUDA is, with the injected times; returns the backends timed."""
    timed: list[str] = []

    def measure(backend, device, dtype):  # noqa: ANN001, ANN202
        timed.append(backend.name)
        if isinstance(times[backend.name], Exception):
            raise times[backend.name]
        return times[backend.name]

    def fails(device, dtype):  # noqa: ANN001, ANN202
        if fast_fails:
            raise backends.KernelMismatch("off the torch reference by 3.2")

    bench = lambda device, dtype: lambda: None  # noqa: E731 - the injected measure never runs it
    monkeypatch.setattr(backends, "TIMED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(backends, "_measure", measure)
    backends.register(backends.KernelOp("test_speed", (
        backends.KernelBackend("fails", fails, bench), backends.KernelBackend("slow", lambda d, t: None, bench),
        backends.KernelBackend("triton", benchmark=bench))))
    return timed


def test_the_faster_of_the_backends_that_pass_is_chosen_and_logged(monkeypatch, registry_lines):  # noqa: ANN001
    timed = _speed_op(monkeypatch, TIMES)
    assert backends.select("test_speed", CPU, BF16) == "triton"  # slow passes but is slower: not chosen
    assert timed == ["slow", "triton"]  # the faster one that failed its self-test is never timed nor chosen
    assert registry_lines() == [
        "test_speed on cpu, bfloat16: slow 63 us, triton 41 us -> triton",
        "test_speed: fails unavailable on cpu, bfloat16 (KernelMismatch: off the torch reference by 3.2); using triton",
    ]
    assert backends.select("test_speed", CPU, BF16) == "triton" and timed == ["slow", "triton"]  # decided once
    backends.forget("test_speed")
    timed = _speed_op(monkeypatch, {**TIMES, "slow": 20e-6})
    assert backends.select("test_speed", CPU, BF16) == "slow"
    assert registry_lines()[-2] == "test_speed on cpu, bfloat16: slow 20 us, triton 41 us -> slow"


def test_a_faster_backend_that_fails_its_self_test_is_never_chosen(monkeypatch, registry_lines):  # noqa: ANN001
    timed = _speed_op(monkeypatch, {"fails": 1e-9, "slow": 9e-6, "triton": 8e-6}, fast_fails=False)
    assert backends.select("test_speed", CPU, BF16) == "fails" and timed == ["fails", "slow", "triton"]
    backends.forget("test_speed")
    timed = _speed_op(monkeypatch, {"fails": 1e-9, "slow": 9e-6, "triton": 8e-6})
    assert backends.select("test_speed", CPU, torch.float32) == "triton" and "fails" not in timed


def test_a_backend_whose_timing_raises_is_not_chosen(monkeypatch, registry_lines):  # noqa: ANN001
    _speed_op(monkeypatch, {**TIMES, "slow": 1e-6, "triton": RuntimeError("no kernel image\nmore")}, fast_fails=True)
    assert backends.select("test_speed", CPU, BF16) == "slow"
    assert registry_lines()[0] == ("test_speed on cpu, bfloat16: slow 1 us, triton failed (RuntimeError: no kernel "
                                   "image) -> slow")
    backends.forget("test_speed")
    _speed_op(monkeypatch, {**TIMES, "slow": RuntimeError("x"), "triton": RuntimeError("y")})
    assert backends.select("test_speed", CPU, BF16) == "triton"  # none could be timed: the fallback


def test_nothing_is_timed_on_the_cpu_nor_where_a_backend_is_forced(monkeypatch, registry_lines):  # noqa: ANN001
    timed = _speed_op(monkeypatch, TIMES, fast_fails=False)
    monkeypatch.setattr(backends, "TIMED_DEVICES", ("cuda",))
    assert backends.select("test_speed", CPU, BF16) == "fails" and timed == []  # the first that passes
    assert registry_lines() == ["test_speed on cpu, bfloat16: fails (self-test passed)"]
    monkeypatch.setattr(backends, "TIMED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setenv(env.MLA_BACKEND, "triton")
    assert backends.select("mla_decode", CPU, BF16) == "triton" and timed == []


def test_every_rank_runs_the_first_ranks_choice_where_it_passed_everywhere(monkeypatch, registry_lines):  # noqa: ANN001
    """A timed choice may differ between ranks; ``agree`` makes them run one backend: the first rank's where
    every rank passed it, else the first backend that passed on every rank."""
    _speed_op(monkeypatch, TIMES)  # this rank: slow and triton pass, triton is faster
    first = {"test_speed": ("slow", ["slow", "triton"])}
    backends.agree(CPU, {"test_speed": BF16}, lambda mine: [first, mine])
    assert backends.select("test_speed", CPU, BF16) == "slow"
    assert registry_lines()[-1] == ("test_speed on cpu, bfloat16: slow, as on every rank (this rank had chosen "
                                    "triton)")
    backends.forget("test_speed")
    _speed_op(monkeypatch, TIMES)
    third = {"test_speed": ("triton", ["triton"])}  # a rank where slow failed its self-test
    backends.agree(CPU, {"test_speed": BF16}, lambda mine: [first, mine, third])
    assert backends.select("test_speed", CPU, BF16) == "triton"
    lines = len(registry_lines())
    backends.agree(CPU, {"test_speed": BF16}, lambda mine: [mine, mine])  # already agreed: nothing changes
    assert backends.select("test_speed", CPU, BF16) == "triton" and len(registry_lines()) == lines


def test_registry_refuses_bad_declarations():
    with pytest.raises(ValueError, match="the last backend must be the fallback"):
        backends.KernelOp("x", (backends.KernelBackend("triton", lambda d, t: None),))
    with pytest.raises(ValueError, match="unknown kernel op 'mla_prefill'"):
        backends.select("mla_prefill", CPU)
    assert backends.resolve(CPU, {"mla_decode": BF16, "fp8_gemm": None}) == "torch reference (cpu)"


def test_flashinfer_takes_only_calls_it_supports():
    """From shapes only: DeepSeek's 512 + 64 columns, a bf16/fp16 cache without a scale, a table with
    columns; anything else runs Triton. (``eligible`` adds: on CUDA, outside a graph capture.)"""
    q, tables = torch.zeros(2, 4, 576), torch.zeros(2, 2, dtype=torch.long)
    cache = torch.zeros(3, 16, 576, dtype=BF16)
    assert mf.fits(q, cache, tables, 512, None) and mf.fits(q, cache.half(), tables, 512, None)
    assert not mf.fits(q, cache.to(torch.float8_e4m3fn), tables, 512, torch.tensor(0.1))  # FP8: Triton
    assert not mf.fits(q, cache.float(), tables, 512, None)
    assert not mf.fits(q[..., :80], cache[..., :80], tables, 64, None)  # not DeepSeek's latent width
    assert not mf.fits(q, cache, tables[:, :0], 512, None)
    assert not mf.eligible(q, cache, tables, 512, None)  # CPU tensors
    with pytest.raises(ValueError, match="takes CUDA tensors and a bf16/fp16 cache of 512 \\+ 64 columns"):
        mf.paged_mla_decode_flashinfer(q, cache, tables, torch.tensor([3, 20]), 0.1, 512)
    with pytest.raises(ImportError if not HAS_FLASHINFER else RuntimeError):
        mf.self_test(CPU, BF16)


def test_flashinfer_page_layout_lists_each_rows_blocks_in_order():
    """The CSR page lists handed to FlashInfer's plan: row i's first cdiv(len, bs) table entries, in
    order, rows one after another (an empty row: its first block, one token)."""
    g = torch.Generator().manual_seed(4)
    tables = torch.randint(0, 100, (5, 7), generator=g)
    lens = torch.tensor([1, 16, 17, 0, 7 * 16])
    read, indptr, indices = mf.csr_pages(tables, lens, 16)
    assert read.tolist() == [1, 16, 17, 1, 112] and indptr.tolist() == [0, 1, 2, 4, 5, 12]
    assert indices.dtype == torch.int32
    for i, n in enumerate(read.tolist()):
        assert indices[indptr[i] : indptr[i + 1]].tolist() == tables[i, : -(-n // 16)].tolist()


# ---- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_mla_decode_matches_the_reference(dtype):
    device = torch.device("cuda")
    mf.check_against_reference(mf.paged_mla_decode_flashinfer, device, dtype, q_dtype=dtype)
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([5, 40, 33], device=device)
    cache = torch.randn(12, 16, 576, generator=g).to(device, dtype)
    tables = torch.randperm(12, generator=g)[:9].view(3, 3).to(device)
    q = torch.randn(3, 16, 576, generator=g).to(device)
    planner = mf._planner(device)
    planner.plans.clear()
    outs = [mf.paged_mla_decode_flashinfer(q, cache, tables, lens, 0.07, 512) for _ in range(2)]
    assert len(planner.plans) == 1  # the second call (another layer) reused the plan
    want = paged_mla_decode_ref(q.to(dtype).float(), cache, tables, lens, 0.07, 512)
    assert torch.equal(outs[0], outs[1]) and (outs[0] - want).abs().max() <= 1e-2 * cache.float().abs().max()
    mf.paged_mla_decode_flashinfer(q, cache, tables.clone(), lens, 0.07, 512)
    assert len(planner.plans) == 2  # other tables: planned anew


@cuda
def test_mla_front_end_on_cuda_matches_the_reference_with_flashinfer_or_triton(monkeypatch):
    """``paged_mla_decode`` on CUDA with the registry's choice (FlashInfer where it passed, else Triton)."""
    monkeypatch.delenv(env.MLA_BACKEND, raising=False)
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(20, 16, 576, generator=g).to(device, BF16)
    tables = torch.randperm(20, generator=g)[:18].view(3, 6).to(device)
    lens, q = torch.tensor([1, 17, 90], device=device), torch.randn(3, 16, 576, generator=g).to(device)
    got = paged_mla_decode(q, cache, tables, lens, 0.07, 512)
    want = paged_mla_decode_ref(q.to(BF16).float(), cache, tables, lens, 0.07, 512)
    assert (got - want).abs().max() <= 1e-2 * cache.float().abs().max()
    assert backends.resolve(device, {"mla_decode": BF16}) in ("mla_decode=flashinfer", "mla_decode=triton")


@cuda
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
def test_flashinfer_or_triton_mla_decode_is_chosen_on_time(monkeypatch, caplog):  # noqa: ANN001
    """Both MLA decodes pass on this GPU: each is timed at DeepSeek-V3's shapes, the faster chosen, one line."""
    monkeypatch.delenv(env.MLA_BACKEND, raising=False)
    caplog.set_level(logging.INFO, logger=backends.__name__)
    backends.forget("mla_decode")
    chosen = backends.select("mla_decode", torch.device("cuda"), BF16)
    lines = [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    assert len(lines) == 1 and re.fullmatch(r"mla_decode on cuda:\d+, bfloat16: flashinfer \d+ us, triton \d+ us "
                                            r"-> (flashinfer|triton)", lines[0]), lines
    assert lines[0].endswith(f"-> {chosen}")


@cuda
def test_the_timed_self_test_on_cuda_logs_each_backends_time(monkeypatch, caplog):  # noqa: ANN001
    """On a GPU both FP8 GEMM backends run DeepSeek-V3's decode GEMMs under CUDA events where ``scaled_mm``
    passes (the choice and the times in one line), within a second."""
    import time

    monkeypatch.delenv(env.FP8_BACKEND, raising=False)
    caplog.set_level(logging.INFO, logger=backends.__name__)
    backends.forget("fp8_gemm")
    start = time.perf_counter()
    chosen = backends.select("fp8_gemm", torch.device("cuda"), BF16)
    lines = [r.getMessage() for r in caplog.records if r.name == backends.__name__]
    if fp8.scaled_mm_supported("cuda", BF16):
        assert len(lines) == 1 and re.fullmatch(r"fp8_gemm on cuda:\d+, bfloat16: scaled_mm \d+ us, triton \d+ us -> "
                                                r"(scaled_mm|triton)", lines[0]), lines
        assert lines[0].endswith(f"-> {chosen}") and time.perf_counter() - start < 30  # incl. Triton's compile
    else:
        assert chosen == "triton"


@cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_is_used_only_where_it_passes_for_that_output_dtype(out_dtype, monkeypatch):
    monkeypatch.delenv(env.FP8_BACKEND, raising=False)
    device = torch.device("cuda")
    ok = fp8.scaled_mm_supported(device, out_dtype)
    assert backends.select("fp8_gemm", device, out_dtype) == ("scaled_mm" if ok else "triton")
    g = torch.Generator().manual_seed(3)
    a, a_scale = fp8.act_quant(torch.randn(33, 1024, generator=g).to(device))
    b = torch.randn(256, 1024, generator=g).clamp(-448, 448).to(fp8.FP8_DTYPE).to(device)
    b_scale = torch.rand(2, 8, generator=g).add_(0.1).to(device)
    got = fp8.block_fp8_gemm(a, a_scale, b, b_scale, out_dtype)
    want = fp8.block_fp8_gemm_ref(a.cpu(), a_scale.cpu(), b.cpu(), b_scale.cpu(), torch.float32)
    assert got.dtype == out_dtype
    assert (got.float().cpu() - want).abs().max() <= 1e-2 * want.abs().max()
