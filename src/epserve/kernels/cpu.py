"""CPU decode kernels, compiled with the system C compiler on first use: bf16 (``cpu_bf16.c``,
AVX512-BF16) and fp32 (``cpu_f32.c``, AVX2 + FMA). Both stream each weight once for up to ``TILE_M``
token rows, so a decode step with a few rows per request (speculative verification) costs about what
one row does; BLAS's small-M GEMM does not stream (two fp32 rows cost about twice one on AVX2).

``linear(x, w)`` (for the calls ``linear_takes`` accepts) is the CPU implementation of the ``linear`` op
(``kernels.dense``); ``moe_swiglu_counts`` (device counts) and ``moe_swiglu`` (host counts, inside
``grouped_swiglu_host``) those of ``grouped_swiglu`` (``kernels.grouped``). They take bf16 or fp32 CPU tensors
with few rows (decode); the experts return None for anything else, as where the CPU lacks the instructions,
no C compiler is found, or ``EPSERVE_CPU_KERNELS=0``, and the op runs the next implementation or its torch
reference. Results match torch's path up to summation order.

``cpu_nvfp4.c`` and ``cpu_nvfp4_bf16.c`` (AVX-512F, BW, VBMI and BF16 + FMA: the library ``NVFP4``) run NVFP4
weights as stored (W4A16, any number of rows; ``kernels.cpu_nvfp4`` is their front end, the CPU implementation
of ``kernels.nvfp4``'s ops).

``cpu_ops.c``, ``cpu_ops_mla.c``, ``cpu_ops_heads.c`` and ``cpu_ops_moe.c`` (AVX2 + FMA, one library:
``OPS``) hold the small ops of a decode step fused, each in place of a chain of eager torch ops that costs
more in dispatch than in arithmetic; ``kernels.cpu_ops`` is their front end. ``cpu_threads.c``, in the same
library, switches how
the process's OpenMP threads wait (``kernels.cpu_threads`` decides when, and gives every kernel call its
thread count). Each library's functions are declared to ctypes from its signature table
(``kernels/cpu_abi.py``), which also generates their packed twins, built in with the sources. Every kernel
call goes through ``_lib``, so that while a decode step is recorded (``kernels/cpu_graph.py``) the calls are
recorded as they run.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from epserve import env
from epserve.kernels import cpu_abi, cpu_threads

logger = logging.getLogger(__name__)

TILE_M = 16  # rows per weight pass; must match the C sources
_DIR = Path(__file__).parent
OPS = "ops"  # the library of fused small ops (any dtype)
NVFP4 = "nvfp4"  # the library of NVFP4 weights' GEMMs (kernels.cpu_nvfp4)


@dataclass(frozen=True)
class _Build:
    """A kernel library: its C sources (built together with the packed twins its table generates), the
    compiler flags, the CPU flags it needs, its name, and its functions' signatures (``kernels/cpu_abi.py``)."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    table: tuple[cpu_abi.Signature, ...]


_KINDS: dict[torch.dtype | str, _Build] = {  # per element type, or OPS, NVFP4
    torch.bfloat16: _Build("bf16", (_DIR / "cpu_bf16.c",), ("-mavx512f", "-mavx512bf16", "-mavx2", "-mfma"),
                           ("avx512f", "avx512_bf16", "avx2", "fma"), cpu_abi.experts_table("bf16")),
    torch.float32: _Build("f32", (_DIR / "cpu_f32.c",), ("-mavx2", "-mfma"), ("avx2", "fma"),
                          cpu_abi.experts_table("f32")),
    OPS: _Build("ops", (_DIR / "cpu_ops.c", _DIR / "cpu_ops_mla.c", _DIR / "cpu_ops_heads.c", _DIR / "cpu_ops_moe.c",
                      _DIR / "cpu_threads.c"),
                ("-mavx2", "-mfma", "-ffp-contract=off"), ("avx2", "fma"), cpu_abi.OPS_TABLE),  # torch's roundings
    NVFP4: _Build("nvfp4", (_DIR / "cpu_nvfp4.c", _DIR / "cpu_nvfp4_bf16.c"),
                  ("-mavx512f", "-mavx512bw", "-mavx512vbmi", "-mavx512bf16", "-mavx2", "-mfma"),
                  ("avx512f", "avx512bw", "avx512vbmi", "avx512_bf16", "avx2", "fma"), cpu_abi.NVFP4_TABLE),
}


def _cpu_has(*flags: str) -> bool:
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(f in words for f in flags)


def _cpu_has_avx512_bf16() -> bool:
    return _cpu_has("avx512f", "avx512_bf16")


def _tag(build: _Build, twins: str) -> str:
    """The build's cache key: every input of the compile (its sources, every header beside them, the
    generated twins, the flags), so that a changed one never loads a stale library."""
    digest = hashlib.sha256("\0".join(build.cflags).encode())
    for path in (*build.sources, *sorted(_DIR.glob("cpu_*.h"))):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(twins.encode())
    return digest.hexdigest()[:16]


def _build(cc: str, lib_path: Path, build: _Build, twins: str) -> None:
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
        tmp_lib, twins_path = Path(tmp) / lib_path.name, Path(tmp) / f"cpu_{build.name}_twins.c"
        twins_path.write_text(twins)
        cmd = [cc, "-O3", *build.cflags, "-fopenmp", "-shared", "-fPIC", f"-I{_DIR}", *map(str, build.sources),
               str(twins_path), "-o", str(tmp_lib), "-lm"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=proc.stderr)
        os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see a partial file


_twins: dict[torch.dtype | str, dict[str, cpu_abi.Twin]] = {}  # per loaded library: its recorded functions' twins


@cache
def _library(dtype: torch.dtype | str = torch.bfloat16) -> ctypes.CDLL | None:
    build = _KINDS[dtype]
    if not env.cpu_kernels_enabled() or not _cpu_has(*build.cpu_flags):
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    twins = cpu_abi.twins_source(build.table)
    lib_path = env.cache_dir() / "kernels" / f"cpu_{build.name}-{_tag(build, twins)}.so"
    try:
        if not lib_path.exists():
            _build(cc, lib_path, build, twins)
        lib = ctypes.CDLL(str(lib_path))
        _twins[dtype] = cpu_abi.bind(lib, build.table)
        if dtype == OPS:
            cpu_threads.use_waits(lib.epserve_brief_waits)  # the monitor switches the waits through it
    except (OSError, AttributeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        logger.warning("CPU %s kernels unavailable (%s); using torch", build.name, detail.strip()[:200])
        return None
    logger.info("CPU %s decode kernels loaded from %s", build.name, lib_path)
    return lib


_recording = threading.local()  # .recorder: kernels/cpu_graph.py's, while this thread records a decode step


def _lib(dtype: torch.dtype | str) -> ctypes.CDLL | None:
    """The ``dtype`` library (loaded), or, while this thread records a step, its calls through the recorder."""
    lib = _library(dtype)
    recorder = getattr(_recording, "recorder", None)
    return lib if lib is None or recorder is None else recorder.library(_twins[dtype])


_available: dict[torch.dtype | str, bool] = {}  # available()'s answers, once asked: constants to torch.compile


def available(dtype: torch.dtype | str = torch.bfloat16) -> bool:
    """Whether the ``dtype`` kernels load here (built on first ask). Ask once before compiling a forward
    that may call them (``engine/graphs.py`` does), so torch.compile reads a constant instead of following
    the build."""
    if dtype not in _available:
        _available[dtype] = dtype in _KINDS and _library(dtype) is not None
    return _available[dtype]


def _eligible(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return dtype in _KINDS and all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def _k_ok(dtype: torch.dtype, k: int) -> bool:
    """Whether the GEMM kernels of ``dtype`` take an inner dimension of ``k`` (fp32: eight at a time; bf16: any)."""
    return k > 0 and (dtype == torch.bfloat16 or k % 8 == 0)


def linear_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`linear` takes x [M, K] @ w[N, K]^T: bf16 or fp32 CPU tensors, contiguous, of one dtype,
    M <= TILE_M rows (decode), an inner dimension its kernel takes, the library loaded, and no gradients
    (the training model shares the layers). Shapes and dtypes only: it answers in a trace too."""
    return (x.dim() == 2 and 0 < x.shape[0] <= TILE_M and _eligible(x, w) and _k_ok(x.dtype, x.shape[1])
            and available(x.dtype) and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T by the decode GEMM of ``x``'s dtype, bf16 or fp32, which streams ``w`` once: the
    ``kernels.dense.linear`` op's CPU implementation, for the calls :func:`linear_takes` accepts."""
    lib = _lib(x.dtype)
    assert lib is not None, f"the CPU {x.dtype} kernels are not available (kernels.cpu.available)"
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    kernel = lib.epserve_linear_f32 if x.dtype == torch.float32 else lib.epserve_linear_bf16
    kernel(x.data_ptr(), x.shape[0], w.data_ptr(), w.shape[0], x.shape[1], out.data_ptr(), cpu_threads.threads())
    return out


def moe_swiglu(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor | None:
    """Experts on rows grouped by expert. The kernel takes every expert with at most TILE_M rows;
    the few larger ones (skewed routing) run through torch here. Returns None when the kernel does not
    apply or most of the work is large groups (prefill), for which the caller's grouped GEMM is best."""
    hidden, inter = w2.shape[1], w2.shape[2]
    if not counts or not _eligible(x, w13, w2) or not (_k_ok(x.dtype, hidden) and _k_ok(x.dtype, inter)):
        return None
    big = [e for e, n in enumerate(counts) if n > TILE_M]
    if sum(counts[e] for e in big) * 2 > len(x):
        return None
    lib = _lib(x.dtype)
    if lib is None:
        return None
    starts = list(itertools.accumulate(counts, initial=0))
    offsets = torch.tensor(starts, dtype=torch.int64)
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
    kernel = lib.epserve_moe_swiglu_f32 if x.dtype == torch.float32 else lib.epserve_moe_swiglu_bf16
    kernel(x.data_ptr(), offsets.data_ptr(), len(counts), w13.data_ptr(), w2.data_ptr(), hidden, inter,
           out.data_ptr(), cpu_threads.threads())
    for e in big:
        lo, hi = starts[e], starts[e + 1]
        gate, up = F.linear(x[lo:hi], w13[e]).chunk(2, dim=-1)
        out[lo:hi] = F.linear(F.silu(gate) * up, w2[e])
    return out


_COUNTS_MAX_ROWS = 8 * TILE_M  # decode-sized expert inputs: the device counts path


def moe_swiglu_counts(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor) -> torch.Tensor | None:
    """Experts on rows grouped by expert, the row counts [E] (an int64 tensor) read by the kernel (never on
    the host); rows of ``x`` [N, H] past the counts' sum come out zero: the ``grouped_swiglu`` op's first CPU
    implementation. For decode-sized inputs (N at most ``_COUNTS_MAX_ROWS``), else None."""
    hidden, inter = w2.shape[1], w2.shape[2]
    if (not isinstance(counts, torch.Tensor) or not 0 < x.shape[0] <= _COUNTS_MAX_ROWS or not _eligible(x, w13, w2)
            or not (_k_ok(x.dtype, hidden) and _k_ok(x.dtype, inter))
            or counts.dtype != torch.int64 or counts.shape != (w13.shape[0],) or not counts.is_contiguous()):
        return None
    lib = _lib(x.dtype)
    if lib is None:
        return None
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
    kernel = lib.epserve_moe_swiglu_counts_f32 if x.dtype == torch.float32 else lib.epserve_moe_swiglu_counts_bf16
    if kernel(x.data_ptr(), x.shape[0], counts.data_ptr(), counts.shape[0], w13.data_ptr(), w2.data_ptr(), hidden,
              inter, out.data_ptr(), cpu_threads.threads()):
        raise ValueError(f"expert row counts {counts.tolist()} add up to more than the {x.shape[0]} rows")
    return out
