"""The second training phase: the MTP module learns the main model's own predictions (self-distillation).

Acceptance of a greedy draft is agreement between the MTP's top-1 for token ``i+2`` and the main
model's top-1 for the same token one step later, not agreement with the text. After the main phase,
``distill_mtp`` freezes the main model (and the embedding and ``lm_head`` the MTP shares with it) and
trains the MTP module alone on the cross-entropy against the main model's softmax at the next
position (soft targets carry the ranking, not just the top-1). The main forward runs without
gradients and only the MTP layer runs backward, so a distillation step costs about a third of a main
step. The main model's weights, and so its greedy output, are unchanged by this phase.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm

from epserve.training.model import TrainModel


@dataclass
class DistillResult:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)


def distill_loss(model: TrainModel, seqs: torch.Tensor) -> torch.Tensor:
    """seqs [B, T+1] -> the MTP's cross-entropy against the main model's next-position distribution.
    The MTP at ``i`` reads ``h_i`` and ``t_{i+1}`` and predicts ``t_{i+2}``, which the main model
    predicts from position ``i+1``: the targets are ``softmax(logits[:, 1:])``."""
    ids = seqs[:, :-1]
    with torch.no_grad():
        h = model.hidden(ids)
        target = F.softmax(model.lm_head(h[:, 1:]).float(), dim=-1)
    mtp = model.mtp_logits(h[:, :-1], ids[:, 1:])
    return -(target * F.log_softmax(mtp.float(), dim=-1)).sum(-1).mean()


def distill_mtp(
    model: TrainModel,
    data: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    lr: float,
    steps: int | None,
    max_seconds: float,
    seed: int,
    progress: bool,
) -> DistillResult:
    """Train ``model.mtp`` (only) in place on random windows of ``data`` for ``steps`` steps or
    ``max_seconds``: AdamW, 5% linear warm-up then cosine decay to 5% of ``lr``. Deterministic for a
    seed when run by ``steps`` (torch's deterministic algorithms, as the main phase)."""
    assert model.mtp is not None
    shared = {id(model.embed_tokens.weight), id(model.lm_head.weight)}
    params = [p for p in model.mtp.parameters() if id(p) not in shared]
    frozen = [p for p in model.parameters() if p.requires_grad and all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _distill(model, params, data, seq_len, batch_size, lr, steps, max_seconds, seed, progress)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        for p in frozen:
            p.requires_grad_(True)


def _distill(
    model: TrainModel, params: list[torch.nn.Parameter], data: torch.Tensor, seq_len: int, batch_size: int,
    lr: float, steps: int | None, max_seconds: float, seed: int, progress: bool,
) -> DistillResult:
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed + 2)
    window = seq_len + 1
    result = DistillResult()
    model.eval()  # no dropout anywhere; the routing biases stay where the main phase left them
    start = time.perf_counter()
    bar = tqdm(total=steps if steps is not None else int(max_seconds), disable=not progress,
               unit="step" if steps is not None else "s", desc="distilling MTP")
    while True:
        elapsed = time.perf_counter() - start
        if (steps is not None and result.steps >= steps) or (steps is None and elapsed >= max_seconds):
            break
        frac = result.steps / steps if steps is not None else elapsed / max(max_seconds, 1e-9)
        scale = min(1.0, max(frac, 1e-3) / 0.05) if frac < 0.05 else 0.05 + 0.95 * 0.5 * (
            1 + math.cos(math.pi * (frac - 0.05) / 0.95))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        starts = torch.randint(0, len(data) - window, (batch_size,), generator=gen)
        seqs = torch.stack([data[s : s + window] for s in starts.tolist()])
        loss = distill_loss(model, seqs)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        result.steps += 1
        result.tokens += seqs[:, :-1].numel()
        result.losses.append(loss.item())
        result.seconds = time.perf_counter() - start
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}", tok_s=f"{result.tokens / result.seconds:.0f}")
        bar.update(1 if steps is not None else int(result.seconds) - bar.n)
    bar.close()
    return result
