"""CPU decode kernels against torch's bf16 path (skipped where the CPU lacks AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epserve.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="CPU kernels need AVX512-BF16 and a C compiler")


@pytest.mark.parametrize("m", [1, 3, 16])
def test_linear_matches_torch(m):
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=g).bfloat16()
    w = (torch.randn(96, 256, generator=g) * 0.05).bfloat16()
    ours = cpu.linear(x, w)
    ref = x.float() @ w.float().T
    assert ours.dtype == torch.bfloat16 and ours.shape == (m, 96)
    assert torch.allclose(ours.float(), ref, rtol=1e-2, atol=1e-2)


def test_linear_falls_back_outside_its_domain():
    x = torch.randn(17, 64).bfloat16()  # too many rows for one weight pass
    w = torch.randn(8, 64).bfloat16()
    assert torch.equal(cpu.linear(x, w), F.linear(x, w))
    x32, w32 = x.float(), w.float()  # fp32 is torch's
    assert torch.equal(cpu.linear(x32, w32), F.linear(x32, w32))


def per_expert_torch(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    start, rows = 0, []
    for e, n in enumerate(counts):
        gate, up = F.linear(x[start : start + n], w13[e]).chunk(2, dim=-1)
        rows.append(F.linear(F.silu(gate) * up, w2[e]))
        start += n
    return torch.cat(rows)


def test_moe_swiglu_matches_per_expert_torch():
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 6, 128, 64
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * 0.1).bfloat16()
    counts = [2, 0, 5, 1, 0, 3]
    x = torch.randn(sum(counts), hidden, generator=g).bfloat16()
    ours = cpu.moe_swiglu(x, counts, w13, w2)
    ref = per_expert_torch(x, counts, w13, w2)
    assert ours is not None and ours.shape == ref.shape
    assert torch.allclose(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # One skewed expert past the kernel's row tile runs through torch inside the call.
    skew = [17, 5, 3, 6, 4, 2]
    xs = torch.randn(sum(skew), hidden, generator=g).bfloat16()
    got = cpu.moe_swiglu(xs, skew, w13, w2)
    ref = per_expert_torch(xs, skew, w13, w2)
    assert got is not None and torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert cpu.moe_swiglu(xs, [24], w13[:1], w2[:1]) is None  # mostly large groups: the grouped GEMM


def test_unbuildable_kernels_fall_back_to_torch(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(blocker))  # the kernels' folder cannot be created
    source = cpu._SOURCE.read_bytes() + b"\n/* rebuild */\n"
    monkeypatch.setattr(cpu, "_SOURCE", tmp_path / "cpu_bf16.c")
    (tmp_path / "cpu_bf16.c").write_bytes(source)  # a new hash, so nothing cached is reused
    cpu._library.cache_clear()
    monkeypatch.setattr(cpu, "_available", None)
    try:
        assert not cpu.available()
        x, w = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
        assert torch.equal(cpu.linear(x, w), F.linear(x, w))
    finally:
        cpu._library.cache_clear()
