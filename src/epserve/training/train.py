"""Training a small DeepSeek-V3 (and its MTP module) on the corpus, and writing the checkpoint.

``train_checkpoint(dir)`` retrains the byte-level BPE tokenizer on the corpus, trains
:class:`~epserve.training.model.TrainModel` with AdamW (linear warm-up, cosine decay) on packed
sequences (each paragraph ``<bos> text <eos>``), next-token cross-entropy plus ``MTP_WEIGHT`` times
the MTP's next-next-token cross-entropy, balancing the experts aux-loss-free (the routing bias moves
by ``BIAS_RATE`` against each expert's load every step). It stops after ``steps`` steps or, without
``steps``, after ``max_seconds`` of wall-clock time (the learning-rate schedule then follows the
elapsed time). Then it writes ``config.json`` (every DeepSeek-V3 field, via ``build_config``),
safetensors shards in the published names, the tokenizer files and ``training.json`` (the run's
summary). A second phase (``distill``, a share of the budget) then trains the MTP module alone on the
main model's own predictions (``epserve.training.distill``): what a greedy draft's acceptance
measures. Deterministic for a seed when run by ``steps`` on the same machine.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from epserve.checkpoint import save_checkpoint
from epserve.config import ModelConfig
from epserve.presets import build_config, tensor_specs
from epserve.tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer_files
from epserve.training.corpus import load_corpus
from epserve.training.distill import distill_mtp
from epserve.training.model import TrainModel

logger = logging.getLogger(__name__)

MTP_WEIGHT = 0.3  # the MTP loss's weight next to the main loss (DeepSeek-V3 report)
BIAS_RATE = 1e-3  # aux-loss-free balancing: bias step per training step
BOS_ID, EOS_ID = 0, 1

_SHAPE = {  # over the ``tiny`` preset (its heads, 16 experts top-4 in 4 groups, one shared expert, MTP layer)
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 6,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "rope_scaling": None,
}


@dataclass(frozen=True)
class TrainSetup:
    """A training preset: the checkpoint's shape (``build_config(base, overrides=...)``) and the run."""

    base: str
    overrides: dict[str, Any]
    vocab_size: int = 2048
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup: float = 0.03  # fraction of the run
    weight_decay: float = 0.05
    eval_tokens: int = 8192  # held-out tokens evaluated at the end (the held-out part is ~6k)
    # Self-distillation of the MTP module after the main phase: its share of a wall-clock budget, or its
    # steps per main step in a run by steps; its batch and peak learning rate.
    distill: float = 0.3
    distill_batch_size: int = 16
    distill_lr: float = 1e-3


TRAIN_PRESETS: dict[str, TrainSetup] = {
    # ~13M parameters; ~1.4k tokens/s (~1.5 s a step) on two idle CPU cores.
    "tiny": TrainSetup(base="tiny", overrides=_SHAPE, batch_size=8),
    # Tests: a second or so per few steps.
    "test": TrainSetup(
        base="tiny",
        overrides={"num_hidden_layers": 2, "rope_scaling": None},  # otherwise the tiny preset's shape
        vocab_size=512, seq_len=64, batch_size=4, lr=1e-2,
    ),
}


@dataclass
class TrainResult:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    mtp_losses: list[float] = field(default_factory=list)


@lru_cache(maxsize=4)
def corpus_tokens(vocab_size: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(tokenizer trained on the corpus, train ids, held-out ids): paragraphs as ``<bos> text <eos>``."""
    corpus = load_corpus()
    tok = build_tokenizer(vocab_size, corpus.text)

    def stream(paragraphs: tuple[str, ...]) -> torch.Tensor:
        encs = tok.encode_batch(list(paragraphs), add_special_tokens=False)
        return torch.tensor([i for e in encs for i in (BOS_ID, *e.ids, EOS_ID)], dtype=torch.long)

    return tok, stream(corpus.train), stream(corpus.heldout)


def model_config(setup: TrainSetup, vocab_size: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` dict: the base preset with the training shape and the tokenizer's vocab."""
    return build_config(setup.base, overrides={**setup.overrides, "vocab_size": vocab_size}, dtype=dtype)


def build_model(config: dict[str, Any], seed: int) -> TrainModel:
    model = TrainModel(ModelConfig.from_dict(config))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def losses(model: TrainModel, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs [B, T+1] -> (next-token loss, MTP next-next-token loss)."""
    logits, mtp = model(seqs[:, :-1])
    main = F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten())
    if mtp is None:
        return main, torch.zeros(())
    return main, F.cross_entropy(mtp.flatten(0, 1), seqs[:, 2:].flatten())


def lr_at(setup: TrainSetup, progress: float) -> float:
    """Linear warm-up over ``warmup`` of the run, then cosine decay to ``min_lr_ratio``."""
    if progress < setup.warmup:
        return setup.lr * max(progress, 1e-3) / setup.warmup
    p = min(1.0, (progress - setup.warmup) / (1 - setup.warmup))
    return setup.lr * (setup.min_lr_ratio + (1 - setup.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_model(
    model: TrainModel,
    data: torch.Tensor,
    setup: TrainSetup,
    *,
    steps: int | None,
    max_seconds: float,
    seed: int,
    progress: bool,
) -> TrainResult:
    """Train ``model`` in place on random windows of ``data``; stop at ``steps`` or ``max_seconds``.
    Runs with torch's deterministic algorithms (the experts' scatter-adds otherwise vary in the last
    bits between runs)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _train(model, data, setup, steps=steps, max_seconds=max_seconds, seed=seed, progress=progress)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _train(
    model: TrainModel, data: torch.Tensor, setup: TrainSetup, *, steps: int | None, max_seconds: float, seed: int,
    progress: bool,
) -> TrainResult:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": setup.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=setup.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(seed + 1)
    window = setup.seq_len + 1
    result = TrainResult()
    model.train()
    start = time.perf_counter()
    total = steps if steps is not None else int(max_seconds)
    bar = tqdm(total=total, disable=not progress, unit="step" if steps is not None else "s", desc="training")
    while True:
        elapsed = time.perf_counter() - start
        if (steps is not None and result.steps >= steps) or (steps is None and elapsed >= max_seconds):
            break
        frac = result.steps / steps if steps is not None else elapsed / max_seconds
        for g in opt.param_groups:
            g["lr"] = lr_at(setup, frac)
        starts = torch.randint(0, len(data) - window, (setup.batch_size,), generator=gen)
        seqs = torch.stack([data[s : s + window] for s in starts.tolist()])
        main, mtp = losses(model, seqs)
        opt.zero_grad(set_to_none=True)
        (main + MTP_WEIGHT * mtp).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_routing_bias(BIAS_RATE)
        result.steps += 1
        result.tokens += seqs[:, :-1].numel()
        result.losses.append(main.item())
        result.mtp_losses.append(mtp.item())
        result.seconds = time.perf_counter() - start
        bar.set_postfix(loss=f"{result.losses[-1]:.3f}", mtp=f"{result.mtp_losses[-1]:.3f}",
                        tok_s=f"{result.tokens / result.seconds:.0f}")
        bar.update(1 if steps is not None else int(result.seconds) - bar.n)
    bar.close()
    model.eval()
    return result


@torch.no_grad()
def evaluate(model: TrainModel, data: torch.Tensor, seq_len: int, max_tokens: int) -> dict[str, float]:
    """On non-overlapping windows of ``data``: next-token loss, MTP loss, MTP top-1 accuracy on the
    token two ahead, and how often the MTP's top-1 equals the main model's top-1 for that token one
    step later (teacher-forced: the acceptance rate of one greedy draft token)."""
    model.eval()
    n = min(len(data) - 1, max_tokens) // seq_len
    if n == 0:
        raise ValueError("not enough held-out tokens to evaluate")
    seqs = torch.stack([data[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    logits, mtp = model(seqs[:, :-1])
    out = {
        "loss": float(F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten())),
        "accuracy": float((logits.argmax(-1) == seqs[:, 1:]).float().mean()),
    }
    if mtp is not None:
        draft = mtp.argmax(-1)  # [n, T-1]: tokens 2..T
        out["mtp_loss"] = float(F.cross_entropy(mtp.flatten(0, 1), seqs[:, 2:].flatten()))
        out["mtp_accuracy"] = float((draft == seqs[:, 2:]).float().mean())
        out["mtp_agreement"] = float((draft == logits[:, 1:].argmax(-1)).float().mean())
    return out


def write_trained(
    path: str | Path, model: TrainModel, config: dict[str, Any], tokenizer_corpus: str, vocab_size: int, dtype: str
) -> Path:
    """The checkpoint directory: config, shards (tensors in ``tensor_specs`` order; the routing bias
    in float32, the rest in ``dtype``), tokenizer files retrained on ``tokenizer_corpus``."""
    tensors = model.named_checkpoint_tensors()
    names = [s.name for s in tensor_specs(ModelConfig.from_dict(config))]
    if set(names) != set(tensors):
        raise RuntimeError(f"tensor names differ from the published layout: {sorted(set(names) ^ set(tensors))}")
    torch_dtype = getattr(torch, config["torch_dtype"])
    ordered = {n: tensors[n] if n.endswith("e_score_correction_bias") else tensors[n].to(torch_dtype) for n in names}
    path = save_checkpoint(path, config, ordered)
    write_tokenizer_files(path, vocab_size, config["max_position_embeddings"], corpus=tokenizer_corpus)
    return path


def train_checkpoint(
    path: str | Path,
    preset: str = "tiny",
    *,
    steps: int | None = None,
    max_seconds: float = 540.0,
    seed: int = 0,
    progress: bool = True,
    dtype: str = "bfloat16",
) -> Path:
    """Train the ``preset`` shape (see ``TRAIN_PRESETS``) on the corpus and write the checkpoint
    (plus ``training.json``, the run's summary) into ``path``. Returns ``path``."""
    if preset not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {preset!r}; available: {', '.join(TRAIN_PRESETS)}")
    setup = TRAIN_PRESETS[preset]
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tok, train_ids, heldout_ids = corpus_tokens(setup.vocab_size)
    vocab = tok.get_vocab_size()
    assert all(tok.token_to_id(t) == i for i, t in enumerate(SPECIAL_TOKENS))
    config = model_config(setup, vocab, dtype)
    model = build_model(config, seed)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("training %s: %.2fM parameters, %d train / %d held-out tokens, vocab %d",
                preset, n_params / 1e6, len(train_ids), len(heldout_ids), vocab)
    budget = max_seconds - (time.perf_counter() - t0)
    result = train_model(model, train_ids, setup, steps=steps, max_seconds=budget * (1 - setup.distill), seed=seed,
                         progress=progress)
    main_heldout = evaluate(model, heldout_ids, setup.seq_len, setup.eval_tokens)
    logger.info("trained %d steps in %.0f s (%.0f tokens/s): held-out %s", result.steps, result.seconds,
                result.tokens / max(result.seconds, 1e-9), _fmt(main_heldout))
    distilled = distill_mtp(
        model, train_ids, seq_len=setup.seq_len, batch_size=setup.distill_batch_size, lr=setup.distill_lr,
        steps=None if steps is None else math.ceil(steps * setup.distill),
        max_seconds=max_seconds - (time.perf_counter() - t0) - 5.0, seed=seed, progress=progress,
    )
    train_eval = evaluate(model, train_ids, setup.seq_len, setup.eval_tokens)
    heldout_eval = evaluate(model, heldout_ids, setup.seq_len, setup.eval_tokens)
    logger.info("distilled the MTP %d steps in %.0f s: train %s, held-out %s", distilled.steps, distilled.seconds,
                _fmt(train_eval), _fmt(heldout_eval))
    path = write_trained(path, model, config, load_corpus().text, setup.vocab_size, dtype)
    corpus = load_corpus()
    summary = {
        "preset": preset, "seed": seed, "parameters": n_params, "steps": result.steps,
        "train_seconds": round(result.seconds, 1), "total_seconds": round(time.perf_counter() - t0, 1),
        "tokens_seen": result.tokens, "train_tokens": len(train_ids), "heldout_tokens": len(heldout_ids),
        "setup": {k: v for k, v in asdict(setup).items() if k != "overrides"},
        "mtp_weight": MTP_WEIGHT, "final_train": train_eval, "final_heldout": heldout_eval,
        "loss_curve": result.losses, "mtp_loss_curve": result.mtp_losses,
        "main_phase_heldout": main_heldout, "distill_steps": distilled.steps,
        "distill_seconds": round(distilled.seconds, 1), "distill_loss_curve": distilled.losses,
        "corpus": corpus.name, "corpus_license": corpus.license,
    }
    (Path(path) / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return Path(path)


def distill_checkpoint(
    src: str | Path, path: str | Path, *, steps: int | None = None, max_seconds: float = 300.0, seed: int = 0,
    progress: bool = True,
) -> Path:
    """The self-distillation phase alone, on a checkpoint :func:`train_checkpoint` wrote in ``src`` (its
    preset's shape, its tokenizer: the corpus's, retrained the same): ``steps`` steps (or ``max_seconds``),
    then the checkpoint written into ``path`` with the main model's weights as they were (bit for bit: the
    same dtype) and ``training.json`` extended by the phase's figures. Returns ``path``."""
    from safetensors.torch import load_file

    src = Path(src)
    summary = json.loads((src / "training.json").read_text())
    setup = TRAIN_PRESETS[summary["preset"]]
    config = json.loads((src / "config.json").read_text())
    tok, train_ids, heldout_ids = corpus_tokens(setup.vocab_size)
    if tok.get_vocab_size() != config["vocab_size"]:
        raise ValueError(f"{src}: its vocabulary ({config['vocab_size']}) is not the corpus tokenizer's")
    model = TrainModel(ModelConfig.from_dict(config))
    model.load_checkpoint_tensors({k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()})
    model.eval()
    before = evaluate(model, heldout_ids, setup.seq_len, setup.eval_tokens)
    distilled = distill_mtp(model, train_ids, seq_len=setup.seq_len, batch_size=setup.distill_batch_size,
                           lr=setup.distill_lr, steps=steps, max_seconds=max_seconds, seed=seed, progress=progress)
    after = evaluate(model, heldout_ids, setup.seq_len, setup.eval_tokens)
    logger.info("distilled the MTP %d steps in %.0f s: held-out %s (before: %s)", distilled.steps,
                distilled.seconds, _fmt(after), _fmt(before))
    path = write_trained(path, model, config, load_corpus().text, setup.vocab_size, config["torch_dtype"])
    summary |= {"main_phase_heldout": before, "final_heldout": after, "distill_steps": distilled.steps,
                "distill_seconds": round(distilled.seconds, 1), "distill_loss_curve": distilled.losses,
                "distilled_from": str(src)}
    (Path(path) / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    return Path(path)


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
