"""The dispatchers' kernel ops, each declared once (``kernels.opdef``) with its torch reference: grouping token
copies by expert, the local dispatcher's whole permutation, the weighted combine every dispatcher ends with,
the experts' load counters, and the masked row gather of the ``symm_mem`` dispatcher. On the CPU in eager
steps each but the gather is one C call (``kernels.cpu_ops``: the same order and roundings as the reference),
so a recorded decode step (``kernels/cpu_graph.py``) holds them; the gather is a Triton kernel on CUDA
(``kernels.moe_triton``) and its reference on the CPU, where only the ``symm_mem`` tests' gloo twin runs it;
traced and elsewhere the reference runs.
"""

from __future__ import annotations

import torch

from epserve.kernels.opdef import declare

_C = "epserve.kernels.cpu_ops"


def count_per_expert(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Occurrences of each id in ``ids`` (any shape) -> [num_experts] int64: a fixed-shape ``bincount``."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


@declare("group_by_expert")
def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] -> (order [T*K]: flat (token, k) indices sorted by expert, counts [num_experts]):
    one C call on the CPU in eager steps, a stable argsort otherwise."""
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    return order, count_per_expert(topk_ids, num_experts)


@declare("local_dispatch")
def local_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The local dispatcher's permutation of x [T, H] by topk_ids [T, K] -> (rows [T*K, H] grouped by expert
    in stable order, counts [num_experts], each row's token [T*K] and routing weight [T*K])."""
    order, counts = group_by_expert(topk_ids, num_experts)
    token_idx = order // topk_ids.shape[1]
    return x.index_select(0, token_idx), counts, token_idx, topk_weights.reshape(-1).index_select(0, order)


@declare("weighted_combine")
def weighted_combine(y: torch.Tensor, token_idx: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The combine every dispatcher ends with: expert-output rows ``y`` [N, H], each from token
    ``token_idx`` [N] with routing weight ``weights`` [N] (fp32), summed per token -> [num_tokens, H]."""
    out = y.new_zeros(num_tokens, y.shape[1])
    out.index_add_(0, token_idx, y * weights[:, None].to(y.dtype))
    return out


@declare("gather_real_rows", fake=lambda out, src, index, total, col0: None, mutates_args=("out",))
def gather_real_rows(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor, total: torch.Tensor,
                     col0: int) -> None:
    """The masked gather of a fixed-shape dispatcher: ``out[j] = src[index[j], col0 : col0 + C]`` for the
    ``j < total`` real rows (``out`` [N, C], ``index`` [N], ``total`` a one-element int64 tensor on the
    device); rows past ``total`` are neither read nor written. On CUDA a Triton kernel reads ``total`` on the
    device (capturable); the reference reads it on the host."""
    n = int(total.reshape(-1)[0])
    out[:n] = src[:, col0 : col0 + out.shape[1]].index_select(0, index[:n])


@declare("index_add_counts")
def index_add_counts(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.index_add_(0, index, src)``: the experts' load counters, counted on the device."""
    dst.index_add_(0, index, src)


for _op in (group_by_expert, local_dispatch, weighted_combine, index_add_counts):
    _op.implement("cpu", f"{_C}:{_op.name}")
gather_real_rows.implement("cuda", "epserve.kernels.moe_triton:gather_real_rows_triton", traced="op")
