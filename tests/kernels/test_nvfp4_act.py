"""NVFP4 activation quantization (kernels.nvfp4_act) against ModelOpt's codec (checkpoint.nvfp4), bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from epserve.checkpoint.nvfp4 import nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize
from epserve.kernels.nvfp4_act import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_round,
    nvfp4_act_dequant,
    nvfp4_act_quant,
    nvfp4_token_scale,
)


def _rows(m: int = 9, k: int = 64, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).unsqueeze(1)
    x[1] = 0  # an all-zero row
    x[2, :16] = 0  # an all-zero block
    x[3, 5] = 1e4  # one outlier: its blocks' neighbours round to 0, some to -0
    x[4, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5,
                              -5.0, -6.0])  # every tie, with block amax 6 (block scale 1 for global 1/448)
    return x.to(dtype)


def _per_row_oracle(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [nvfp4_quantize(x[i : i + 1], global_scale[i if global_scale.numel() > 1 else 0]) for i in range(len(x))]
    return torch.cat([r.weight for r in rows]), torch.cat([r.weight_scale for r in rows])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_quantization_is_modelopts_row_by_row(dtype):
    x = _rows(dtype=dtype)
    g = nvfp4_token_scale(x)
    g[4] = 1 / E4M3_MAX  # the tie row: block scale exactly 1, values exactly on the midpoints
    packed, scales = nvfp4_act_quant(x, g)
    want_packed, want_scales = _per_row_oracle(x, g)
    assert packed.dtype == torch.uint8 and packed.shape == (9, 32) and scales.shape == (9, 4)
    assert torch.equal(packed, want_packed)
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))
    assert packed[4, :8].tolist() == [0x20, 0x42, 0x64, 0x76, 0xA8, 0xCA, 0xEC, 0xFE]  # ties to even, signed
    back = nvfp4_act_dequant(packed, scales, g, torch.float32)
    want = torch.cat([nvfp4_dequantize(want_packed[i : i + 1], want_scales[i : i + 1], g[i]) for i in range(9)])
    assert torch.equal(back, want) and torch.equal(back[1], torch.zeros(64))
    assert nvfp4_act_dequant(packed, scales, g, torch.bfloat16).dtype == torch.bfloat16


def test_per_tensor_scale_is_modelopts_on_the_whole_tensor():
    """One global scale (a checkpoint's input_scale): the same as quantizing the tensor as a weight."""
    x = _rows(dtype=torch.float32)
    g = nvfp4_global_scale(x.abs().amax()).reshape(1)
    packed, scales = nvfp4_act_quant(x, g)
    want = nvfp4_quantize(x, g)
    assert torch.equal(packed, want.weight) and torch.equal(scales.float(), want.weight_scale.float())
    assert torch.equal(nvfp4_act_dequant(packed, scales, g, torch.float32), nvfp4_dequantize(*want))


def test_a_global_scale_too_small_saturates_instead_of_nan():
    x = torch.full((1, 16), 100.0)
    packed, scales = nvfp4_act_quant(x, torch.tensor([1e-3]))  # block scale 100 / 0.006 >> 448
    assert scales.float().item() == E4M3_MAX and packed.tolist() == [[0x77] * 8]


def test_token_scale_and_codes():
    x = torch.tensor([[0.0] * 16, [-3.0] + [1.0] * 15])
    assert torch.equal(nvfp4_token_scale(x), torch.tensor([1e-10, 3.0]) / (E2M1_MAX * E4M3_MAX))
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(e2m1_round(values), torch.tensor([*range(8), 0, *range(9, 16)], dtype=torch.uint8))
    assert e2m1_round(torch.tensor([7.0, -100.0, -0.1])).tolist() == [7, 15, 8]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_act_quant(torch.zeros(2, 24), torch.ones(2))
    with pytest.raises(ValueError, match=r"fp32 \[2\]"):
        nvfp4_act_quant(torch.zeros(2, 32), torch.ones(3))
    with pytest.raises(ValueError, match="block scales"):
        nvfp4_act_dequant(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float8_e4m3fn),
                          torch.ones(1), torch.float32)


def test_the_ops_trace_as_torch_code_without_host_reads():
    """Traced on fake tensors: the references' torch code (no value read on the host, no table copied to the
    device), which computes the same numbers; the custom ops' fakes give the shapes."""
    x = _rows(dtype=torch.float32)

    def quant_dequant(x: torch.Tensor) -> torch.Tensor:
        g = nvfp4_token_scale(x)
        packed, scales = nvfp4_act_quant(x, g)
        return nvfp4_act_dequant(packed, scales, g, torch.bfloat16)

    graph = make_fx(quant_dequant, tracing_mode="fake")(x)
    code = str(graph.code)
    assert "_local_scalar_dense" not in code and "_tensor_constant" not in code
    assert torch.equal(graph(x), quant_dequant(x))
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        packed, scales = torch.ops.epserve.nvfp4_act_quant(fx, torch.ops.epserve.nvfp4_token_scale(fx))
        out = torch.ops.epserve.nvfp4_act_dequant(packed, scales, fx.new_ones(1), torch.bfloat16)
    assert packed.shape == (9, 32) and scales.dtype == torch.float8_e4m3fn and out.shape == (9, 64)
