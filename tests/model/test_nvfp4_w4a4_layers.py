"""W4A4 wiring: ``model.layers.use_w4a4`` switches an NVFP4 model's linears to the W4A4 op (activations quantized
by the checkpoint's input scale) and its routed experts to the W4A4 experts' op (each expert's rows by its own
input scales): on the CPU by their references, a tiny NVFP4 model then decodes close to its W4A16 tokens;
``EPSERVE_NVFP4_BACKEND`` is validated."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams, env
from epserve.checkpoint.nvfp4 import nvfp4_global_scale, nvfp4_quantize
from epserve.kernels import opdef
from epserve.kernels.nvfp4_w4a4 import nvfp4_w4a4_ref
from epserve.model.layers import GatedMLP, Linear, use_w4a4
from epserve.moe.experts import GroupedExperts


def _mlp(hidden: int = 64, inter: int = 96) -> GatedMLP:
    gen = torch.Generator().manual_seed(0)
    mlp = GatedMLP(hidden, inter, nvfp4=True)
    gate, up, down = (torch.randn(o, i, generator=gen) * 0.1 for o, i in ((inter, hidden), (inter, hidden),
                                                                         (hidden, inter)))
    with torch.no_grad():
        parts = [nvfp4_quantize(gate), nvfp4_quantize(up)]
        fused = mlp.gate_up_proj
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        fused.weight_scale.copy_(torch.cat([p.weight_scale for p in parts]))
        fused.weight_scale_2.copy_(torch.stack([p.weight_scale_2 for p in parts]))
        fused.input_scale.copy_(torch.stack([nvfp4_global_scale(4.0), nvfp4_global_scale(3.0)]))
        d = nvfp4_quantize(down)
        mlp.down_proj.weight.copy_(d.weight)
        mlp.down_proj.weight_scale.copy_(d.weight_scale)
        mlp.down_proj.weight_scale_2.copy_(d.weight_scale_2.reshape(1))
        mlp.down_proj.input_scale.copy_(nvfp4_global_scale(2.0).reshape(1))
    return mlp


def test_use_w4a4_switches_the_linears_to_the_w4a4_op():
    mlp = _mlp()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    w4a16 = mlp(x)
    assert use_w4a4(mlp) == 2
    with opdef.record_calls() as calls:
        w4a4 = mlp(x)
    assert [name for name, _ in calls].count("nvfp4_w4a4_linear") == 2
    assert "nvfp4_linear" not in [name for name, _ in calls]
    g = mlp.gate_up_proj
    gate, up = nvfp4_w4a4_ref(x, g.weight, g.weight_scale, g.weight_scale_2, g.input_scale).chunk(2, dim=-1)
    d = mlp.down_proj
    want = nvfp4_w4a4_ref(torch.nn.functional.silu(gate) * up, d.weight, d.weight_scale, d.weight_scale_2,
                          d.input_scale)
    torch.testing.assert_close(w4a4, want, rtol=1e-5, atol=1e-6)
    assert not torch.equal(w4a4, w4a16)  # the activations' FP4 rounding shows


PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), [7], [300, 200, 100, 50, 25, 12, 6, 3, 2]]


def test_use_w4a4_switches_the_routed_experts_too(make_ckpt):
    """A tiny NVFP4 model on the CPU (eager steps): every NVFP4 linear and every routed experts' module switched
    (the count says so), the experts then running the W4A4 experts' op and never the W4A16 one, and its next
    tokens, teacher-forced on W4A16's greedy continuations, mostly W4A16's: the activations' four-bit rounding
    flips the near ties of this random model (about a quarter of them: 29 of 40 here with the linears' and the
    experts' rounding, 31 with the linears' alone), a wrong scale far more (the experts' w2 input scale thirty
    times too small: 17 of 40), the experts' NaN padding rows leaking all."""
    path = make_ckpt("tiny", dtype="float32", quantization="nvfp4")
    llm = LLM(path, dtype="float32", num_blocks=128, device="cpu", cuda_graph=False)
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight_scale_2 is not None]
    assert experts and all(m.nvfp4 and not m.w4a4 for m in experts)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    w4a16 = [p + out.token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, greedy))]
    prefixes = [seq[:n] for p, seq in zip(PROMPTS, w4a16) for n in range(len(p), len(seq))]
    assert use_w4a4(model) == len(linears) + len(experts)
    assert all(m.w4a4 for m in experts)
    with opdef.record_calls() as calls:
        w4a4 = [out.token_ids[0] for out in llm.generate(prefixes, SamplingParams(max_tokens=1, temperature=0.0))]
    names = [name for name, _ in calls]
    assert names.count("nvfp4_w4a4_moe_swiglu") >= len(experts) and "nvfp4_moe_swiglu" not in names
    want = [seq[n] for p, seq in zip(PROMPTS, w4a16) for n in range(len(p), len(seq))]
    same = sum(a == b for a, b in zip(w4a4, want))
    assert same >= 0.6 * len(want), (same, len(want))


def test_experts_the_fp4_gemm_does_not_take_stay_w4a16():
    """Hidden size 48 (not a multiple of 32): the W4A4 experts would run their reference, which reads the counts
    on the host; they stay W4A16. Hidden size 64 switches."""
    odd, even = GroupedExperts(2, 48, 32, nvfp4=True), GroupedExperts(2, 64, 32, nvfp4=True)
    assert use_w4a4(torch.nn.ModuleList([odd, even])) == 1 and not odd.w4a4 and even.w4a4


def test_nvfp4_backend_variable(monkeypatch):
    monkeypatch.setenv(env.NVFP4_BACKEND, "Triton")
    assert env.nvfp4_backend() == "triton"
    monkeypatch.setenv(env.NVFP4_BACKEND, "w4a4")
    with pytest.raises(ValueError, match="EPSERVE_NVFP4_BACKEND='w4a4': expected one of auto, triton, scaled_mm"):
        env.nvfp4_backend()
