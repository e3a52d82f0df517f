"""CPU decode kernels (AVX512-BF16), compiled with the system C compiler on first use.

``linear(x, w)`` and ``moe_swiglu(x, counts, w13, w2)`` take the kernel path only for bf16 CPU tensors
with few rows (decode), and fall back to torch otherwise, or when the CPU lacks AVX512-BF16, no C
compiler is found, or ``EPSERVE_CPU_KERNELS=0``. Results match torch's bf16 path up to summation order.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from epserve import env
from epserve.kernels.ops import tracing

logger = logging.getLogger(__name__)

TILE_M = 16  # rows per weight pass; must match the C source
_SOURCE = Path(__file__).with_name("cpu_bf16.c")


def _cpu_has_avx512_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags and "avx512f" in flags


def _build(cc: str, lib_path: Path) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        tmp_lib = Path(tmp) / lib_path.name
        cmd = [cc, "-O3", "-mavx512f", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC",
               str(_SOURCE), "-o", str(tmp_lib), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=proc.stderr)
        os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file


@cache
def _library() -> ctypes.CDLL | None:
    if not env.cpu_kernels_enabled() or not _cpu_has_avx512_bf16():
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    source = _SOURCE.read_bytes()
    tag = hashlib.sha256(source).hexdigest()[:16]

    lib_path = env.cache_dir() / "kernels" / f"cpu_bf16-{tag}.so"
    try:
        if not lib_path.exists():
            _build(cc, lib_path)
        lib = ctypes.CDLL(str(lib_path))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("CPU kernels unavailable (%s); using torch", detail.strip()[:200])
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.epserve_linear_bf16.argtypes = [p, i64, p, i64, i64, p, c_int]
    lib.epserve_moe_swiglu_bf16.argtypes = [p, p, i64, p, p, i64, i64, p, c_int]
    logger.info("CPU bf16 decode kernels loaded from %s", lib_path)
    return lib


_available: bool | None = None  # available()'s answer, once asked: a constant to torch.compile


def available() -> bool:
    """Whether the kernels load here (built on first ask). Ask once before compiling a forward that may
    call them (``engine/graphs.py`` does), so torch.compile reads a constant instead of tracing the build."""
    global _available
    if _available is None:
        _available = _library() is not None
    return _available


def _eligible(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T; the kernel streams ``w`` once when M <= TILE_M."""
    if x.dim() == 2 and 0 < x.shape[0] <= TILE_M and x.shape[1] % 32 == 0 and _eligible(x, w) and available():
        return linear_bf16(x, w) if tracing() else _linear_bf16(x, w)
    return F.linear(x, w)


def _linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The AVX512-BF16 decode GEMM (as a custom op below: one opaque call to ``torch.compile``)."""
    lib = _library()
    assert lib is not None, "linear_bf16 needs the CPU kernels (kernels.cpu.available())"
    x = x.contiguous()
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
    lib.epserve_linear_bf16(x.data_ptr(), x.shape[0], w.data_ptr(), w.shape[0], x.shape[1], out.data_ptr(),
                            torch.get_num_threads())
    return out


linear_bf16 = torch.library.custom_op("epserve::linear_bf16", _linear_bf16, mutates_args=())


@linear_bf16.register_fake
def _(x, w):  # noqa: ANN001
    return x.new_empty(x.shape[0], w.shape[0])


def moe_swiglu(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor | None:
    """Experts on rows grouped by expert. The kernel takes every expert with at most TILE_M rows;
    the few larger ones (skewed routing) run through torch here. Returns None when the kernel does not
    apply or most of the work is large groups (prefill), for which the caller's grouped GEMM is best."""
    hidden, inter = w2.shape[1], w2.shape[2]
    if not counts or hidden % 32 or inter % 32 or not _eligible(x, w13, w2):
        return None
    big = [e for e, n in enumerate(counts) if n > TILE_M]
    if sum(counts[e] for e in big) * 2 > len(x):
        return None
    lib = _library()
    if lib is None:
        return None
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    out = torch.empty(x.shape[0], hidden, dtype=torch.bfloat16)
    lib.epserve_moe_swiglu_bf16(x.data_ptr(), offsets.data_ptr(), len(counts), w13.data_ptr(), w2.data_ptr(),
                                hidden, inter, out.data_ptr(), torch.get_num_threads())
    for e in big:
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        gate, up = F.linear(x[lo:hi], w13[e]).chunk(2, dim=-1)
        out[lo:hi] = F.linear(F.silu(gate) * up, w2[e])
    return out
