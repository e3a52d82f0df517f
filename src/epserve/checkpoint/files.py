"""One ``.safetensors`` file, read with positioned reads instead of a memory map.

A memory-mapped shard counts every page it touched in the process's resident memory until it is
unmapped, so loading through ``safe_open`` peaks at the weights kept *plus* the checkpoint bytes read.
Reading with ``preadv`` straight into the destination tensor (or a row range of a tensor) keeps only
what the engine keeps. The format: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import NamedTuple

import torch

_MAX_HEADER = 100 * 1024 * 1024

SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    SAFETENSORS_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class FileFormatError(ValueError):
    """A file that is not a readable safetensors file; the message names it."""


class Entry(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0


class SafetensorsFile:
    """The header of one file, parsed at construction; tensors read on request (no memory map)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
                (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
                if not 0 < length <= _MAX_HEADER:
                    raise FileFormatError(f"{self.path} is not a safetensors file (bad header length)")
                header = json.loads(f.read(length))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise FileFormatError(f"cannot read safetensors header of {self.path}: {e}") from None
        size = self.path.stat().st_size
        self.entries: dict[str, Entry] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
            if dtype is None:
                raise FileFormatError(f"{self.path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            begin, end = info["data_offsets"]
            shape = tuple(int(d) for d in info["shape"])
            entry = Entry(dtype, shape, 8 + length + begin, end - begin)
            numel = 1
            for d in shape:
                numel *= d
            if entry.nbytes != numel * dtype.itemsize or entry.start + entry.nbytes > size:
                raise FileFormatError(f"{self.path}: tensor {name!r} has an inconsistent byte range")
            self.entries[name] = entry
        self._fd: int | None = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or rows ``[lo, hi)`` of its first dimension) as a new CPU tensor."""
        entry = self.entries[name]
        lo, hi = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
        out = torch.empty((hi - lo, *entry.shape[1:]) if entry.shape else (), dtype=entry.dtype)
        self.read_into(name, out, rows)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Read tensor ``name`` (rows ``[lo, hi)``) into ``out``: a contiguous CPU tensor of its dtype
        and shape, written in place (for instance a parameter, or a row range of one)."""
        entry = self.entries[name]
        lo, hi = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
        if rows is not None and not (entry.shape and 0 <= lo <= hi <= entry.shape[0]):
            raise ValueError(f"rows {rows} are outside {name!r} of shape {entry.shape}")
        want = ((hi - lo, *entry.shape[1:]) if entry.shape else ())
        if out.dtype != entry.dtype or tuple(out.shape) != want or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"cannot read {name!r} {entry.dtype} {want} into a {out.dtype} {tuple(out.shape)} "
                f"tensor on {out.device} (contiguous={out.is_contiguous()})"
            )
        if not entry.shape:
            lo, hi = 0, 1
        offset = entry.start + lo * (entry.row_bytes if entry.shape else entry.nbytes)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        done = 0
        fd = self._open()
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise FileFormatError(f"{self.path}: unexpected end of file reading {name!r}")
            done += n

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()
