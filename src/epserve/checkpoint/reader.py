"""Lazy, name-addressed reading of a Hugging Face–format DeepSeek-V3 checkpoint directory.

A checkpoint directory holds ``config.json`` and either ``model.safetensors.index.json`` with the
shards it names, or a single ``model.safetensors`` (or any ``*.safetensors``). FP8 checkpoints store a
linear weight ``X.weight`` as ``float8_e4m3fn`` ``[out, in]`` next to ``X.weight_scale_inv``
(``checkpoint/fp8.py``).

``CheckpointReader`` parses shard headers once and reads only the tensors (or rows of a tensor) it is
asked for, with positioned reads rather than a memory map (``checkpoint/files.py``), so an
expert-parallel rank touches only its own experts and its own heads, and holds only what it keeps.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from epserve import env
from epserve.checkpoint.files import FileFormatError, SafetensorsFile
from epserve.checkpoint.fp8 import DEFAULT_BLOCK, FP8_DTYPE, SCALE_SUFFIX, Fp8Weight, fp8_block_dequantize

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file or tensor."""


def as_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` → ``torch.bfloat16`` (and so on)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[key]


# ---- progress -----------------------------------------------------------------------------------


def progress_enabled() -> bool:
    """Progress bars show only on a terminal and unless ``EPSERVE_NO_PROGRESS=1``."""
    if env.progress_disabled():
        return False
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def iter_with_progress(
    items: Iterable[T], desc: str, total: int | None = None, disable: bool = False
) -> Iterator[T]:
    """Yield ``items`` under a tqdm bar (on stderr), or plainly when progress is disabled."""
    if disable or not progress_enabled():
        yield from items
        return
    from tqdm import tqdm

    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    yield from tqdm(items, desc=desc, total=total, unit="tensor", leave=False, dynamic_ncols=True)


# ---- reading ------------------------------------------------------------------------------------


class CheckpointReader:
    """Lazy, name-addressed access to the tensors of a safetensors checkpoint directory.

    ``get`` returns FP8 weights dequantized (float32, or ``dtype``); ``get_raw`` returns what is
    stored. ``keys()`` lists logical tensor names: the ``weight_scale_inv`` of an FP8 weight is folded
    into that weight and not listed (``has`` still finds it).
    """

    def __init__(self, path: str | Path, block_size: tuple[int, int] | None = None) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise CheckpointError(f"checkpoint directory does not exist: {self.path}")
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint path is not a directory: {self.path}")
        self.config: dict[str, Any] = self._read_config()
        self.block_size: tuple[int, int] = tuple(block_size or self._config_block())  # type: ignore[assignment]
        self._files: dict[str, SafetensorsFile] = {}
        self._weight_map: dict[str, str] = self._read_weight_map()

    # -- construction helpers
    def _read_config(self) -> dict[str, Any]:
        cfg = self.path / CONFIG_FILE
        if not cfg.is_file():
            return {}
        try:
            return json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg} is not valid JSON: {e}") from None

    def _config_block(self) -> tuple[int, int]:
        quant = self.config.get("quantization_config") or {}
        block = quant.get("weight_block_size") or DEFAULT_BLOCK
        return int(block[0]), int(block[1])

    def _read_weight_map(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = dict(json.loads(index.read_text())["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e!r}") from None
            for shard in sorted(set(weight_map.values())):
                if not (self.path / shard).is_file():
                    raise CheckpointError(
                        f"{index.name} names shard {shard!r}, which is missing from {self.path}"
                    )
            return weight_map
        files = [self.path / SINGLE_FILE] if (self.path / SINGLE_FILE).is_file() else []
        files = files or sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no safetensors files (and no {INDEX_FILE}) in {self.path}")
        weight_map = {}
        for f in files:
            weight_map.update(dict.fromkeys(self._file(f.name).keys(), f.name))
        return weight_map

    def _file(self, shard: str) -> SafetensorsFile:
        if shard not in self._files:
            try:
                self._files[shard] = SafetensorsFile(self.path / shard)
            except FileFormatError as e:
                raise CheckpointError(str(e)) from None
        return self._files[shard]

    # -- queries
    @property
    def shards(self) -> list[str]:
        """Shard file names, sorted."""
        return sorted(set(self._weight_map.values()))

    def keys(self) -> list[str]:
        """Logical tensor names, sorted; FP8 scales are folded into their weights."""
        stored = self._weight_map
        return sorted(
            k for k in stored if not (k.endswith(SCALE_SUFFIX) and k.removesuffix(SCALE_SUFFIX) in stored)
        )

    def raw_keys(self) -> list[str]:
        """Every stored tensor name, scales included, sorted."""
        return sorted(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def is_fp8(self, name: str) -> bool:
        """Whether ``name`` is stored float8_e4m3fn with a ``weight_scale_inv`` sibling."""
        return name + SCALE_SUFFIX in self._weight_map and self._dtype_of(name) == FP8_DTYPE

    def _require(self, name: str) -> None:
        if name not in self._weight_map:
            raise CheckpointError(f"tensor {name!r} is not in checkpoint {self.path}")

    def _dtype_of(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def _entry(self, name: str) -> Any:
        self._require(name)
        return self._file(self._weight_map[name]).entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (from the shard's header; no data is read)."""
        return self._entry(name).shape

    # -- reading
    def get_raw(
        self, name: str, device: str | torch.device = "cpu", rows: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """The tensor (or its rows ``[lo, hi)``) exactly as stored (FP8 stays FP8)."""
        self._require(name)
        try:
            return self._file(self._weight_map[name]).read(name, rows).to(device)
        except (ValueError, OSError) as e:
            raise CheckpointError(f"cannot read {name!r} from {self.path}: {e}") from None

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Read ``name`` (rows ``[lo, hi)``) as stored into ``out``: straight into it when it is a contiguous
        CPU tensor of the stored dtype, else through one temporary (cast and copied)."""
        entry = self._entry(name)
        if out.device.type == "cpu" and out.dtype == entry.dtype and out.is_contiguous():
            try:
                self._file(self._weight_map[name]).read_into(name, out, rows)
            except (ValueError, OSError) as e:
                raise CheckpointError(f"cannot read {name!r} from {self.path}: {e}") from None
        else:
            out.copy_(self.get_raw(name, rows=rows))

    def get_fp8(self, name: str, device: str | torch.device = "cpu") -> Fp8Weight:
        """An FP8 weight with its block scales, for kernels that consume FP8 directly."""
        if not self.is_fp8(name):
            raise CheckpointError(f"tensor {name!r} in {self.path} is not an FP8 weight with block scales")
        return Fp8Weight(self.get_raw(name, device), self.get_raw(name + SCALE_SUFFIX, device))

    def get(
        self, name: str, dtype: str | torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> torch.Tensor:
        """Tensor ``name``; FP8 weights come back dequantized (float32 unless ``dtype``)."""
        tensor = self.get_raw(name)
        if tensor.dtype == FP8_DTYPE:
            scale_name = name + SCALE_SUFFIX
            if scale_name not in self._weight_map:
                raise CheckpointError(f"FP8 tensor {name!r} has no {scale_name!r} in {self.path}")
            scale = self.get_raw(scale_name)
            try:
                tensor = fp8_block_dequantize(tensor, scale, self.block_size)
            except ValueError as e:
                raise CheckpointError(f"cannot dequantize {name!r}: {e}") from None
        if dtype is not None:
            tensor = tensor.to(as_torch_dtype(dtype))
        return tensor.to(device)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, tensors={len(self._weight_map)}, shards={len(self.shards)})"
