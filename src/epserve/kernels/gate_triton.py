"""The DeepSeek grouped top-k gate as one Triton kernel (semantics and reference: ``kernels.gate``).

One program routes ``BT`` tokens (one on the GPU). A token's E scores sit in registers as a
``[G, E/G]`` tile, both sides padded to powers of two (the padding is -inf and never chosen), so a
group's best and second-best are reductions over the last axis. Groups, then experts (over the tile
flattened), are picked by iterated argmax-and-mask: ``topk_group`` and ``top_k`` unrolled rounds of
one ``max`` with its index (ties to the lowest index), that index masked out after. The weights are
the chosen experts' unbiased scores recomputed from their logits (the same ops, so the same bits as
in the tile, without a reduction per round), normalized and scaled; the ids go through
``logical_to_physical`` before the one store. Everything is shape-static (no host sync, no
data-dependent shape), so the kernel can be captured in a CUDA graph. Ids come out best first.
Divisions round to nearest as torch's do; ``exp`` on the GPU is Triton's fast one (a few ulp), so
near-ties may pick differently from the CPU reference.

The wrapper takes CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1`` (how the tests run it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from epserve.kernels.gate import check_args, is_grouped

# Tokens per program. On the GPU one token per program, its padded scores spread over one warp per
# 256 (DeepSeek-V3: 8 per lane), so every reduction stays in the warp's registers (no shared memory,
# no barriers). Under the interpreter, where each program costs a tenth of a second or more whatever
# its size, a block of tokens of up to INTERPRET_TILE padded scores.
INTERPRET_TILE = 16384
MAX_TOKENS = 64


@triton.jit
def _score(x, m, s, SOFTMAX: tl.constexpr):
    """Score of fp32 logits ``x``: sigmoid, or softmax given the row's max ``m`` and sum ``s`` of exp."""
    if SOFTMAX:
        return tl.math.div_rn(tl.exp(x - m), s)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["T"])  # one compiled variant for every token count (CUDA graphs)
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, map_ptr, ids_ptr, w_ptr, T, stride_lt, stride_le, scale,
    G: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr, GSP: tl.constexpr, BT: tl.constexpr,
    TOP_K: tl.constexpr, KP: tl.constexpr, TOPK_GROUP: tl.constexpr,
    SOFTMAX: tl.constexpr, GROUPED: tl.constexpr, TOP2: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MAP: tl.constexpr, NORM: tl.constexpr,
):
    tok = tl.program_id(0) * BT + tl.arange(0, BT)
    t_mask = tok < T
    rows = logits_ptr + tok.to(tl.int64) * stride_lt  # [BT]
    g = tl.arange(0, GP)
    j = tl.arange(0, GSP)
    valid = (g[:, None] < G) & (j[None, :] < GS)  # [GP, GSP]: the real experts
    eid = g[:, None] * GS + j[None, :]  # their ids (junk in the padding, never read)
    x = tl.load(rows[:, None, None] + (eid.to(tl.int64) * stride_le)[None, :, :],
                mask=t_mask[:, None, None] & valid[None, :, :], other=0.0).to(tl.float32)
    x = tl.where(valid[None, :, :], x, float("-inf"))  # [BT, GP, GSP]
    m = tl.zeros((BT,), dtype=tl.float32)
    s = tl.zeros((BT,), dtype=tl.float32)
    if SOFTMAX:
        m = tl.max(tl.max(x, axis=2), axis=1)
        s = tl.sum(tl.sum(tl.exp(x - m[:, None, None]), axis=2), axis=1)
    choice = _score(x, m[:, None, None], s[:, None, None], SOFTMAX)  # 0 in the padding
    if HAS_BIAS:
        b = tl.load(bias_ptr + tl.where(valid, eid, 0), mask=valid, other=0.0).to(tl.float32)
        choice = choice + b[None, :, :]
    choice = tl.where(valid[None, :, :], choice, float("-inf"))

    if GROUPED:  # group score: the best, + the second best (its first holder masked out) for noaux_tc
        best, first = tl.max(choice, axis=2, return_indices=True, return_indices_tie_break_left=True)
        if TOP2:
            second = tl.where(j[None, None, :] == first[:, :, None], float("-inf"), choice)
            best = best + tl.max(second, axis=2)
        gscore = tl.where(g[None, :] < G, best, float("-inf"))  # [BT, GP]
        keep = tl.zeros((BT, GP), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            _, pick = tl.max(gscore, axis=1, return_indices=True, return_indices_tie_break_left=True)
            hit = g[None, :] == pick[:, None]
            keep = tl.where(hit, 1, keep)
            gscore = tl.where(hit, float("-inf"), gscore)
        choice = tl.where(keep[:, :, None] != 0, choice, float("-inf"))

    flat = tl.reshape(choice, (BT, GP * GSP))  # column c: group c // GSP, expert c % GSP in it
    col = tl.arange(0, GP * GSP)[None, :]
    kk = tl.arange(0, KP)[None, :]
    cols = tl.zeros((BT, KP), dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        _, pick = tl.max(flat, axis=1, return_indices=True, return_indices_tie_break_left=True)
        flat = tl.where(col == pick[:, None], float("-inf"), flat)
        cols = tl.where(kk == k, pick[:, None], cols)
    ids = tl.minimum((cols // GSP) * GS + cols % GSP, G * GS - 1)  # in range even for NaN scores

    # the weights: the chosen experts' unbiased scores, recomputed from their logits (same bits)
    out_mask = t_mask[:, None] & (kk < TOP_K)
    xk = tl.load(rows[:, None] + ids.to(tl.int64) * stride_le, mask=out_mask, other=0.0).to(tl.float32)
    weights = tl.where(kk < TOP_K, _score(xk, m[:, None], s[:, None], SOFTMAX), 0.0)
    if NORM:
        weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None] + 1e-20)
    weights = weights * scale
    if HAS_MAP:
        phys = tl.load(map_ptr + ids, mask=out_mask, other=0).to(tl.int64)
    else:
        phys = ids.to(tl.int64)
    out = tok.to(tl.int64)[:, None] * TOP_K + kk
    tl.store(ids_ptr + out, phys, mask=out_mask)
    tl.store(w_ptr + out, weights, mask=out_mask)


def grouped_topk_triton(
    logits: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    method: str,
    scoring: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor | None = None,
    logical_to_physical: torch.Tensor | None = None,
    tokens_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [T, E] (any float dtype, any strides) -> (ids int64 [T, K], weights fp32 [T, K]).
    ``tokens_per_program`` (a power of two) overrides the block size chosen per device (tests)."""
    check_args(logits, top_k, n_group, topk_group, method, scoring, bias, logical_to_physical)
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    grouped = is_grouped(method, n_group)
    groups = n_group if grouped else 1
    gp, gsp = triton.next_power_of_2(groups), triton.next_power_of_2(e // groups)
    tile = gp * gsp
    if tokens_per_program is not None:
        bt = tokens_per_program
    else:
        bt = 1 if logits.is_cuda else max(1, min(MAX_TOKENS, INTERPRET_TILE // tile))
    if bt < 1 or bt & (bt - 1):
        raise ValueError(f"tokens_per_program must be a power of two, got {bt}")
    table = logical_to_physical.contiguous() if logical_to_physical is not None else ids  # ids: unread
    _grouped_topk_kernel[(triton.cdiv(t, bt),)](
        logits, bias.contiguous() if bias is not None else weights, table, ids, weights,
        t, logits.stride(0), logits.stride(1), float(routed_scaling_factor),
        G=groups, GS=e // groups, GP=gp, GSP=gsp, BT=bt,
        TOP_K=top_k, KP=triton.next_power_of_2(top_k), TOPK_GROUP=topk_group if grouped else 1,
        SOFTMAX=scoring == "softmax", GROUPED=grouped, TOP2=method == "noaux_tc",
        HAS_BIAS=bias is not None, HAS_MAP=logical_to_physical is not None, NORM=bool(norm_topk_prob),
        num_warps=max(1, min(8, bt * tile // 256)), enable_fp_fusion=False,
    )
    return ids, weights
