"""W4A4 wiring: ``model.layers.use_w4a4`` switches an NVFP4 model's linears to the W4A4 op (activations quantized
by the checkpoint's input scale), the routed experts staying W4A16; ``EPSERVE_NVFP4_BACKEND`` is validated."""

from __future__ import annotations

import pytest
import torch

from epserve import env
from epserve.checkpoint.nvfp4 import nvfp4_global_scale, nvfp4_quantize
from epserve.kernels import opdef
from epserve.kernels.nvfp4_w4a4 import nvfp4_w4a4_ref
from epserve.model.layers import GatedMLP, use_w4a4


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


def test_nvfp4_backend_variable(monkeypatch):
    monkeypatch.setenv(env.NVFP4_BACKEND, "Triton")
    assert env.nvfp4_backend() == "triton"
    monkeypatch.setenv(env.NVFP4_BACKEND, "w4a4")
    with pytest.raises(ValueError, match="EPSERVE_NVFP4_BACKEND='w4a4': expected one of auto, triton, scaled_mm"):
        env.nvfp4_backend()
