"""A checkpoint whose MTP layer is right about two times in three, built in milliseconds for speculative
decoding tests (a briefly trained model drafts too poorly, a well trained one takes minutes).

``counter_checkpoint(dst)`` rewrites the random ``tiny`` preset (float32) into a "counter": with unit
embedding rows ``u_t``, the LM head's row ``t + 1`` is ``beta * u_t``, so after token ``t`` the model
predicts ``t + 1`` with a clear margin; the MTP layer reads only the embedding of the token after its
position (``eh_proj = [I | 0]``) and its head predicts ``t + 1`` after ``t`` (right: the target continues
``t + 1`` after ``t``), except ``t + 2`` when ``t % 3 == 2`` (wrong). Every attention and FFN output
projection is scaled by ``eps``, so the layers (attention over the paged cache included) still move
every logit a little: a wrong position, mask or cache row shows in the logprobs, without changing which
token wins. The MTP layer's embedding equals the main model's (the engine shares it); its head does
not.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from epserve.checkpoint import save_checkpoint
from epserve.presets import make_checkpoint
from epserve.tokenizer import write_tokenizer_files


def counter_checkpoint(dst: Path, eps: float = 0.1, beta: float = 12.0, seed: int = 0) -> Path:
    src = make_checkpoint(dst / "random", preset="tiny", dtype="float32", seed=seed)
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(shard))
    vocab, hidden, layers = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    units = torch.nn.functional.normalize(torch.randn(vocab, hidden, generator=g), dim=-1)
    embed = units * hidden**0.5  # RMSNorm leaves it as it is
    head = torch.zeros(vocab, hidden)
    head[1:] = beta / hidden**0.5 * units[:-1]  # after t: t + 1
    mtp_head = torch.zeros(vocab, hidden)
    for v in range(1, vocab):  # after t: t + 1, but t + 2 when t % 3 == 2
        mtp_head[v] = (units[v - 1] if (v - 1) % 3 != 2 else 0) + (units[v - 2] if v >= 2 and (v - 2) % 3 == 2 else 0)
    mtp_head *= beta / hidden**0.5
    m = f"model.layers.{layers}"
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = t * eps
        elif name.endswith("norm.weight"):
            tensors[name] = torch.ones_like(t)
    tensors.update({
        "model.embed_tokens.weight": embed, f"{m}.embed_tokens.weight": embed.clone(), "lm_head.weight": head,
        f"{m}.shared_head.head.weight": mtp_head,
        f"{m}.eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
    })
    out = save_checkpoint(dst / "counter", config, tensors)
    write_tokenizer_files(out, vocab_size=vocab, model_max_length=config["max_position_embeddings"])
    return out
