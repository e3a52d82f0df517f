"""DeepSeek's grouped top-k gate as one op: gate logits -> (physical expert ids, routing weights).

``grouped_topk(logits [T, E], ...)`` does what ``moe.gate.ExpertGate`` does after its gate linear:

1. scores = sigmoid(logits) (V3) or softmax over the experts (V2, Mixtral-style greedy);
2. selection scores = scores + ``bias`` (``e_score_correction_bias``; ``noaux_tc`` only, and used for
   the choice only, never for the weights);
3. grouped methods (``n_group > 1`` and not ``greedy``): a group's score is the sum of its top-2
   selection scores (``noaux_tc``) or its best one (``group_limited_greedy``); all but the best
   ``topk_group`` groups are masked out;
4. the ``top_k`` best experts left; their weights are the *unbiased* scores, divided by their sum
   (+1e-20) when ``norm_topk_prob``, times ``routed_scaling_factor``;
5. with ``logical_to_physical`` ([E] ints), each logical id is replaced by its physical slot.

On CUDA tensors the op is one fused Triton kernel (``kernels.gate_triton``, imported only then, so
the CPU engine never loads triton; no host syncs, so it can be captured in a CUDA graph; when traced,
the custom op ``epserve::grouped_topk``); on the CPU in eager steps the same fusion in C
(``kernels.cpu_ops``); elsewhere it is ``grouped_topk_ref``, torch ops in ExpertGate's exact order
(the op is declared once, ``kernels.opdef``). The order of the K ids within a row is unspecified (the kernel
returns them best first); ties between equal scores may break differently in the two backends. Both
return ids int64 [T, K] and weights fp32 [T, K].
"""

from __future__ import annotations

import torch

from epserve.kernels import cpu_ops
from epserve.kernels.opdef import declare

METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
SCORINGS = ("sigmoid", "softmax")


def is_grouped(method: str, n_group: int) -> bool:
    """Whether groups are ranked and masked before the top-k (``greedy`` ignores ``n_group``)."""
    return method != "greedy" and n_group > 1


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_args(
    logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    method: str,
    scoring: str,
    bias: torch.Tensor | None,
    logical_to_physical: torch.Tensor | None,
) -> None:
    """Raise ValueError, naming the offending argument, on anything the gate cannot route."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a 2-D float tensor [T, E], got {logits.dtype} {_shape(logits)}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
    e = logits.shape[1]
    if n_group < 1 or e % n_group:
        raise ValueError(f"n_group={n_group} must be >= 1 and divide the {e} experts")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k={top_k} must be in [1, {e}]")
    if is_grouped(method, n_group):
        size = e // n_group
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
        if top_k > topk_group * size:
            raise ValueError(f"top_k={top_k} exceeds the {topk_group * size} experts of {topk_group} groups")
        if method == "noaux_tc" and size < 2:
            raise ValueError(f"noaux_tc ranks groups by their top-2 scores: {e} / {n_group} < 2 experts")
    if bias is not None:
        if method != "noaux_tc":
            raise ValueError(f"a correction bias is only used by noaux_tc, not {method!r}")
        if _shape(bias) != (e,) or bias.device != logits.device:
            raise ValueError(f"bias must be [{e}] on {logits.device}, got {_shape(bias)} on {bias.device}")
    if logical_to_physical is not None:
        table = logical_to_physical
        if _shape(table) != (e,) or table.is_floating_point() or table.device != logits.device:
            raise ValueError(
                f"logical_to_physical must be an integer [{e}] table on {logits.device}, got "
                f"{table.dtype} {_shape(table)} on {table.device}"
            )


def _check(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, method: str, scoring: str,
           norm_topk_prob: bool, routed_scaling_factor: float, bias: torch.Tensor | None = None,
           logical_to_physical: torch.Tensor | None = None) -> None:
    check_args(logits, top_k, n_group, topk_group, method, scoring, bias, logical_to_physical)


def _fake(logits: torch.Tensor, top_k: int, *_: object, **__: object) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return logits.new_empty(t, top_k, dtype=torch.int64), logits.new_empty(t, top_k, dtype=torch.float32)


@declare("grouped_topk", fake=_fake, check=_check)
def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    method: str,
    scoring: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor | None = None,
    logical_to_physical: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate logits [T, E] -> (expert ids int64 [T, K], physical when a table is given; weights fp32 [T, K]):
    the Triton kernel on CUDA (its custom op when traced), the C kernel on the CPU in eager steps, else the
    torch reference, ExpertGate.forward's ops in its order. (Callers pass all but ``logits`` by keyword;
    a custom op takes no keyword-only tensors.)"""
    check_args(logits, top_k, n_group, topk_group, method, scoring, bias, logical_to_physical)
    logits = logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if is_grouped(method, n_group):
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
        if method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * routed_scaling_factor
    if logical_to_physical is not None:
        ids = logical_to_physical.long()[ids]
    return ids, weights


def grouped_topk_c(
    logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, method: str, scoring: str,
    norm_topk_prob: bool, routed_scaling_factor: float, bias: torch.Tensor | None = None,
    logical_to_physical: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The C kernel on checked arguments, or None where it does not apply."""
    return cpu_ops.grouped_topk(logits, top_k, n_group, topk_group, method, scoring, norm_topk_prob,
                                routed_scaling_factor, bias, logical_to_physical, is_grouped(method, n_group))


grouped_topk.implement("cpu", f"{__name__}:grouped_topk_c")
grouped_topk.implement("cuda", "epserve.kernels.gate_triton:grouped_topk_triton", traced="op")
grouped_topk_ref = grouped_topk.reference
