"""The FP8 experts on a masked grouped input (``ExpertInput.masked``: the ``symm_mem`` dispatcher's fixed ``N``
rows, of which only the first ``sum(counts)`` are written) and their row tile from ``rows_per_expert``.

The padding rows here are garbage (NaN: any read of them into a real row shows). On the CUDA route
(``kernels.fp8_triton``) they are neither quantized nor read nor written, by the quantizers (which stop at
``sum(counts)``, counted on the device) and both grouped GEMMs (which give them no tile), and the real rows
equal the unmasked call's bit for bit. The Triton kernels run under the interpreter (a subprocess with
``TRITON_INTERPRET=1``, as in ``test_fp8_kernels.py``) with uninitialized memory filled with NaN
(``torch.use_deterministic_algorithms``), so a row left unwritten shows as NaN and a row written does not;
the reference on the CPU reads only the real rows in any case; a fake-CUDA trace of the masked experts
makes no host read; with CUDA, the masked experts are captured in a graph. Running this file as a script
runs the interpreter cases and prints their results as JSON.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import triton_harness
from test_fp8_kernels import make_act, make_weight
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from epserve.kernels import fp8
from epserve.kernels.device import trace_as_cuda
from epserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_AMAX, cdiv
from epserve.moe.dispatch.base import ExpertInput
from epserve.moe.experts import GroupedExperts

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.cuda  # needs a CUDA device: skipped without one (tests/conftest.py), run by gpu_check.sh
H, INTER = 256, 128  # hidden and expert intermediate sizes: two and one 128-column groups
# decode-shaped: 8 experts, about 1.5 real rows each, 48 rows per expert in all (the padding 32 times more)
COUNTS, ROWS, HINT = [2, 1, 0, 3, 2, 2, 1, 1], 8 * 48, 1.5
WEIGHTS = ("w13", "w13_scale_inv", "w2", "w2_scale_inv")


# ---- data (also used by the interpreter subprocess) ---------------------------------------------


def poisoned(x: torch.Tensor, real: int, value: float = float("nan")) -> torch.Tensor:
    """x with its rows past ``real`` set to ``value`` (NaN by default; NaN bytes for an fp8 payload)."""
    x = x.clone()
    if x.dtype == FP8_DTYPE:
        x.view(torch.uint8)[real:] = 0x7F  # e4m3fn NaN
    else:
        x[real:] = value
    return x


def payload(rows: int, counts: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 payload (q [rows, H], scales [rows, H/128]) whose padding rows are NaN."""
    q, s = fp8.act_quant_ref(make_act(rows, H, seed=seed))
    return poisoned(q, sum(counts)), poisoned(s, sum(counts))


def moe_weights() -> tuple[torch.Tensor, ...]:
    """w13 fp8 [E, 2I, H], its scales, w2 fp8 [E, H, I], its scales."""
    e = len(COUNTS)
    return (*make_weight(2 * INTER, H, experts=e, seed=2), *make_weight(H, INTER, experts=e, seed=3))


def fp8_experts(weights: tuple[torch.Tensor, ...]) -> GroupedExperts:
    experts = GroupedExperts(len(COUNTS), H, INTER, fp8=True, act_dtype=torch.bfloat16)
    for name, t in zip(WEIGHTS, weights):
        setattr(experts, name, torch.nn.Parameter(t, requires_grad=False))
    return experts


def expert_inputs(rows: int, counts: list[int], fp8_payload: bool, device: str = "cpu") -> tuple[ExpertInput, ...]:
    """(masked input with NaN padding and the tile hint, the unmasked input of its real rows alone)."""
    total, c = sum(counts), torch.tensor(counts, device=device)
    if fp8_payload:
        q, s = (t.to(device) for t in payload(rows, counts))
        return (ExpertInput(q, c, scales=s, masked=True, rows_per_expert=HINT),
                ExpertInput(q[:total], c, scales=s[:total]))
    x = poisoned(make_act(rows, H, seed=1), total).to(device)
    return ExpertInput(x, c, masked=True, rows_per_expert=HINT), ExpertInput(x[:total], c)


@contextmanager
def unwritten_is_nan() -> Iterator[None]:
    """Within the block every ``torch.empty`` comes filled with NaN (integers with their largest value)."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


@contextmanager
def triton_route() -> Iterator[None]:
    """The ops take their CUDA route (the Triton kernels) on CPU tensors (in the interpreter subprocess)."""
    on_cuda, fp8._on_cuda = fp8._on_cuda, lambda t: True
    try:
        yield
    finally:
        fp8._on_cuda = on_cuda


# ---- the reference (the CPU's route) ------------------------------------------------------------


def test_masked_reference_gemm_reads_only_the_real_rows():
    q, s = payload(ROWS, COUNTS)
    w, ws = make_weight(2 * INTER, H, experts=len(COUNTS), seed=2)
    total = sum(COUNTS)
    want = fp8.grouped_block_fp8_gemm(q[:total], s[:total], w, ws, torch.tensor(COUNTS), torch.float32)
    got = fp8.grouped_block_fp8_gemm(q, s, w, ws, torch.tensor(COUNTS), torch.float32, HINT, True)
    assert torch.equal(got[:total], want) and not got[total:].any()
    assert want.isfinite().all()


@pytest.mark.parametrize("counts", [COUNTS, [0] * 8, [5, 0, 0, 0, 0, 0, 0, 14]])
def test_masked_reference_quantizers_read_only_the_real_rows(counts):
    """Rows past sum(counts) are quantized as zero rows, whatever they hold; the real rows as unmasked."""
    total, c = sum(counts), torch.tensor(counts)
    x = poisoned(make_act(40, 2 * INTER), total)
    for quant, cols in ((fp8.act_quant, 2 * INTER), (fp8.silu_mul_quant, INTER)):
        q, s = quant(x, c)
        q_real, s_real = quant(x[:total])
        assert torch.equal(q[:total].view(torch.uint8), q_real.view(torch.uint8)) and torch.equal(s[:total], s_real)
        assert not q[total:].view(torch.uint8).any() and (s[total:] == MIN_AMAX / FP8_MAX).all()
        assert q.shape == (40, cols) and s.shape == (40, cdiv(cols, 128))


@pytest.mark.parametrize("fp8_payload", [True, False])
def test_masked_fp8_experts_on_the_cpu(fp8_payload):
    """The engine's FP8 experts on a masked input with NaN padding: the unmasked call's real rows exactly."""
    experts = fp8_experts(moe_weights())
    masked, plain = expert_inputs(ROWS, COUNTS, fp8_payload)
    got, want = experts(masked), experts(plain)
    total = sum(COUNTS)
    assert got.shape == (ROWS, H) and got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got[:total], want) and want.isfinite().all()


@pytest.mark.parametrize("fp8_payload", [True, False])
def test_masked_fp8_experts_trace_without_host_reads(fp8_payload):
    """Traced as CUDA (fake meta tensors), the masked experts read no value on the host (a host read raises
    here) and reach the FP8 kernels' ops with the mask and the tile hint."""
    masked, _ = expert_inputs(ROWS, COUNTS, fp8_payload)
    seen: list[tuple] = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            seen.append((str(func.overloadpacket), args))
            return func(*args, **(kwargs or {}))

    def meta(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    mode = FakeTensorMode(allow_non_fake_inputs=False)  # a tensor left on the CPU raises too
    with mode:
        experts = fp8_experts(tuple(meta(t) for t in moe_weights()))
        masked = ExpertInput(meta(masked.hidden_states), meta(masked.num_tokens_per_expert), scales=meta(masked.scales),
                             masked=True, rows_per_expert=HINT)
    with torch.inference_mode(), trace_as_cuda((9, 0)), mode, Log():
        out = experts(masked)
    assert out.device.type == "meta" and tuple(out.shape) == (ROWS, H)
    def calls(op: str) -> list[tuple]:
        return [args for name, args in seen if name == f"epserve.fp8_{op}"]

    gemms, silu, quant = calls("grouped_gemm"), calls("silu_mul_quant"), calls("act_quant")
    assert len(gemms) == 2 and all(args[6:] == (HINT, True) for args in gemms), [args[6:] for args in gemms]
    assert len(silu) == 1 and len(quant) == (0 if fp8_payload else 1)
    assert all(len(args) == 2 and args[1].dtype == torch.int64 for args in silu + quant), "quantized past the counts"


def test_masked_quant_kernel_compiles_for_sm90():
    """The masked quantizer (a device count, programs past it returning at once) lowers to Hopper PTX."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import fp8_triton as ft

    ints = "M K stride_xm stride_qm stride_sm stride_sk".split()
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "real_ptr": "*i64", **dict.fromkeys(ints, "i32"),
           **dict.fromkeys(["SILU", "MASKED", "BM", "GROUP", "FMAX", "AMIN"], "constexpr")}
    consts = {"SILU": True, "MASKED": True, "BM": ft.QUANT_ROWS, "GROUP": 128, "FMAX": FP8_MAX, "AMIN": MIN_AMAX}
    kernel = compile(ASTSource(ft._quant_kernel, sig, consts), target=GPUTarget("cuda", 90, 32), options=ft._OPTS)
    assert "ld.global" in kernel.asm["ptx"]


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_masked_quantizers(ft) -> None:
    """Quantized up to sum(counts) (a tile boundary inside the real rows too), the rest left unwritten;
    the unmasked call writes every row."""
    for counts in (COUNTS, [0] * 8, [9, 0, 0, 0, 0, 0, 0, 10]):
        total, c = sum(counts), torch.tensor(counts)
        x = poisoned(make_act(40, 2 * INTER, seed=total), total, value=3.0)  # finite: its quantization would show
        for quant in (ft.act_quant_triton, ft.silu_mul_quant_triton):
            with unwritten_is_nan():
                q, s = quant(x, c)  # first: no freed memory holds the unmasked call's values
                q_all, s_all = quant(x)
            q_real, s_real = quant(x[:total])
            assert torch.equal(q[:total].view(torch.uint8), q_real.view(torch.uint8)), (quant, counts)
            assert torch.equal(s[:total], s_real) and s.stride() == s_all.stride() == (1, 40)
            assert s[total:].isnan().all() and q[total:].float().isnan().all(), "padding rows written"
            assert s_all.isfinite().all() and not q_all.float().isnan().any()


def _case_masked_gemm_tile(ft) -> None:
    """The op on a masked decode-shaped input (NaN padding): its tile from rows_per_expert (16; 64 from the
    padded rows), no tile for the padding rows (left unwritten), the unmasked call's real rows bit for bit."""
    q, s = payload(ROWS, COUNTS)
    w, ws = make_weight(2 * INTER, H, experts=len(COUNTS), seed=2)
    total, c, tiles = sum(COUNTS), torch.tensor(COUNTS), []
    tile_map = ft._tile_map

    def recorded(counts, rows, n, bm, masked=False):  # noqa: ANN001 - the real map, its tile size kept
        out = tile_map(counts, rows, n, bm, masked)
        tiles.append((bm, masked, out))
        return out

    ft._tile_map = recorded
    try:
        with triton_route():
            with unwritten_is_nan():
                got = fp8.grouped_block_fp8_gemm(q, s, w, ws, c, torch.bfloat16, HINT, True)
                padded = fp8.grouped_block_fp8_gemm(q, s, w, ws, c, torch.bfloat16)
            want = fp8.grouped_block_fp8_gemm(q[:total], s[:total], w, ws, c, torch.bfloat16, HINT)
    finally:
        ft._tile_map = tile_map
    assert [(bm, masked) for bm, masked, _ in tiles] == [(16, True), (64, False), (16, False)]
    expert, first, end = tiles[0][2]
    used = expert < len(COUNTS)
    assert not (expert == len(COUNTS)).any() and int(used.sum()) == sum(1 for n in COUNTS if n)
    assert int(end[used].max()) == total and int(first[used].min()) == 0
    assert torch.equal(got[:total], want) and want.isfinite().all() and got[total:].isnan().all()
    assert torch.equal(padded[:total], want) and not padded[total:].any()  # unmasked: zeros written


def _case_masked_experts(ft) -> None:
    """The engine's FP8 experts on the Triton route, masked (NaN padding, the tile hint) against the unmasked
    input of the real rows: the same bits; the padding outputs left unwritten. An FP8 payload, and rows in
    the model dtype (quantized up to the real rows)."""
    experts = fp8_experts(moe_weights())
    total = sum(COUNTS)
    for fp8_payload in (True, False):
        masked, plain = expert_inputs(ROWS, COUNTS, fp8_payload)
        with triton_route(), unwritten_is_nan():
            got = experts(masked)
            want = experts(plain)
        assert torch.equal(got[:total], want), fp8_payload
        assert want.isfinite().all() and got[total:].isnan().all(), fp8_payload


INTERP_CASES = {"masked_quantizers": _case_masked_quantizers, "masked_gemm_tile": _case_masked_gemm_tile,
                "masked_experts": _case_masked_experts}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


# ---- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("fp8_payload", [True, False])
def test_cuda_masked_fp8_experts_captured(fp8_payload):
    """The masked FP8 experts captured in a CUDA graph, replayed with new counts and NaN padding: the real rows
    equal an eager unmasked call's on them, bit for bit (the same tile)."""
    experts = fp8_experts(tuple(t.cuda() for t in moe_weights()))
    masked, _ = expert_inputs(ROWS, COUNTS, fp8_payload, device="cuda")
    x, counts = masked.hidden_states, masked.num_tokens_per_expert
    experts(masked)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(masked)
    for new in (COUNTS, [0] * 7 + [6], [40, 0, 3, 0, 9, 0, 0, 1]):
        total = sum(new)
        counts.copy_(torch.tensor(new))
        fresh, _ = expert_inputs(ROWS, new, fp8_payload, device="cuda")
        x.copy_(fresh.hidden_states)
        if fp8_payload:
            masked.scales.copy_(fresh.scales)
        graph.replay()
        plain = ExpertInput(x[:total], counts, scales=None if masked.scales is None else masked.scales[:total],
                            rows_per_expert=HINT)
        want = experts(plain)
        assert torch.equal(out[:total], want) and bool(want.isfinite().all()), new


def _interpreter_main() -> None:
    from epserve.kernels import fp8_triton

    triton_harness.report_cases(INTERP_CASES, fp8_triton)


if __name__ == "__main__":
    _interpreter_main()
