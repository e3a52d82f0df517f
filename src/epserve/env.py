"""Every ``EPSERVE_*`` environment variable, declared and read here only (read when asked, so a
variable set by a test or inherited by a spawned rank counts). Imports nothing of epserve: any layer
may use it.

| variable | meaning | default |
|---|---|---|
| ``EPSERVE_CACHE_DIR`` | built-in model and compiled CPU kernels | ``~/.cache/epserve`` |
| ``EPSERVE_NO_PROGRESS`` | ``1``: no progress bars (loading logs progress lines instead) | bars on a terminal |
| ``EPSERVE_CPU_KERNELS`` | ``0``: torch only, no C kernels (bf16: AVX512-BF16, fp32: AVX2) | on where supported |
| ``EPSERVE_THREADS_PER_RANK`` | torch threads of a CPU rank | cores / ranks per host |
| ``EPSERVE_PIN`` | ``0``: do not pin CPU ranks to their own cores | pinned |
| ``EPSERVE_CPU_ADAPT`` | ``0``: the CPU kernels' OpenMP waits spin whatever else runs on the cores | adapted |
| ``EPSERVE_API_KEY`` | the router's API key (``--api-key``); read, then removed from the environment | none |
| ``EPSERVE_ENGINE_TOKEN`` | the token engines require and routers send (``--engine-token``) | none |
| ``EPSERVE_COMPILE_BACKEND`` | ``compile=True``'s torch.compile backend (tests: ``aot_eager``) | ``inductor`` |
| ``EPSERVE_FP8_BACKEND`` | FP8 kernels on CUDA: ``auto``, ``triton``, ``scaled_mm`` or ``torch`` | ``auto`` |
| ``EPSERVE_MLA_BACKEND`` | paged MLA decode on CUDA: ``auto``, ``flashinfer`` or ``triton`` | ``auto`` |
| ``EPSERVE_NVFP4_BACKEND`` | NVFP4 linears on CUDA: ``auto``, ``triton`` (W4A16), ``scaled_mm`` (W4A4) | ``auto`` |
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = "EPSERVE_CACHE_DIR"
NO_PROGRESS = "EPSERVE_NO_PROGRESS"
CPU_KERNELS = "EPSERVE_CPU_KERNELS"
THREADS_PER_RANK = "EPSERVE_THREADS_PER_RANK"
PIN = "EPSERVE_PIN"
CPU_ADAPT = "EPSERVE_CPU_ADAPT"
API_KEY = "EPSERVE_API_KEY"
FP8_BACKEND = "EPSERVE_FP8_BACKEND"
COMPILE_BACKEND = "EPSERVE_COMPILE_BACKEND"
ENGINE_TOKEN = "EPSERVE_ENGINE_TOKEN"
FP8_BACKENDS = ("auto", "triton", "scaled_mm", "torch")
MLA_BACKEND = "EPSERVE_MLA_BACKEND"
MLA_BACKENDS = ("auto", "flashinfer", "triton")
NVFP4_BACKEND = "EPSERVE_NVFP4_BACKEND"
NVFP4_BACKENDS = ("auto", "triton", "scaled_mm")


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "")
    return default if value == "" else value != "0"


def cache_dir() -> Path:
    """``$EPSERVE_CACHE_DIR``, else ``~/.cache/epserve``."""
    value = os.environ.get(CACHE_DIR)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "epserve"


def builtin_model_dir() -> Path:
    """Where the built-in tiny model lives (``presets.default_model_path`` writes it on first use)."""
    return cache_dir() / "tiny-v1"  # bump the suffix whenever the generated weights change


def progress_disabled() -> bool:
    return _flag(NO_PROGRESS, False)


def cpu_kernels_enabled() -> bool:
    return _flag(CPU_KERNELS, True)


def pinning_enabled() -> bool:
    """CPU ranks pin themselves to their own cores unless ``EPSERVE_PIN=0``."""
    return _flag(PIN, True)


def cpu_adapt_enabled() -> bool:
    """The CPU kernels' waits follow the load on their cores (``kernels/cpu_threads.py``) unless
    ``EPSERVE_CPU_ADAPT=0``."""
    return _flag(CPU_ADAPT, True)


def threads_per_rank_override() -> int | None:
    value = os.environ.get(THREADS_PER_RANK)
    return int(value) if value else None


def share_cores(ranks_on_host: int) -> None:
    """Several engine worlds on one CPU host (``serve --disaggregate``): every rank started from here
    gets the host's cores shared out over all of them (unless ``EPSERVE_THREADS_PER_RANK`` is set), as
    one world's ranks do."""
    if not os.environ.get(THREADS_PER_RANK):
        os.environ[THREADS_PER_RANK] = str(max(1, len(os.sched_getaffinity(0)) // ranks_on_host))


def fp8_backend() -> str:
    """``$EPSERVE_FP8_BACKEND`` (one of ``FP8_BACKENDS``), else ``"auto"``: ``auto`` self-tests blockwise
    ``torch._scaled_mm`` once per device and output dtype (``kernels.backends``) and falls back to Triton;
    ``torch`` is the reference."""
    value = os.environ.get(FP8_BACKEND, "").strip().lower() or "auto"
    if value not in FP8_BACKENDS:
        raise ValueError(f"{FP8_BACKEND}={value!r}: expected one of {', '.join(FP8_BACKENDS)}")
    return value


def mla_backend() -> str:
    """``$EPSERVE_MLA_BACKEND`` (one of ``MLA_BACKENDS``), else ``"auto"``: ``auto`` uses FlashInfer's MLA
    decode where it is installed and passes its self-test (``kernels.backends``), the Triton kernels
    otherwise; a forced backend runs without the self-test."""
    value = os.environ.get(MLA_BACKEND, "").strip().lower() or "auto"
    if value not in MLA_BACKENDS:
        raise ValueError(f"{MLA_BACKEND}={value!r}: expected one of {', '.join(MLA_BACKENDS)}")
    return value


def nvfp4_backend() -> str:
    """``$EPSERVE_NVFP4_BACKEND`` (one of ``NVFP4_BACKENDS``), else ``"auto"``: ``auto`` runs an NVFP4
    checkpoint's linears W4A4 (FP4 activations, ``torch._scaled_mm``) where its self-test passes (compute
    capability 10.0 and up) and W4A16 (the Triton kernels) elsewhere; ``triton`` keeps W4A16 everywhere (exact
    against the dequantized checkpoint); ``scaled_mm`` forces W4A4 without the self-test."""
    value = os.environ.get(NVFP4_BACKEND, "").strip().lower() or "auto"
    if value not in NVFP4_BACKENDS:
        raise ValueError(f"{NVFP4_BACKEND}={value!r}: expected one of {', '.join(NVFP4_BACKENDS)}")
    return value


def compile_backend() -> str:
    return os.environ.get(COMPILE_BACKEND) or "inductor"


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def take_api_key() -> str | None:
    """``$EPSERVE_API_KEY``, taken out of this process's environment: no process started from here
    inherits it (``epserve serve`` hands the key to its router process with the router's options)."""
    return os.environ.pop(API_KEY, None) or None


def engine_token() -> str | None:
    return os.environ.get(ENGINE_TOKEN) or None



def quiet_grpc() -> None:
    """gRPC's core logs each refused TLS handshake (an impostor, a probe) at INFO, one line per
    connection attempt, which our own warning already says once; it reads its level when it loads,
    so call this first (processes started from here inherit it). An operator's GRPC_VERBOSITY wins."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


COLLECTIVE_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def collectives_on(interface: str) -> dict[str, str]:
    """Make gloo and NCCL bind their sockets to ``interface`` (set before the process groups are
    made), unless the user chose interfaces with ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
    (theirs win); returns what it set."""
    updates = {name: interface for name in COLLECTIVE_IFNAMES if not os.environ.get(name)}
    os.environ.update(updates)
    return updates


def collectives_on_loopback() -> dict[str, str]:
    """:func:`collectives_on` the loopback interface (a world on one host whose rendezvous is loopback)."""
    return collectives_on("lo")
