"""The rest of a CPU decode step as C kernels (``kernels/cpu_ops*.c`` through ``kernels.cpu_ops``, and the
experts from device counts in ``kernels.cpu``): what lets a whole step record as kernel calls
(``kernels/cpu_graph.py``), each against the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from epserve.kernels import cpu, cpu_ops
from epserve.kernels.fused import rope_ref
from epserve.kernels.gate import grouped_topk, grouped_topk_ref

pytestmark = pytest.mark.skipif(not cpu.available(cpu.OPS), reason="the fused CPU ops need AVX2, FMA and a C compiler")


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gather_rows_is_indexing_then_casting_bit_for_bit(table_dtype, out_dtype):
    g = torch.Generator().manual_seed(7)
    table = torch.randn(30, 24, generator=g).to(table_dtype)
    ids = torch.tensor([29, 0, 7, 7])
    assert torch.equal(cpu_ops.gather_rows(table, ids, out_dtype), table[ids].to(out_dtype))
    with pytest.raises(IndexError, match="outside the table's 30 rows"):
        cpu_ops.gather_rows(table, torch.tensor([3, 30]), out_dtype)
    assert cpu_ops.gather_rows(table, ids.int(), out_dtype) is None  # int32 ids: the reference


def test_copy_add_and_cast_equal_torch_bit_for_bit():
    g = torch.Generator().manual_seed(8)
    q = torch.randn(3, 4, 96, generator=g).bfloat16()
    dst = torch.zeros(3, 4, 160)
    assert cpu_ops.copy_cast(dst[..., 128:], q[..., 64:])  # strided on both sides, widened
    assert torch.equal(dst[..., 128:], q[..., 64:].float()) and not dst[..., :128].any()
    back = torch.empty(3, 4, 32, dtype=torch.bfloat16)
    assert cpu_ops.copy_cast(back, dst[..., 128:]) and torch.equal(back, q[..., 64:])
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
        assert torch.equal(cpu_ops.add(a, b), a + b)
    assert cpu_ops.add(a, b.T.contiguous().T) is None  # not contiguous: the reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_silu_times_up(dtype):
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(6, 2 * 80, generator=g) * 3).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    ours = cpu_ops.silu_mul(x)
    ref = torch.nn.functional.silu(gate) * up
    assert ours.dtype == dtype and ours.shape == (6, 80)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    else:  # libm's expf against torch's vectorized exp: a bf16 rounding may land one step apart, rarely
        assert (ours != ref).float().mean() < 0.02
        torch.testing.assert_close(ours.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_local_dispatch_is_the_torch_permutation_bit_for_bit():
    """The grouping (a stable sort by expert), each copy's token, weight and row: what ``LocalDispatcher``
    computes with torch."""
    g = torch.Generator().manual_seed(10)
    t, k, e = 7, 3, 12
    x = torch.randn(t, 64, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    rows, counts, token_idx, w = cpu_ops.local_dispatch(x, ids, weights, e)
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=e))
    assert torch.equal(token_idx, order // k)
    assert torch.equal(w, weights.reshape(-1)[order])
    assert torch.equal(rows, x[order // k])
    ids[2, 1] = e  # out of range: None, so the reference raises
    assert cpu_ops.local_dispatch(x, ids, weights, e) is None


def test_index_add_counts_is_index_add():
    dst = torch.arange(6)
    want = dst.clone().index_add_(0, torch.tensor([5, 0, 5]), torch.tensor([1, 2, 3]))
    assert cpu_ops.index_add_counts(dst, torch.tensor([5, 0, 5]), torch.tensor([1, 2, 3])) and torch.equal(dst, want)
    assert not cpu_ops.index_add_counts(dst, torch.tensor([6]), torch.tensor([1]))  # out of range: nothing added
    assert torch.equal(dst, want)


def test_head_matmul_writes_a_strided_or_bf16_output():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 8, 96, generator=g).bfloat16()[..., :64]
    w = torch.randn(8, 64, 40, generator=g)
    want = cpu_ops.head_matmul(x, w)
    wide = torch.zeros(3, 8, 48)
    assert cpu_ops.head_matmul(x, w, out=wide[..., :40]) is not None
    assert torch.equal(wide[..., :40], want) and not wide[..., 40:].any()
    half = torch.empty(3, 8, 40, dtype=torch.bfloat16)
    assert cpu_ops.head_matmul(x, w, out=half) is half and torch.equal(half, want.bfloat16())  # rounded once
    assert cpu_ops.head_matmul(x, w, out=torch.empty(3, 8, 41)) is None


def test_gate_maps_ids_through_a_strided_table():
    """A replica table's first column (``MoE.route``: one slot per expert), read in place."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(5, 64, generator=g)
    table = torch.randperm(128, generator=g).view(64, 2)
    kw = dict(top_k=6, n_group=8, topk_group=4, method="noaux_tc", scoring="sigmoid", norm_topk_prob=True,
              routed_scaling_factor=2.5, bias=torch.randn(64, generator=g) * 0.1)
    ids, weights = grouped_topk(logits, **kw, logical_to_physical=table[:, 0])
    ref_ids, ref_weights = grouped_topk_ref(logits, **kw, logical_to_physical=table[:, 0].contiguous())
    assert torch.equal(ids.sort(dim=1).values, ref_ids.sort(dim=1).values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_from_device_counts_equal_the_host_counts_kernel(dtype):
    """``moe_swiglu_counts`` reads the counts itself: bit for bit the host-offsets kernel where every expert
    fits one row tile, larger experts in tiles, rows past the counts zero, too many counts refused."""
    if not cpu.available(dtype):
        pytest.skip("no kernels for this dtype here")
    g = torch.Generator().manual_seed(13)
    w13 = (torch.randn(5, 2 * 64, 96, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(5, 96, 64, generator=g) * 0.1).to(dtype)
    counts = [3, 0, 16, 1, 2]
    x = torch.randn(sum(counts) + 2, 96, generator=g).to(dtype)  # two padding rows
    got = cpu.moe_swiglu_counts(x, torch.tensor(counts), w13, w2)
    assert torch.equal(got[:-2], cpu.moe_swiglu(x[:-2], counts, w13, w2)) and not got[-2:].any()
    big = [20, 1, 0, 0, 3]  # 20 rows: two tiles
    xb = torch.randn(24, 96, generator=g).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    want, start = [], 0
    for e, n in enumerate(big):  # each expert through torch
        gate, up = torch.nn.functional.linear(xb[start : start + n], w13[e]).chunk(2, dim=-1)
        want.append(torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e]))
        start += n
    torch.testing.assert_close(cpu.moe_swiglu_counts(xb, torch.tensor(big), w13, w2).float(),
                               torch.cat(want).float(), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="more than the 24 rows"):
        cpu.moe_swiglu_counts(xb, torch.tensor([20, 5, 0, 0, 0]), w13, w2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_sized_rows_run_threaded_with_the_same_bits(dtype):
    """Past ``PARALLEL_MIN`` values (a prefill's rows) the row-wise ops run on every thread: the same bits
    as the same rows taken a few at a time (one thread), and torch's where the op equals torch's."""
    assert torch.get_num_threads() > 1 or pytest.skip("one thread: nothing runs threaded")
    g = torch.Generator().manual_seed(11)
    t, d, e, k = 600, 256, 16, 4  # 153,600 values a tensor: threaded
    x = torch.randn(t, d, generator=g).to(dtype)
    w = torch.randn(d, generator=g).to(dtype)

    def chunks(fn):  # noqa: ANN001, ANN202
        return torch.cat([fn(x[i : i + 8]) for i in range(0, t, 8)])  # 2,048 values a call: one thread

    assert torch.equal(cpu_ops.rms_norm(x, w, 1e-6), chunks(lambda r: cpu_ops.rms_norm(r, w, 1e-6)))
    assert torch.equal(cpu_ops.silu_mul(x), chunks(cpu_ops.silu_mul))
    b = torch.randn(t, d, generator=g).to(dtype)
    assert torch.equal(cpu_ops.add(x, b), x + b)
    wide = torch.empty(t, d, dtype=torch.float32)
    assert cpu_ops.copy_cast(wide, x) and torch.equal(wide, x.float())
    ids = torch.randint(0, t, (t,), generator=g)
    assert torch.equal(cpu_ops.gather_rows(x, ids, torch.float32), x[ids].float())
    q = torch.randn(t, 8, 96, generator=g).to(dtype)
    cos, sin = torch.randn(t, 16, generator=g).to(dtype), torch.randn(t, 16, generator=g).to(dtype)
    want = torch.cat([q[..., :64], rope_ref(q[..., 64:], cos, sin, True)], dim=-1)
    assert cpu_ops.rope_heads(q, cos, sin, True) and torch.equal(q, want)
    latent = torch.randn(t, 160, generator=g).to(dtype)
    nw = torch.randn(128, generator=g).to(dtype)
    slots = torch.randperm(t, generator=g)
    threaded, serial = torch.zeros(t, 160, dtype=dtype), torch.zeros(t, 160, dtype=dtype)
    assert cpu_ops.append_latent(latent, nw, 1e-6, cos, sin, True, slots, threaded, 128)
    for i in range(0, t, 8):
        cpu_ops.append_latent(latent[i : i + 8], nw, 1e-6, cos[i : i + 8], sin[i : i + 8], True, slots[i : i + 8],
                              serial, 128)
    assert torch.equal(threaded, serial)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    rows, counts, token_idx, row_w = cpu_ops.local_dispatch(x, topk, weights, e)
    order = torch.argsort(topk.reshape(-1), stable=True)
    assert torch.equal(rows, x[order // k]) and torch.equal(token_idx, order // k)
    combined = cpu_ops.weighted_combine(rows, token_idx, row_w, t)
    products = (rows * row_w.to(dtype)[:, None]).float()  # index_add_'s roundings: products in the dtype
    assert torch.equal(combined, torch.zeros(t, d).index_add_(0, token_idx, products).to(dtype))
