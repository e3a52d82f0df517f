"""A checkpoint directory's stored weights as the planner reads them: the safetensors headers only.

Each shard's header (an 8-byte length, then JSON naming every tensor's dtype, shape and byte range) gives
what each tensor takes on disk without reading its data or importing torch. The tensors fall in the memory
model's groups (``memory.WeightCounts``): the MLPs' and experts' linears (``ffn``: dense MLPs, shared and
routed experts), attention's linears (``linear``), the MTP layer's tensors (``mtp``, layers from
``num_hidden_layers`` on) and the rest (``other``: embedding, head, norms, the expert gate). A group's
stored format is its linears' weight dtype: ``fp4`` (NVFP4 as ModelOpt stores it: a uint8 ``weight`` of
packed e2m1 pairs beside an e4m3 ``weight_scale``), ``fp8`` (a float8 ``weight`` beside a
``weight_scale_inv``) or ``bf16`` (any unquantized float: the engine holds those in its runtime dtype). The
plan of an NVFP4 checkpoint prices its MLPs and experts in the format stored and its attention (which
ModelOpt's ``exclude_modules`` leave out) in its stored dtype, and reports both groups' bytes on disk beside
the planner's figure for the same tensors (``compare``): equal for NVFP4 and bf16 linears; FP8 attention
differs by the scales of the edge tiles of ``q_a_proj`` and ``kv_a_proj_with_mqa``, which the engine fuses.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment
from epserve.planner.errors import PlanError
from epserve.planner.memory import weight_counts

_MAX_HEADER = 100 * 1024 * 1024
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FFN = re.compile(r"^mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate|up|down)_proj\.(\w+)$")
_ATTENTION = re.compile(r"^self_attn\.(\w+_proj\w*)\.(\w+)$")
_LINEAR_TENSORS = ("weight", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
_FLOATS = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class StoredWeights:
    """Bytes on disk per group (``ffn``, ``linear``, ``mtp``, ``other``) and the two linear groups' formats
    (None: the checkpoint has no such linear)."""

    path: str
    group_bytes: dict[str, int] = field(default_factory=dict)
    ffn_dtype: str | None = None
    attention_dtype: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.group_bytes.values())


def _headers(path: Path) -> dict[str, tuple[str, int]]:
    """Every tensor of the directory's safetensors files: name -> (safetensors dtype, bytes)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise PlanError(f"no safetensors files in {path}")
    tensors: dict[str, tuple[str, int]] = {}
    for f in files:
        try:
            with open(f, "rb") as fh:
                head = fh.read(8)
                (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
                if not 0 < length <= _MAX_HEADER:
                    raise PlanError(f"{f} is not a safetensors file (bad header length)")
                header = json.loads(fh.read(length))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanError(f"cannot read the safetensors header of {f}: {e}") from None
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                tensors[name] = (info["dtype"], end - begin)
    return tensors


def _format(module: str, tensors: dict[str, tuple[str, int]]) -> str:
    """A linear's stored format, from its weight's dtype and its scales."""
    dtype = tensors[f"{module}.weight"][0]
    scale = tensors.get(f"{module}.weight_scale", ("",))[0]
    if dtype == "U8" and scale == "F8_E4M3":
        return "fp4"
    if dtype == "F8_E4M3" and f"{module}.weight_scale_inv" in tensors:
        return "fp8"
    if dtype in _FLOATS:
        return "bf16"
    raise PlanError(f"{module}.weight is stored {dtype} with no format the planner prices (NVFP4, FP8 or a float)")


def _group_format(group: str, modules: list[str], tensors: dict[str, tuple[str, int]]) -> str | None:
    formats: dict[str, str] = {}
    for m in modules:
        formats.setdefault(_format(m, tensors), m)
    if len(formats) > 1:
        seen = ", ".join(f"{m} {fmt}" for fmt, m in formats.items())
        raise PlanError(f"the checkpoint stores its {group} in more than one format ({seen}); the planner prices "
                        "one dtype for the MLPs and experts and one for attention")
    return next(iter(formats), None)


def read_stored(path: str | Path, model: ModelConfig) -> StoredWeights:
    """The stored bytes and formats of the checkpoint directory ``path`` (``model``: its configuration)."""
    path = Path(path)
    tensors = _headers(path)
    groups = {"ffn": 0, "linear": 0, "mtp": 0, "other": 0}
    modules: dict[str, list[str]] = {"ffn": [], "linear": []}
    for name, (_, nbytes) in tensors.items():
        group, match = "other", _LAYER.match(name)
        if match and int(match[1]) >= model.num_hidden_layers:
            group = "mtp"
        elif match and (ffn := _FFN.match(match[2])) and ffn[1] in _LINEAR_TENSORS:
            group = "ffn"
        elif match and (attn := _ATTENTION.match(match[2])) and attn[2] in _LINEAR_TENSORS:
            group = "linear"
        groups[group] += nbytes
        if group in modules and name.endswith(".weight"):
            modules[group].append(name.removesuffix(".weight"))
    return StoredWeights(str(path), groups, _group_format("MLPs and experts", sorted(modules["ffn"]), tensors),
                         _group_format("attention projections", sorted(modules["linear"]), tensors))


def checkpoint_dir(spec: str | Path) -> Path | None:
    """The checkpoint directory a planner model spec names (the directory, or its ``config.json``), if it
    holds safetensors files; None for a built-in model or a lone ``config.json``."""
    path = Path(spec)
    folder = path if path.is_dir() else path.parent if path.name == "config.json" else None
    return folder if folder is not None and any(folder.glob("*.safetensors")) else None


def compare(stored: StoredWeights, model: ModelConfig, d: Deployment) -> dict[str, object]:
    """The checkpoint's bytes per group beside the planner's for the same tensors (the whole model on one GPU,
    no MTP layer: ``weight_counts`` at EP 1, TP 1 in ``d``'s dtypes)."""
    whole = weight_counts(model, Deployment(ep=1, weight_dtype=d.weight_dtype, attention_dtype=d.attn_dtype))
    return {"path": stored.path, "bytes": stored.total_bytes, "group_bytes": dict(stored.group_bytes),
            "ffn_dtype": stored.ffn_dtype, "attention_dtype": stored.attention_dtype,
            "planned_ffn_bytes": whole.ffn_bytes(d.weight_dtype),
            "planned_linear_bytes": whole.linear_bytes(d.attn_dtype)}


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:.0f} B"


def format_compare(c: dict) -> str:
    """One line of ``compare``'s figures."""
    g = c["group_bytes"]
    return (f"checkpoint {c['path']}: {_size(c['bytes'])} stored; MLPs/experts {c['ffn_dtype']} {_size(g['ffn'])} "
            f"(planned {_size(c['planned_ffn_bytes'])}), attention {c['attention_dtype']} {_size(g['linear'])} "
            f"(planned {_size(c['planned_linear_bytes'])}), MTP layer {_size(g['mtp'])}, embedding, head, norms "
            f"and gates {_size(g['other'])}")
