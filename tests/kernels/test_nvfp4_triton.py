"""NVFP4 W4A16 Triton kernels (``kernels.nvfp4_triton``) against the ops' torch reference (``kernels.nvfp4``).

Under Triton's interpreter (in a subprocess with ``TRITON_INTERPRET=1``, as in ``test_grouped_kernel.py``): the
linear in fp32/fp16/bf16 (K not a multiple of the K tile, one and two global scales, leading dimensions,
strided rows), the grouped experts (experts without rows, NaN padding rows left zero or, masked, untouched,
the decode tile hint), and the experts' and the fused MLP's forward with the ops routed to these kernels,
with no host read of a tensor's value (the property a CUDA graph capture needs). Without a GPU the kernels
are also lowered to Hopper PTX; with one (``-m cuda``) the registered ops run them on the GPU, the experts are
captured in a CUDA graph and replayed with new counts, and an NVFP4 checkpoint served on the GPU in fp32 gives
transformers' greedy tokens on its dequantized copy.
"""

from __future__ import annotations

import importlib.util
from functools import partial

import pytest
import torch
import triton_harness

from epserve.checkpoint.nvfp4 import nvfp4_quantize
from epserve.kernels import nvfp4
from epserve.kernels.nvfp4 import nvfp4_linear_ref, nvfp4_moe_swiglu_ref

HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py), selected by the GPU check
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# of the output's largest value: fp32 accumulation in another order (fp32); one rounding of the output
# (fp16, bf16: the interpreter truncates fp32 -> bf16, two ulps); the experts' intermediate rounded once
# instead of three times (bf16)
LINEAR_TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2**-7}
MOE_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (rows, counts): empty experts, trailing padding rows, all padding, one expert with every row, no rows
CASES = [(17, [3, 0, 9, 4]), (20, [0, 5, 0, 2]), (9, [0, 0, 0, 0]), (6, [6, 0, 0, 0]), (1, [0, 0, 1, 0]),
         (0, [0, 0, 0, 0])]


# ---- data and comparisons (also used by the interpreter subprocess) -----------------------------


def quantized(*weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weights`` quantized one by one and fused along the rows as our layers hold them: (packed, block scales,
    one global scale per part)."""
    qs = [nvfp4_quantize(w) for w in weights]
    return (torch.cat([q.weight for q in qs]), torch.cat([q.weight_scale for q in qs]),
            torch.stack([q.weight_scale_2 for q in qs]))


def make_linear(n: int, k: int, parts: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An NVFP4 linear [n * parts, k]; the parts' magnitudes (so their global scales) a decade apart, and
    column magnitudes spread so the block scales differ along K."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(1, k, generator=g))
    return quantized(*[10.0**p * torch.randn(n, k, generator=g) * spread for p in range(parts)])


def make_experts(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """NVFP4 experts as ``GroupedExperts`` holds them: w13 [E, 2I, H/2] (gate and up with their own global
    scales), its block scales, [E, 2]; w2 [E, H, I/2], its block scales, [E, 1]."""
    g = torch.Generator().manual_seed(seed)
    w13 = [quantized(torch.randn(i, h, generator=g), 3 * torch.randn(i, h, generator=g)) for _ in range(e)]
    w2 = [quantized(torch.randn(h, i, generator=g) / i) for _ in range(e)]
    return tuple(torch.stack([q[j] for q in w]) for w in (w13, w2) for j in range(3))


def make_rows(r: int, h: int, dtype: torch.dtype, counts: list[int], seed: int = 1) -> torch.Tensor:
    """Rows grouped by expert; the padding rows past sum(counts) are NaN, so any read of them shows."""
    x = (torch.randn(r, h, generator=torch.Generator().manual_seed(seed)) / h**0.5).to(dtype)
    x[sum(counts):] = float("nan")
    return x


def assert_close(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    if ref.numel():
        err = (out.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        assert err <= tolerance * scale, (out.dtype, tuple(out.shape), err, scale)


def assert_experts_close(out: torch.Tensor, ref: torch.Tensor, counts: list[int]) -> None:
    total = sum(counts)
    assert torch.equal(out[total:], torch.zeros_like(out[total:])), "padding rows must come out zero"
    assert_close(out[:total], ref[:total], MOE_TOLERANCE[out.dtype])


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_interpreted(nt) -> None:
    assert type(nt._linear_kernel).__name__ == "InterpretedFunction", type(nt._linear_kernel)


def _case_e2m1_decode(nt) -> None:
    """Every code, and scales of every kind: a weight of one row holding the 16 codes twice, block scales from
    2^-9 (the least e4m3 subnormal) through the largest subnormal and the least normal to 448, times an identity
    x: the dequantized weight exactly."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)
    weight = (codes[0::2] | (codes[1::2] << 4)).view(1, 16)
    for scale in (2.0**-9, 7 * 2.0**-9, 2.0**-6, 0.375, 1.0, 448.0):
        ws = torch.full((1, 2), scale).to(nvfp4.SCALE_DTYPE)
        for dtype in DTYPES:
            out = nt.nvfp4_linear_triton(torch.eye(32, dtype=dtype), weight, ws, torch.tensor([0.5]))
            want = nvfp4.dequantize_rows(weight, ws, torch.tensor([0.5])).t()
            assert torch.equal(out.float(), want), (scale, dtype, out.flatten(), want.flatten())


def _case_linear(nt) -> None:
    for n, k, parts in [(40, 96, 2), (130, 272, 1), (64, 16, 1)]:  # K: 0.75, 2.1 and 1/8 of a 128 K tile
        w, ws, g = make_linear(n, k, parts, seed=n)
        for dtype in DTYPES:
            for m in (0, 1, 33):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
                assert_close(nt.nvfp4_linear_triton(x, w, ws, g), nvfp4_linear_ref(x, w, ws, g),
                             LINEAR_TOLERANCE[dtype])
    w, ws, g = make_linear(48, 64)
    x = torch.randn(3, 5, 128)[..., ::2]  # leading dimensions, rows strided
    assert_close(nt.nvfp4_linear_triton(x, w, ws, g), nvfp4_linear_ref(x, w, ws, g), LINEAR_TOLERANCE[torch.float32])
    try:
        nt.nvfp4_linear_triton(x.to(torch.float64), w, ws, g)
        raise AssertionError("float64 activations must be refused")
    except ValueError as e:
        assert "activations" in str(e)


def _case_experts(nt) -> None:
    moe = make_experts(4, 48, 32, seed=3)  # H/16 = 3 block scales, I = 32: neither a multiple of a tile
    for dtype in DTYPES:
        for rows, counts in CASES:
            x = make_rows(rows, 48, dtype, counts, seed=rows)
            ref = nvfp4_moe_swiglu_ref(x, counts, *moe)
            for c in (torch.tensor(counts), counts):
                assert_experts_close(nt.nvfp4_moe_swiglu_triton(x, c, *moe), ref, counts)


def _case_masked_decode_tile(nt) -> None:
    """A decode-shaped masked input (32 experts, 2 real rows each expected, heavy NaN padding): the padding
    rows are neither read nor written (left as they were: ``out`` is made by ``torch.empty``, so its padding
    rows are whatever they held, never computed from the NaN rows), the real rows equal the unmasked call's
    with the same tile bit for bit, with the hint's tile (16) as with the padded rows' (32)."""
    experts, h, i = 16, 64, 32
    counts = [2] * 14 + [0, 4]
    rows, total = 24 * experts, sum(counts)
    moe = make_experts(experts, h, i, seed=6)
    x = make_rows(rows, h, torch.float32, counts, seed=7)
    want = nvfp4_moe_swiglu_ref(x, counts, *moe)
    for hint in (None, 2.0):
        ref = nt.nvfp4_moe_swiglu_triton(x, torch.tensor(counts), *moe, rows_per_expert=hint)
        assert_experts_close(ref, want, counts)
        got = nt.nvfp4_moe_swiglu_triton(x, torch.tensor(counts), *moe, rows_per_expert=hint, masked=True)
        assert torch.equal(got[:total], ref[:total]), hint


def _host_reads(run) -> tuple[object, list[str]]:
    """``run()``'s result, and the calls it made that read a tensor's value on the host (``.item()``,
    ``.tolist()``, ``int(t)``, ``bool(t)``, a data-dependent shape: what a CUDA graph capture cannot hold)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    methods = {"item", "tolist", "__int__", "__index__", "__float__", "__bool__"}
    ops = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique", "aten._unique2"}
    seen: list[str] = []

    class Methods(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if getattr(func, "__name__", "") in methods:
                seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if str(func.overloadpacket) in ops:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Methods(), Ops():
        out = run()
    return out, seen


def _case_forward_without_host_reads(nt) -> None:
    """The NVFP4 experts and the fused gate/up MLP, with the ops routed to these kernels (in this subprocess
    only): the outputs of the reference, and no value read on the host, masked or not."""
    from epserve.model.layers import GatedMLP
    from epserve.moe.dispatch.base import ExpertInput
    from epserve.moe.experts import GroupedExperts

    nvfp4.nvfp4_moe_swiglu.implement("cpu", f"{nt.__name__}:nvfp4_moe_swiglu_triton")
    nvfp4.nvfp4_linear.implement("cpu", f"{nt.__name__}:nvfp4_linear_triton")
    moe = make_experts(4, 48, 32, seed=8)
    experts = GroupedExperts(4, 48, 32, nvfp4=True)
    for name, t in zip(("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"), moe):
        getattr(experts, name).data = t
    counts = [5, 0, 2, 3]
    x = make_rows(14, 48, torch.bfloat16, counts)
    ref = nvfp4_moe_swiglu_ref(x, counts, *moe)
    assert _host_reads(lambda: nvfp4_moe_swiglu_ref(x, torch.tensor(counts), *moe))[1], "the reference's reads unseen"
    for masked in (False, True):
        expert_input = ExpertInput(x, torch.tensor(counts), masked=masked, rows_per_expert=2.5)
        out, reads = _host_reads(partial(experts, expert_input))
        assert reads == [], reads
        if masked:  # the padding rows' outputs undefined
            assert_close(out[:10], ref[:10], MOE_TOLERANCE[torch.bfloat16])
        else:
            assert_experts_close(out, ref, counts)
    mlp = GatedMLP(48, 32, nvfp4=True)
    for linear, weights in ((mlp.gate_up_proj, make_linear(32, 48, 2, seed=9)), (mlp.down_proj, make_linear(48, 32))):
        linear.weight.data, linear.weight_scale.data, linear.weight_scale_2.data = weights
    rows = x[:10]
    out, reads = _host_reads(partial(mlp, rows))
    assert reads == [], reads
    gate, up = nvfp4_linear_ref(rows, mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale,
                                mlp.gate_up_proj.weight_scale_2).float().chunk(2, dim=-1)
    hidden = (torch.nn.functional.silu(gate) * up).bfloat16()
    want = nvfp4_linear_ref(hidden, mlp.down_proj.weight, mlp.down_proj.weight_scale, mlp.down_proj.weight_scale_2)
    assert_close(out, want, MOE_TOLERANCE[torch.bfloat16])


INTERP_CASES = {"interpreted": _case_interpreted, "e2m1_decode": _case_e2m1_decode, "linear": _case_linear,
                "experts": _case_experts, "masked_decode_tile": _case_masked_decode_tile,
                "forward_without_host_reads": _case_forward_without_host_reads}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


@pytest.mark.parametrize("kernel,dtype,arch", [("linear", "bf16", 90), ("grouped", "bf16", 90), ("linear", "fp32", 80)])
def test_kernels_compile_for_the_gpu(kernel, dtype, arch):
    """The kernels lower to Hopper and Ampere PTX without a GPU (Triton's own ptxas): the nibble unpacking (join
    and reshape), the e4m3 scales decoded from their bytes, 16-bit and IEEE fp32 dots; wgmma for the experts'
    64-row tiles on Hopper."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernels)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import nvfp4_triton as nt

    grouped = kernel == "grouped"
    ints = ("R N K E part_rows stride_xm stride_we stride_wn stride_se stride_sn stride_ge stride_cm" if grouped
            else "M N K part_rows stride_xm stride_wn stride_sn stride_cm").split()
    sig = {"x_ptr": f"*{dtype}", "w_ptr": "*u8", "s_ptr": "*u8", "g_ptr": "*fp32", "c_ptr": f"*{dtype}",
           **({"tile_expert_ptr": "*i32", "tile_row_ptr": "*i32", "tile_end_ptr": "*i32"} if grouped else {}),
           **dict.fromkeys(ints, "i32")}
    consts = {"PRECISION": "ieee" if dtype == "fp32" else "tf32", "EMULATE": False, "BM": 64 if grouped else 16,
              "BN": nt.BN, "BK": 64 if dtype == "fp32" else 128, "GS": nvfp4.GROUP,
              **({"SWIGLU": True} if grouped else {"GROUP_M": 8})}
    sig.update(dict.fromkeys(consts, "constexpr"))
    ptx = compile(ASTSource(nt._grouped_kernel if grouped else nt._linear_kernel, sig, consts),
                  target=GPUTarget("cuda", arch, 32), options=nt._OPTS).asm["ptx"]
    assert ".entry" in ptx and ("wgmma" in ptx) == (grouped and arch == 90)


# ---- CUDA ---------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_ops_run_the_triton_kernels(dtype):
    from epserve.kernels.opdef import record_calls

    w, ws, g = make_linear(320, 512, 2)
    moe = make_experts(4, 256, 128)
    with record_calls() as calls:
        for m in (1, 17, 130):
            x = torch.randn(m, 512).to(dtype)
            out = nvfp4.nvfp4_linear(x.cuda(), w.cuda(), ws.cuda(), g.cuda())
            assert_close(out.cpu(), nvfp4_linear_ref(x, w, ws, g), 1e-5 if dtype == torch.float32 else 2**-7)
        for rows, counts in CASES:
            x = make_rows(rows, 256, dtype, counts)
            out = nvfp4.nvfp4_moe_swiglu(x.cuda(), torch.tensor(counts).cuda(), *(t.cuda() for t in moe))
            assert_experts_close(out.cpu(), nvfp4_moe_swiglu_ref(x, counts, *moe), counts)
    assert {impl for _, impl in calls} == {"epserve.kernels.nvfp4_triton:nvfp4_linear_triton",
                                           "epserve.kernels.nvfp4_triton:nvfp4_moe_swiglu_triton"}


@cuda
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_graph_captures_the_nvfp4_experts(masked):
    """No host read: capture once, replay with new counts written in place (padding rows NaN)."""
    moe = [t.cuda() for t in make_experts(8, 256, 128)]
    x = make_rows(64, 256, torch.bfloat16, [8] * 8).cuda()
    counts = torch.tensor([8] * 8, device="cuda")
    nvfp4.nvfp4_moe_swiglu(x, counts, *moe, 2.0, masked)  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = nvfp4.nvfp4_moe_swiglu(x, counts, *moe, 2.0, masked)
    for new in ([64, 0, 0, 0, 0, 0, 0, 0], [0, 3, 0, 40, 1, 0, 0, 7], [1, 2, 3, 4, 5, 6, 7, 8]):
        counts.copy_(torch.tensor(new))
        x[sum(new):] = float("nan")
        graph.replay()
        total = sum(new)
        ref = nvfp4_moe_swiglu_ref(x.cpu(), new, *(t.cpu() for t in moe))
        assert_close(out[:total].cpu(), ref[:total], MOE_TOLERANCE[torch.bfloat16])
        if not masked:
            assert not out[total:].any()


@cuda
def test_cuda_engine_greedy_tokens_equal_transformers(make_ckpt, tmp_path_factory):
    """An NVFP4 checkpoint served on the GPU in fp32 (the Triton W4A16 kernels, IEEE fp32 dots): greedy tokens
    equal transformers' on the dequantized checkpoint, as on the CPU (``tests/model/test_nvfp4_runtime.py``),
    and the steps reached the Triton kernels."""
    transformers = pytest.importorskip("transformers")
    from epserve import LLM, SamplingParams
    from epserve.kernels.opdef import record_calls
    from tests.model.test_nvfp4_runtime import PROMPTS, dequantized_copy
    from tests.oracle import hf_greedy

    path = make_ckpt("tiny", dtype="float32", quantization="nvfp4")
    oracle = dequantized_copy(path, tmp_path_factory.mktemp("nvfp4-oracle"))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", num_blocks=256, device="cuda")
    prompts = PROMPTS[:3]
    with record_calls() as calls:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, 12), f"prompt of {len(prompt)} tokens"
    ran = {impl for _, impl in calls}
    assert {"epserve.kernels.nvfp4_triton:nvfp4_linear_triton",
            "epserve.kernels.nvfp4_triton:nvfp4_moe_swiglu_triton"} <= ran, ran


def _interpreter_main() -> None:
    from epserve.kernels import nvfp4_triton

    triton_harness.report_cases(INTERP_CASES, nvfp4_triton)


if __name__ == "__main__":
    _interpreter_main()
