"""Writing a checkpoint directory in the Hugging Face layout: ``config.json``, shards and their index (and
ModelOpt's ``hf_quant_config.json`` for an NVFP4 checkpoint)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from epserve.checkpoint.reader import CONFIG_FILE, INDEX_FILE, SINGLE_FILE, iter_with_progress
from epserve.config.model import HF_QUANT_CONFIG

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def save_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    hf_quant_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``config.json``, ``model-0000i-of-0000N.safetensors`` shards and their index, and
    ``hf_quant_config.json`` when ``hf_quant_config`` is given (indented by four, as ModelOpt writes it).

    Tensors fill shards in the given order (so a layer stays together) up to ``max_shard_bytes``; a
    tensor larger than that gets a shard of its own. Checkpoint files already in ``path``
    (shards, ``model.safetensors``, the index, ``hf_quant_config.json``) are removed first so none is left stale.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stale_files = [path / SINGLE_FILE, path / INDEX_FILE, path / HF_QUANT_CONFIG]
    for stale in [*path.glob("model-*-of-*.safetensors"), *stale_files]:
        stale.unlink(missing_ok=True)

    groups: list[list[str]] = []
    group_bytes = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        if not groups or (group_bytes + size > max_shard_bytes and groups[-1]):
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += size

    weight_map: dict[str, str] = {}
    total_size = 0
    for i, names in enumerate(iter_with_progress(groups, "writing shards")):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        # clone() so no two entries share storage (safetensors refuses shared tensors).
        data = {n: tensors[n].detach().to("cpu").contiguous().clone() for n in names}
        save_file(data, str(path / shard), metadata={"format": "pt"})
        for n, t in data.items():
            weight_map[n] = shard
            total_size += t.numel() * t.element_size()

    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    if hf_quant_config is not None:
        (path / HF_QUANT_CONFIG).write_text(json.dumps(dict(hf_quant_config), indent=4) + "\n")
    return path
