"""The CPU's NVFP4 kernels (``kernels/cpu_nvfp4.c``, front end ``kernels.cpu_nvfp4``) against the ops' torch
references (``kernels.nvfp4``): the linear (decode rows, tiles of rows, the prefill path) and the routed experts
(counts read by the kernel), fp32 and bf16 activations, every e2m1 code, the largest e4m3 scale, per-part global
scales; and that the ops run them on the CPU."""

from __future__ import annotations

import pytest
import torch

from epserve.kernels import cpu, cpu_nvfp4
from epserve.kernels.nvfp4 import (
    dequantize_rows,
    nvfp4_linear,
    nvfp4_linear_ref,
    nvfp4_moe_swiglu,
    nvfp4_moe_swiglu_ref,
)
from epserve.kernels.opdef import record_calls

pytestmark = pytest.mark.skipif(not cpu.available(cpu.NVFP4), reason="the CPU NVFP4 kernels are not available")

E4M3_MAX = 0x7E  # 448, the largest finite e4m3fn


def _weight(*shape: int, parts: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random NVFP4 weight [..., N, K]: every byte (so every code, 0 and 8, the zeros, among them), block scales
    from small subnormals up to the largest e4m3 (in the first row), fp32 global scales [..., parts]."""
    *lead, n, k = shape
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, generator=g)
    packed[..., 1, :] = torch.tensor([0x00, 0x88, 0x80, 0x08], dtype=torch.uint8).repeat(k // 8)  # +-0 codes
    scales = torch.randint(0x01, 0x60, (*lead, n, k // 16), dtype=torch.uint8, generator=g)
    scales[..., 0, :] = E4M3_MAX
    global_scales = torch.rand(*lead, parts, generator=g) * 0.01 + 1e-3
    return packed, scales.view(torch.float8_e4m3fn), global_scales


def _bound(x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """sum_k |x[m, k] W[n, k]|: what fp32 summation order can move a result by (times a few ulps)."""
    return x.float().abs() @ dense.abs().T


def _close(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    # bf16: the two fp32 sums may round to neighbouring bf16 values, one ulp (at most 2^-7 of the value) apart
    allowed = 1e-5 * bound + (2**-7 * ref.float().abs() if ref.dtype == torch.bfloat16 else 0)
    assert (diff <= allowed).all(), f"{(diff - allowed).max().item()} over"


def _dense(packed: torch.Tensor, scales: torch.Tensor, global_scales: torch.Tensor) -> torch.Tensor:
    return dequantize_rows(packed, scales, global_scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n,k,parts", [(35, 48, 1), (38, 80, 2), (70, 96, 2), (33, 208, 1), (22, 259 * 16, 2)])
def test_linear_matches_the_reference(dtype, n, k, parts):
    packed, scales, global_scales = _weight(n, k, parts=parts)
    dense = _dense(packed, scales, global_scales)
    for m in (1, 3, 6, 16, 17, 100):  # (bf16: in groups of up to 8 streamed rows; fp32 past 32: torch GEMM)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        with record_calls() as calls:
            out = nvfp4_linear(x, packed, scales, global_scales)
        assert calls == [("nvfp4_linear", "epserve.kernels.cpu_nvfp4:linear")]
        _close(out, nvfp4_linear_ref(x, packed, scales, global_scales), _bound(x, dense))


def test_linear_takes_leading_dimensions_and_declines_what_it_cannot_run():
    packed, scales, global_scales = _weight(16, 32)
    x = torch.randn(2, 3, 32)
    out = nvfp4_linear(x, packed, scales, global_scales)
    assert out.shape == (2, 3, 16)
    torch.testing.assert_close(out, nvfp4_linear_ref(x, packed, scales, global_scales), rtol=1e-5, atol=1e-6)
    assert cpu_nvfp4.linear_takes(x, packed, scales, global_scales)
    assert not cpu_nvfp4.linear_takes(x.half(), packed, scales, global_scales)  # fp16: the reference
    assert not cpu_nvfp4.linear_takes(x.transpose(0, 1), packed, scales, global_scales)  # not contiguous
    assert not cpu_nvfp4.linear_takes(x[..., :16], packed, scales, global_scales)  # K disagrees
    assert not cpu_nvfp4.linear_takes(x, packed, scales.view(torch.uint8), global_scales)
    assert not cpu_nvfp4.linear_takes(x, packed, scales, torch.ones(3))  # 3 parts do not divide 16 rows


def test_the_dequantize_kernel_gives_the_references_values_bit_for_bit():
    """Every e4m3 scale (subnormals, the largest, the NaN codes 0x7F and 0xFF, negatives) in rows of 259 blocks:
    the kernel converts a row's scales 256 blocks at a time, 16 at a time, here the last three alone."""
    packed, scales, global_scales = _weight(38, 259 * 16, parts=2)
    scales.view(torch.uint8).view(-1)[:] = (torch.arange(38 * 259) % 256).to(torch.uint8)
    dense = _dense(packed, scales, global_scales)
    assert dense.isnan().any() and (dense < 0).any()
    for lo, hi in ((0, 38), (5, 21)):
        torch.testing.assert_close(cpu_nvfp4.dequantize(packed, scales, global_scales, lo, hi), dense[lo:hi],
                                   rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("blocks", [259, 256])
def test_linear_takes_every_scale_code(dtype, blocks):
    """Rows of 259 blocks (bf16 rows of x streamed 128 columns at a time, the last three blocks alone) or 256 (no
    rest: two weight rows side by side, 13 rows of x in two groups) whose block scales run through every finite
    e4m3 code (negatives, subnormals, the largest) match the reference; a NaN code (0x7F inside a stretch, 0xFF in
    the last block) makes its row NaN, as the reference's."""
    packed, scales, global_scales = _weight(6, blocks * 16, parts=2)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = scales.view(torch.uint8)
    codes[:] = finite[torch.arange(6 * blocks).view(6, blocks) % len(finite)]
    codes[4, 130], codes[5, blocks - 1] = 0x7F, 0xFF
    dense = _dense(packed, scales, global_scales)
    for m in (1, 2, 5, 8, 13):
        x = torch.randn(m, blocks * 16, generator=torch.Generator().manual_seed(m)).to(dtype)
        out = nvfp4_linear(x, packed, scales, global_scales)
        ref = nvfp4_linear_ref(x, packed, scales, global_scales)
        assert out[:, 4:].isnan().all() and ref[:, 4:].isnan().all()
        _close(out[:, :4], ref[:, :4], _bound(x, dense[:4]))


def _experts(e: int, h: int, inter: int) -> tuple[torch.Tensor, ...]:
    w13, s13, g13 = _weight(e, 2 * inter, h, parts=2, seed=1)
    w2, s2, g2 = _weight(e, h, inter, parts=1, seed=2)
    return w13, s13, g13, w2, s2, g2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("counts", [[1, 0, 2, 0], [0, 0, 0, 1], [5, 17, 0, 3], [0, 0, 0, 0], [40, 0, 60, 2]])
@pytest.mark.parametrize("h,inter", [(48, 32), (144, 128)])
def test_experts_match_the_reference(dtype, counts, h, inter):
    """Experts without rows, one expert's rows in two tiles (17), counts summing to fewer rows than x (the rest
    zero), many rows; H = 48 and I = 32 (K % 64 != 0 both ways), or H = 144 and I = 128 (bf16 rows streamed
    128 columns at a time, H with a rest)."""
    weights = _experts(4, h, inter)
    x = torch.randn(sum(counts) + 3, h, generator=torch.Generator().manual_seed(len(counts) + sum(counts))).to(dtype)
    device_counts = torch.tensor(counts)
    with record_calls() as calls:
        out = nvfp4_moe_swiglu(x, device_counts, *weights)
    assert calls == [("nvfp4_moe_swiglu", "epserve.kernels.cpu_nvfp4:moe_swiglu")]
    ref = nvfp4_moe_swiglu_ref(x, counts, *weights)
    hidden = _reference_hidden(x, counts, weights)
    w13, s13, g13, w2, s2, g2 = weights
    bounds = torch.zeros(x.shape[0], h)
    start = 0
    for e, n in enumerate(counts):
        rows = slice(start, start + n)
        bounds[rows] = _bound(hidden[rows], _dense(w2[e], s2[e], g2[e]))
        start += n
    # the intermediate's own summation order and silu's rounding (fp32), or a bf16 ulp of it (bf16), enter the
    # second sum: a few times (bf16: a bf16 ulp, 2^-8 = 1e-5 x 400) that sum's bound
    bounds = bounds * (400 if dtype == torch.bfloat16 else 10)
    _close(out, ref, bounds)
    assert not out[sum(counts):].any()
    assert torch.equal(nvfp4_moe_swiglu(x, counts, *weights), out)  # host counts: the same kernel


def _reference_hidden(x: torch.Tensor, counts: list[int], weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """silu(gate) * up per row, in fp32 (for the error bound of the down projection)."""
    w13, s13, g13 = weights[:3]
    out = torch.zeros(x.shape[0], w13.shape[1] // 2)
    start = 0
    for e, n in enumerate(counts):
        gate, up = nvfp4_linear_ref(x[start : start + n].float(), w13[e], s13[e], g13[e]).chunk(2, dim=-1)
        out[start : start + n] = torch.nn.functional.silu(gate) * up
        start += n
    return out


def test_experts_refuse_counts_past_the_rows_and_decline_other_shapes():
    weights = _experts(4, 48, 32)
    x = torch.randn(3, 48)
    with pytest.raises(ValueError, match="add up to more than the 3 rows"):
        cpu_nvfp4.moe_swiglu(x, torch.tensor([2, 2, 0, 0]), *weights)
    assert cpu_nvfp4.moe_swiglu_takes(x, torch.tensor([1, 0, 0, 0]), *weights)
    assert not cpu_nvfp4.moe_swiglu_takes(x, torch.tensor([1, 0, 0]), *weights)  # a count per expert
    assert not cpu_nvfp4.moe_swiglu_takes(x, torch.tensor([1, 0, 0, 0], dtype=torch.int32), *weights)
    assert not cpu_nvfp4.moe_swiglu_takes(x[:, :32], torch.tensor([1, 0, 0, 0]), *weights)
    assert not cpu_nvfp4.moe_swiglu_takes(x.half(), torch.tensor([1, 0, 0, 0]), *weights)
