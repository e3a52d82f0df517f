"""The fused small ops of a CPU decode step (``kernels/cpu_ops*.c``) against their torch references:
paged MLA decode, the grouped top-k gate, RMSNorm, rotary embedding, MLA's latent append and per-head
projections, the dispatchers' grouping by expert and the weighted combine; the references wherever a kernel
does not apply (FP8 cache, fp16, too many rows, a trace, gradients, no library)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from epserve.kernels import (
    append_latent,
    cpu,
    cpu_ops,
    head_matmul,
    rms_norm,
    rms_norm_ref,
    rope_heads,
    rope_ref,
)
from epserve.kernels.fp8 import FP8_DTYPE
from epserve.kernels.gate import grouped_topk, grouped_topk_ref
from epserve.kernels.mla_decode import paged_mla_decode, paged_mla_decode_ref
from epserve.kernels.ops import group_by_expert, weighted_combine

pytestmark = pytest.mark.skipif(not cpu.available(cpu.OPS), reason="the fused CPU ops need AVX2, FMA and a C compiler")


@pytest.fixture
def without_kernels(monkeypatch):
    """The fused ops' library reported missing, as on a CPU without AVX2 or a compiler."""
    monkeypatch.setitem(cpu._available, cpu.OPS, False)


def _paged(g: torch.Generator, lens: list[int], dtype: torch.dtype, block_size: int = 16, d: int = 160,
           heads: int = 8):
    """A shuffled paged cache holding ``lens`` tokens per sequence, its block tables (int32) and queries."""
    per_seq = max(-(-n // block_size) for n in lens) or 1
    num_blocks = per_seq * len(lens) + 3
    cache = torch.randn(num_blocks, block_size, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: per_seq * len(lens)].view(len(lens), per_seq).int()
    q = torch.randn(len(lens), heads, d, generator=g)
    return q, cache, tables, torch.tensor(lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lens", [[1], [5, 0, 64], [300, 17, 1, 33]])
@pytest.mark.parametrize("heads", [8, 6, 1])  # whole and partial groups of the kernel's four heads
def test_mla_decode_matches_the_reference(dtype, lens, heads):
    q, cache, tables, seq_lens = _paged(torch.Generator().manual_seed(len(lens)), lens, dtype, heads=heads)
    ours = paged_mla_decode(q, cache, tables, seq_lens, 0.1, 128)
    ref = paged_mla_decode_ref(q, cache, tables, seq_lens, 0.1, 128)
    direct = cpu_ops.mla_decode(q, cache, tables, seq_lens, 0.1, 128)
    assert direct is not None and torch.equal(direct, ours)  # the front end took the kernel
    assert ours.dtype == torch.float32 and ours.shape == (len(lens), heads, 128)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert not ours[torch.tensor(lens) == 0].any()  # empty sequences come out zero


@pytest.mark.parametrize("d", [168, 160])  # eight columns at a time (AVX2), sixteen where AVX-512 takes them
def test_mla_decode_both_widths_match_the_reference(d):
    q, cache, tables, seq_lens = _paged(torch.Generator().manual_seed(d), [40, 7, 0], torch.bfloat16, d=d)
    ours = cpu_ops.mla_decode(q, cache, tables, seq_lens, 0.1, 128)
    torch.testing.assert_close(ours, paged_mla_decode_ref(q, cache, tables, seq_lens, 0.1, 128), rtol=1e-5, atol=1e-5)


def test_mla_decode_keeps_the_checks_and_leaves_fp8_to_the_reference():
    q, cache, tables, seq_lens = _paged(torch.Generator().manual_seed(0), [20, 3], torch.bfloat16)
    with pytest.raises(ValueError, match="seq_lens"):  # past the block table's capacity
        paged_mla_decode(q, cache, tables, torch.tensor([20, 10_000]), 0.1, 128)
    with pytest.raises(ValueError, match="last dim"):
        paged_mla_decode(q[..., :100], cache, tables, seq_lens, 0.1, 128)
    bad = tables.clone()
    bad[0, 1] = cache.shape[0]  # a block the first sequence reaches, past the cache
    with pytest.raises(IndexError, match="outside the cache"):
        paged_mla_decode(q, cache, bad, seq_lens, 0.1, 128)
    fp8 = (cache.float() / 4).to(FP8_DTYPE)
    scale = torch.tensor(4.0)
    assert cpu_ops.mla_decode(q, fp8, tables, seq_lens, 0.1, 128) is None
    assert torch.equal(paged_mla_decode(q, fp8, tables, seq_lens, 0.1, 128, scale),
                       paged_mla_decode_ref(q, fp8, tables, seq_lens, 0.1, 128, scale))


GATES = [  # (experts, top_k, n_group, topk_group, method, scoring, bias, a logical -> physical table)
    (64, 6, 8, 4, "noaux_tc", "sigmoid", True, False),
    (256, 8, 8, 4, "noaux_tc", "sigmoid", True, True),
    (64, 6, 8, 3, "group_limited_greedy", "softmax", False, True),
    (16, 2, 1, 1, "greedy", "softmax", False, False),
    (32, 4, 4, 2, "greedy", "sigmoid", False, False),  # greedy ignores the groups
]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("case", GATES, ids=[f"{c[4]}-{c[5]}-{c[0]}" for c in GATES])
def test_gate_matches_the_reference(case, norm):
    e, k, n_group, topk_group, method, scoring, with_bias, with_table = case
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(9, e, generator=g)
    kw = dict(top_k=k, n_group=n_group, topk_group=topk_group, method=method, scoring=scoring,
              norm_topk_prob=norm, routed_scaling_factor=2.5,
              bias=torch.randn(e, generator=g) * 0.2 if with_bias else None,
              logical_to_physical=torch.randperm(e, generator=g) + 100 if with_table else None)
    ids, weights = grouped_topk(logits, **kw)
    ref_ids, ref_weights = grouped_topk_ref(logits, **kw)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (9, k)
    order, ref_order = ids.sort(dim=1), ref_ids.sort(dim=1)  # the order within a row is unspecified
    assert torch.equal(order.values, ref_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices))


def test_gate_keeps_its_argument_checks():
    with pytest.raises(ValueError, match="topk_group"):
        grouped_topk(torch.randn(2, 64), top_k=6, n_group=8, topk_group=9, method="noaux_tc", scoring="sigmoid",
                     norm_topk_prob=True, routed_scaling_factor=1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 1024, generator=g) * 3).to(dtype)
    w = torch.randn(1024, generator=g).to(dtype)
    ours, ref = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert ours.dtype == dtype and ours.shape == x.shape
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-6  # a bf16 rounding either side at most
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)
    latent = torch.randn(3, 160, generator=g).to(dtype)  # a split's strided view, and a 3-D input
    view = latent[:, :128]
    torch.testing.assert_close(rms_norm(view, w[:128], 1e-6).float(), rms_norm_ref(view, w[:128], 1e-6).float(),
                               rtol=tol, atol=tol)
    x3 = x.view(5, 2, 512)
    torch.testing.assert_close(rms_norm(x3, w[:512], 1e-6).float(), rms_norm_ref(x3, w[:512], 1e-6).float(),
                               rtol=tol, atol=tol)


def test_rms_norm_outside_the_kernel_is_the_reference():
    w = torch.randn(64)
    for x, weight in [(torch.randn(2, 64).half(), w.half()),  # no fp16 kernel
                      (torch.randn(2, 64).bfloat16(), w)]:  # mixed dtypes promote as torch does
        assert cpu_ops.rms_norm(x, weight, 1e-6) is None
        assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_matmul_matches_bmm(dtype):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 8, 96, generator=g).to(dtype)[..., :64]  # q_nope: a view of q
    w = torch.randn(8, 64, 128, generator=g)
    ours = head_matmul(q, w)
    assert cpu_ops.head_matmul(q, w) is not None
    torch.testing.assert_close(ours, torch.bmm(q.float().transpose(0, 1), w).transpose(0, 1), rtol=1e-5, atol=1e-5)
    w16 = w.bfloat16()  # bf16 absorbed weights (FP8 models): the bmm in bf16, as before
    assert cpu_ops.head_matmul(q, w16) is None
    assert torch.equal(head_matmul(q, w16), torch.bmm(q.to(w16.dtype).transpose(0, 1), w16).transpose(0, 1))


@pytest.mark.parametrize("batch", [1, 16])
def test_head_matmul_sums_over_k_in_order_whatever_the_blocking(batch):
    """Each output is x[b, h, 0] w[h, 0] + x[b, h, 1] w[h, 1] + ... in that order, each product and sum
    rounded on its own: registers over 32 columns, the scalar tail (N = 40) and, at batch 16, two threads
    give those exact values."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(batch, 8, 64, generator=g)
    w = torch.randn(8, 64, 40, generator=g)
    want = torch.zeros(batch, 8, 40)
    for k in range(64):
        want = want + x[:, :, k : k + 1] * w[:, k].unsqueeze(0)
    assert torch.equal(cpu_ops.head_matmul(x, w), want)


def test_without_the_library_every_op_is_its_reference(without_kernels):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 64, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    q, cache, tables, seq_lens = _paged(g, [7, 2], torch.float32)
    assert torch.equal(paged_mla_decode(q, cache, tables, seq_lens, 0.1, 128),
                       paged_mla_decode_ref(q, cache, tables, seq_lens, 0.1, 128))
    kw = dict(top_k=6, n_group=8, topk_group=4, method="noaux_tc", scoring="sigmoid", norm_topk_prob=True,
              routed_scaling_factor=1.0)
    logits = torch.randn(3, 64, generator=g)
    assert all(torch.equal(a, b) for a, b in zip(grouped_topk(logits, **kw), grouped_topk_ref(logits, **kw)))


def test_traces_take_the_references():
    """Under a fake-tensor trace (what torch.compile sees) no C call is made: the ops trace as before."""
    with FakeTensorMode():
        x, w = torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
        assert rms_norm(x, w, 1e-6).shape == (2, 64)
        assert head_matmul(torch.randn(2, 8, 64), torch.randn(8, 64, 128)).shape == (2, 8, 128)
        ids, weights = grouped_topk(torch.randn(3, 64), top_k=6, n_group=8, topk_group=4, method="noaux_tc",
                                    scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0)
        assert ids.shape == weights.shape == (3, 6)
        q, cos = torch.randn(2, 8, 96), torch.randn(2, 16)
        assert rope_heads(q, cos, cos, True, 32).shape == (2, 8, 96)
        append_latent(torch.randn(2, 160), torch.randn(128), 1e-6, cos, cos, True, torch.tensor([0, 1]),
                      torch.zeros(4, 160), 128)


def test_compiled_norm_and_projection_equal_eager():
    w = torch.randn(64)
    x = torch.randn(3, 64)
    wq = torch.randn(8, 32, 16)
    q = torch.randn(3, 8, 32)

    def f(x, q):
        return rms_norm(x, w, 1e-6), head_matmul(q, wq)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for a, b in zip(compiled(x, q), f(x, q)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gradients_flow_through_the_reference():
    """The training model shares RMSNorm: with gradients on, the norm is torch's and differentiable."""
    x = torch.randn(2, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is not None
    with torch.no_grad():
        assert cpu_ops.rms_norm(x, w, 1e-6) is not None  # inference: the kernel


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_heads_equals_the_reference_bit_for_bit(dtype, interleave):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(5, 8, 96, generator=g).to(dtype)
    cos, sin = torch.randn(5, 16, generator=g).to(dtype), torch.randn(5, 16, generator=g).to(dtype)
    nope, pe = q.split([64, 32], dim=-1)
    want = torch.cat([nope, rope_ref(pe, cos, sin, interleave)], dim=-1)
    x = q.clone()
    got = rope_heads(x, cos, sin, interleave, 32)
    assert got.data_ptr() == x.data_ptr()  # rotated in place: no cat
    assert torch.equal(got, want)  # each bf16 product, difference and sum rounded as torch rounds it


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_append_latent_writes_what_the_reference_writes(dtype, cache_dtype):
    g = torch.Generator().manual_seed(5)
    latent = torch.randn(4, 170, generator=g).to(dtype)[:, :160]  # a view of the fused projection's output
    cos, sin = torch.randn(4, 16, generator=g).to(dtype), torch.randn(4, 16, generator=g).to(dtype)
    w = torch.randn(128, generator=g).to(dtype)
    slots = torch.tensor([9, 0, 4, 5])
    ours, ref = torch.zeros(12, 160, dtype=cache_dtype), torch.zeros(12, 160, dtype=cache_dtype)
    append_latent(latent, w, 1e-6, cos, sin, True, slots, ours, 128)
    c_kv, k_pe = latent.split([128, 32], dim=-1)
    rows = torch.cat([rms_norm_ref(c_kv, w, 1e-6), rope_ref(k_pe, cos, sin, True)], dim=-1)
    ref.index_copy_(0, slots, rows.to(cache_dtype))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not ours[untouched].any()
    assert torch.equal(ours[:, 128:], ref[:, 128:])  # the rotary part bit for bit
    tol = 8e-3 if torch.bfloat16 in (dtype, cache_dtype) else 1e-6  # the norm's mean: a rounding either side
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)


def test_append_latent_refuses_a_slot_outside_the_cache_and_writes_nothing():
    latent, w = torch.randn(2, 160), torch.randn(128)
    cos, sin = torch.randn(2, 16), torch.randn(2, 16)
    cache = torch.zeros(8, 160)
    with pytest.raises(IndexError, match="outside the cache's 8 rows"):
        append_latent(latent, w, 1e-6, cos, sin, True, torch.tensor([3, 8]), cache, 128)
    assert not cache.any()


def test_grouping_and_combine_equal_torch_bit_for_bit(monkeypatch):
    """The dispatchers' grouping (a stable sort by expert) and the weighted combine (index_add_'s order
    and roundings: products in the dtype, sums in fp32) give torch's exact tensors."""
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 16, (11, 4), generator=g)
    cases = [(torch.randn(44, 256, generator=g).to(dt), torch.randint(0, 11, (44,), generator=g),
              torch.rand(44, generator=g)) for dt in (torch.bfloat16, torch.float32)]
    fused = [group_by_expert(ids, 16)] + [weighted_combine(y, t, w, 11) for y, t, w in cases]
    monkeypatch.setitem(cpu._available, cpu.OPS, False)
    torch_ = [group_by_expert(ids, 16)] + [weighted_combine(y, t, w, 11) for y, t, w in cases]
    order, counts = fused[0]
    assert torch.equal(order, torch_[0][0]) and torch.equal(counts, torch_[0][1])
    assert all(torch.equal(a, b) for a, b in zip(fused[1:], torch_[1:]))


def test_grouping_an_id_out_of_range_still_raises():
    with pytest.raises((IndexError, RuntimeError)):
        group_by_expert(torch.tensor([[0, 16]]), 16)
    assert cpu_ops.group_by_expert(torch.tensor([[0, 16]]), 16) is None
    assert cpu_ops.weighted_combine(torch.randn(2, 8), torch.tensor([0, 5]), torch.rand(2), 3) is None
