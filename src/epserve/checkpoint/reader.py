"""Reading and writing Hugging Face–format DeepSeek-V3 checkpoints.

A checkpoint directory holds ``config.json`` and either ``model.safetensors.index.json`` with the
shards it names, or a single ``model.safetensors``. FP8 checkpoints store a linear weight ``X.weight``
as ``float8_e4m3fn`` ``[out, in]`` next to ``X.weight_scale_inv`` float32
``[ceil(out / b0), ceil(in / b1)]``: one scale per ``b0 × b1`` tile (``weight_block_size`` in
``quantization_config``, 128 × 128 in DeepSeek-V3), multiplied in to dequantize.

``CheckpointReader`` opens shards lazily with ``safetensors.safe_open`` and reads only the tensors it
is asked for, so an expert-parallel rank touches only its own experts.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from epserve import env

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value
DEFAULT_BLOCK = (128, 128)
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

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


# ---- FP8 block quantization ---------------------------------------------------------------------


class Fp8Weight(NamedTuple):
    """A block-quantized weight: ``weight`` float8_e4m3fn ``[out, in]`` and ``scale_inv`` float32
    ``[ceil(out / b0), ceil(in / b1)]``. Unpacks as ``w_fp8, scale_inv``."""

    weight: torch.Tensor
    scale_inv: torch.Tensor


def _check_block(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"block quantization needs a 2-D [out, in] weight, got shape {tuple(shape)}")
    b0, b1 = int(block[0]), int(block[1])
    if b0 <= 0 or b1 <= 0:
        raise ValueError(f"block size must be positive, got {block}")
    return b0, b1


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> Fp8Weight:
    """Quantize ``w`` ``[out, in]`` to float8_e4m3fn with one scale per ``block`` tile.

    Each tile's absolute maximum maps to 448 (the e4m3 maximum); ``scale_inv = amax / 448`` is
    float32 ``[ceil(out / b0), ceil(in / b1)]`` and ``w ≈ w_fp8.float() * scale_inv`` (per tile).
    Edge tiles may be partial. All-zero tiles get ``scale_inv = 1``.
    """
    b0, b1 = _check_block(w.shape, block)
    out_dim, in_dim = w.shape
    n0, n1 = math.ceil(out_dim / b0), math.ceil(in_dim / b1)
    x = w.detach().float()
    padded = torch.zeros(n0 * b0, n1 * b1, dtype=torch.float32, device=x.device)
    padded[:out_dim, :in_dim] = x
    tiles = padded.view(n0, b0, n1, b1)  # [n0, b0, n1, b1]
    amax = tiles.abs().amax(dim=(1, 3))  # [n0, n1]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    w_fp8 = q.view(n0 * b0, n1 * b1)[:out_dim, :in_dim].to(FP8_DTYPE).contiguous()
    return Fp8Weight(w_fp8, scale_inv.contiguous())


def fp8_block_dequantize(
    w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """Inverse of ``fp8_block_quantize``: float32 ``[out, in]`` = ``w_fp8`` times its tile's scale."""
    b0, b1 = _check_block(w_fp8.shape, block)
    out_dim, in_dim = w_fp8.shape
    expected = (math.ceil(out_dim / b0), math.ceil(in_dim / b1))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match weight {tuple(w_fp8.shape)} "
            f"with block {(b0, b1)}: expected {expected}"
        )
    scale = scale_inv.float().repeat_interleave(b0, dim=0).repeat_interleave(b1, dim=1)
    return w_fp8.float() * scale[:out_dim, :in_dim]


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
        self._weight_map: dict[str, str] = self._read_weight_map()
        self._handles: dict[str, Any] = {}

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
            with safe_open(f, framework="pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), f.name))
        return weight_map

    def _handle(self, shard: str) -> Any:
        if shard not in self._handles:
            self._handles[shard] = safe_open(self.path / shard, framework="pt", device="cpu")
        return self._handles[shard]

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
        # get_slice reads only the header entry, not the data.
        dtype = self._handle(self._weight_map[name]).get_slice(name).get_dtype()
        return _SAFETENSORS_DTYPES.get(dtype, torch.float32)

    # -- reading
    def get_raw(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor exactly as stored (FP8 stays FP8)."""
        self._require(name)
        return self._handle(self._weight_map[name]).get_tensor(name).to(device)

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
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointReader({str(self.path)!r}, tensors={len(self._weight_map)}, shards={len(self.shards)})"


_SAFETENSORS_DTYPES = {
    "F8_E4M3": FP8_DTYPE,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}


# ---- writing ------------------------------------------------------------------------------------


def save_checkpoint(
    path: str | Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write ``config.json``, ``model-0000i-of-0000N.safetensors`` shards and their index.

    Tensors fill shards in the given order (so a layer stays together) up to ``max_shard_bytes``; a
    tensor larger than that gets a shard of its own. Checkpoint files already in ``path``
    (shards, ``model.safetensors``, the index) are removed first so none is left stale.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("model-*-of-*.safetensors"), path / SINGLE_FILE, path / INDEX_FILE]:
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
    return path
