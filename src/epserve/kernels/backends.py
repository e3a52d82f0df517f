"""Which implementation runs each CUDA kernel op, decided once per process, device and dtype by a self-test.

An op (``mla_decode``, ``fp8_gemm``, ...) lists its backends in preference order; the last one is the
trusted fallback (the project's own Triton kernels, always there on CUDA). A faster backend ahead of it
is used only after its ``self_test`` passed on the device at hand: it runs the backend on a small case
against the project's torch reference and raises when the backend is missing (``ImportError`` of an
optional package), cannot run (a compile or launch error) or answers wrong. The first call for a
``(op, device, dtype)`` decides; a backend that fails logs one calm INFO line naming the error and the
backend used instead (``mla_decode: flashinfer unavailable (ImportError: ...); using triton``), and the
decision stands for the life of the process. ``dtype`` is what the backend's support depends on: the
cache dtype of ``mla_decode``, the output dtype of ``fp8_gemm``, ``nvfp4_gemm`` and ``nvfp4_w4a16``.

On speed as well. On a CUDA device every backend's self-test runs, and where more than one passed and each
has a ``benchmark`` (a run at DeepSeek-V3-like shapes for the op), a short timed self-test picks the fastest
(CUDA events, ``TIMING_REPEATS`` runs after a warm-up run, a few milliseconds per backend), logged in one
line with the times (``mla_decode on cuda:0, bfloat16: flashinfer 41 us, triton 63 us -> flashinfer``); a
backend whose timing raises is not chosen. Elsewhere (the CPU, whose C kernels are no backends' here) the
first backend that passes is used, untimed.

Each op module declares its op with :func:`register` when it is imported (``kernels.fp8_scaled_mm``: ``fp8_gemm``;
``kernels.mla_flashinfer``: ``mla_decode``; ``kernels.nvfp4_w4a4``: ``nvfp4_gemm``, the W4A4 GEMM on FP4 tensor
cores; ``kernels.nvfp4_w4a16``: ``nvfp4_w4a16``, the Triton W4A16 kernels); ``_DECLARED`` names that module, so
:func:`select` works whichever was imported first. An op's ``forced`` reads its environment variable
(``env.py``): a backend named there is used without a self-test or timing, so its errors surface.

Capture does not change a choice. Self-tests (and timings) never run inside a CUDA graph capture, and a call
there gets exactly what an eager call gets: the decision made before it. An op still undecided inside a
capture is an error (:class:`KernelUndecided`), never a silent other backend: the capture would then run other
kernels than the warm-up that compiled and loaded them.

:func:`resolve` decides every op the engine will call (at start-up, before the KV pool is sized and before
any capture), then has ``kernels.opdef`` fill each kernel op's table of implementations for the device and
dtypes (:func:`after_resolve`), and returns the one-line summary the engine logs. The tables list a backend's
implementation only where it was chosen (:func:`decide`); a changed decision (:func:`fall_back`,
:func:`forget`, :func:`register`) is told to them (:func:`on_change`).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

SelfTest = Callable[[torch.device, torch.dtype], None]
# (device, dtype) -> one run of the backend at the op's DeepSeek-V3-like shapes, inputs made once beforehand
Benchmark = Callable[[torch.device, torch.dtype], Callable[[], object]]

TIMED_DEVICES = ("cuda",)  # device types whose choice between passing backends is timed
TIMING_REPEATS = 5  # timed runs per backend (the median is compared), after one untimed warm-up run

# The module that registers each op (imported on the op's first use).
_DECLARED = {"mla_decode": "epserve.kernels.mla_flashinfer", "fp8_gemm": "epserve.kernels.fp8_scaled_mm",
             "nvfp4_gemm": "epserve.kernels.nvfp4_w4a4", "nvfp4_w4a16": "epserve.kernels.nvfp4_w4a16"}


class KernelMismatch(RuntimeError):
    """A backend's self-test answer is off the torch reference."""


class KernelUndecided(RuntimeError):
    """An op reached inside a CUDA graph capture before its backend was decided (see the module docstring)."""


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of an op. ``self_test(device, dtype)`` raises unless the implementation runs and
    matches the torch reference there; None marks the trusted fallback (never tested). ``benchmark(device,
    dtype)`` returns one run at the op's DeepSeek-V3-like shapes, timed where several backends pass."""

    name: str
    self_test: SelfTest | None = None
    benchmark: Benchmark | None = None


@dataclass(frozen=True)
class KernelOp:
    """An op's backends in preference order (the last is the fallback, without a self-test), and the
    reader of its environment override (``"auto"`` or a backend name) with the variable's name."""

    name: str
    backends: tuple[KernelBackend, ...]
    forced: Callable[[], str] = lambda: "auto"
    env_var: str = ""

    def __post_init__(self) -> None:
        if not self.backends or self.backends[-1].self_test is not None:
            raise ValueError(f"kernel op {self.name!r}: the last backend must be the fallback (no self-test)")

    @property
    def fallback(self) -> str:
        return self.backends[-1].name

    def backend(self, name: str) -> KernelBackend:
        for b in self.backends:
            if b.name == name:
                return b
        raise ValueError(f"kernel op {self.name!r} has no backend {name!r} (has {[b.name for b in self.backends]})")


_ops: dict[str, KernelOp] = {}
_chosen: dict[tuple[str, str, torch.dtype | None], str] = {}  # (op, device, dtype) -> backend name
_tested: dict[tuple[str, str, str, torch.dtype | None], str | None] = {}  # -> None (passed) or the error
_forced_logged: set[tuple[tuple[str, str, torch.dtype | None], str]] = set()
_lock = threading.RLock()  # one decision at a time (a self-test launches kernels)
_after: list[Callable[[torch.device, dict[str, torch.dtype | None]], None]] = []  # run by resolve at its end
_changed: list[Callable[[str | None], None]] = []  # told when an op's decisions change (None: every op's)


def after_resolve(hook: Callable[[torch.device, dict[str, torch.dtype | None]], None]) -> None:
    """Run ``hook(device, dtypes)`` at the end of each :func:`resolve` (``kernels.opdef`` fills the ops'
    tables)."""
    _after.append(hook)


def on_change(hook: Callable[[str | None], None]) -> None:
    """Run ``hook(op)`` whenever decisions of ``op`` (None: of every op) are dropped or changed."""
    _changed.append(hook)


def _tell(op: str | None) -> None:
    for hook in _changed:
        hook(op)


def register(op: KernelOp) -> KernelOp:
    """Declare (or redeclare) ``op``; decisions made for an earlier declaration of it are forgotten."""
    with _lock:
        _ops[op.name] = op
        forget(op.name)
    return op


def forget(op: str | None = None) -> None:
    """Drop the recorded decisions and self-test results (of one op, or all): the next call decides anew."""
    with _lock:
        for table in (_chosen, _tested):
            for key in [k for k in table if op is None or k[0] == op]:
                del table[key]
        _forced_logged.difference_update({k for k in _forced_logged if op is None or k[0][0] == op})
    _tell(op)


def unregister(name: str) -> None:
    """Remove an op and its decisions (an op declared for a while, as tests do)."""
    with _lock:
        _ops.pop(name, None)
        forget(name)


def get_op(name: str) -> KernelOp:
    if name not in _ops and name in _DECLARED:
        importlib.import_module(_DECLARED[name])
    if name not in _ops:
        raise ValueError(f"unknown kernel op {name!r}; known: {sorted(set(_ops) | set(_DECLARED))}")
    return _ops[name]


def device_key(device: torch.device | str) -> str:
    """``cuda:N`` with the index filled in (a bare ``cuda`` is the current device), else the type."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _where(key: tuple[str, str, torch.dtype | None]) -> str:
    return key[1] if key[2] is None else f"{key[1]}, {str(key[2]).removeprefix('torch.')}"


def _describe(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _run_self_test(op: KernelOp, backend: KernelBackend, device: torch.device, dtype: torch.dtype | None) -> str | None:
    """None when ``backend`` passed its self-test for ``dtype`` on ``device`` (run once), else the error."""
    key = (op.name, backend.name, device_key(device), dtype)
    if key not in _tested:
        if backend.self_test is None:
            _tested[key] = None
        else:
            try:
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        backend.self_test(device, dtype)  # type: ignore[arg-type]
                else:
                    backend.self_test(device, dtype)  # type: ignore[arg-type]
                _tested[key] = None
            except Exception as e:  # noqa: BLE001 - any failure means: not this backend
                _tested[key] = _describe(e)
    return _tested[key]


def passes(op_name: str, backend_name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> bool:
    """Whether ``backend_name`` of ``op_name`` passes its self-test on ``device`` for ``dtype`` (run once;
    whatever the environment forces). Inside a CUDA graph capture only a result already known is answered
    (:class:`KernelUndecided` otherwise: nothing is tested there)."""
    device = torch.device(device)
    op = get_op(op_name)
    backend = op.backend(backend_name)
    with _lock:
        key = (op.name, backend.name, device_key(device), dtype)
        if key not in _tested and _capturing(device):
            raise KernelUndecided(f"{op.name}: {backend.name}'s self-test on {_where((op.name, key[2], dtype))} "
                                  "was asked inside a CUDA graph capture before it ran")
        return _run_self_test(op, backend, device, dtype) is None


def select(op_name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend ``op_name`` uses on ``device`` for ``dtype``: the one its environment variable forces
    (read on every call), else the one decided on the first call (the first whose self-test passes; on CUDA
    the fastest of those that pass), logged in one line."""
    return decide(op_name, device, dtype)


def decide(op_name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """:func:`select` (the name ``kernels.opdef`` asks by). The same answer inside a CUDA graph capture as
    outside it; an op not decided before a capture raises :class:`KernelUndecided` there."""
    op = get_op(op_name)
    forced = op.forced()
    device = torch.device(device)
    key = (op.name, device_key(device), dtype)
    if forced != "auto":
        if (key, forced) not in _forced_logged:
            _forced_logged.add((key, forced))
            logger.info("%s on %s: %s (forced by %s)", op.name, _where(key), forced, op.env_var or "the caller")
        return forced
    chosen = _chosen.get(key)
    if chosen is not None:
        return chosen
    if _capturing(device):
        raise KernelUndecided(f"{op.name} on {_where(key)} was first reached inside a CUDA graph capture: decide it "
                              "before (kernels.backends.resolve at start-up, or an eager call)")
    with _lock:
        if key in _chosen:
            return _chosen[key]
        timed = device.type in TIMED_DEVICES
        passed: list[str] = []
        failures: list[tuple[str, str]] = []
        for backend in op.backends:
            error = _run_self_test(op, backend, device, dtype)
            if error is None:
                passed.append(backend.name)
                if not timed:
                    break
            else:
                failures.append((backend.name, error))
        chosen = _fastest(op, key, passed, device, dtype) if len(passed) > 1 else passed[0]
        _chosen[key] = chosen
        for name, error in failures:
            logger.info("%s: %s unavailable on %s (%s); using %s", op.name, name, _where(key), error, chosen)
        untimed = len(passed) == 1 or any(op.backend(name).benchmark is None for name in passed)
        if not failures and untimed and chosen != op.fallback:
            logger.info("%s on %s: %s (self-test passed)", op.name, _where(key), chosen)
        return chosen


def _fastest(op: KernelOp, key: tuple[str, str, torch.dtype | None], passed: list[str], device: torch.device,
             dtype: torch.dtype | None) -> str:
    """The fastest of the backends that passed (timed once each; logged in one line), or the first of them
    when one has no benchmark. A backend whose timing raised is not chosen (the fallback when none could be
    timed)."""
    if any(op.backend(name).benchmark is None for name in passed):
        return passed[0]
    times: dict[str, float] = {}
    errors: dict[str, str] = {}
    for name in passed:
        try:
            times[name] = _measure(op.backend(name), device, dtype)
        except Exception as e:  # noqa: BLE001 - a backend that cannot be timed is not chosen
            errors[name] = _describe(e)
    chosen = min(times, key=lambda name: (times[name], passed.index(name))) if times else op.fallback
    report = [f"{name} {times[name] * 1e6:.0f} us" if name in times else f"{name} failed ({errors[name]})"
              for name in passed]
    logger.info("%s on %s: %s -> %s", op.name, _where(key), ", ".join(report), chosen)
    return chosen


def _measure(backend: KernelBackend, device: torch.device, dtype: torch.dtype | None) -> float:
    """Seconds per run of ``backend``'s benchmark on CUDA ``device``: the median of ``TIMING_REPEATS`` runs
    timed with CUDA events, after one untimed run (compiles, plans, first-touch). Its inputs are freed and
    handed back to the driver afterwards (the KV pool is sized from the device's free memory)."""
    assert backend.benchmark is not None
    with torch.cuda.device(device):
        run = backend.benchmark(device, dtype)  # type: ignore[arg-type]
        run()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(TIMING_REPEATS)]
        for start, end in events:
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        del run
        torch.cuda.empty_cache()
    elapsed = sorted(start.elapsed_time(end) for start, end in events)  # milliseconds
    return elapsed[len(elapsed) // 2] / 1e3


def fall_back(op_name: str, device: torch.device | str, dtype: torch.dtype | None, reason: str) -> str:
    """Record that ``op_name`` uses its fallback on ``device`` for ``dtype`` from now on (a backend failed
    on a case its self-test did not cover); logs one warning line. Returns the fallback's name."""
    op = get_op(op_name)
    key = (op.name, device_key(device), dtype)
    with _lock:
        previous = _chosen.get(key)
        _chosen[key] = op.fallback
    _tell(op.name)
    if previous != op.fallback:
        logger.warning("%s: %s failed on %s (%s); using %s from now on", op.name, previous, _where(key), reason,
                       op.fallback)
    return op.fallback


def agree(device: torch.device | str, dtypes: Mapping[str, torch.dtype | None],
          gather: Callable[[object], list[object]]) -> None:
    """Make every rank run the same backend for each op of ``dtypes`` (a timed choice may differ between
    ranks). ``gather(obj)`` returns every rank's ``obj`` in rank order. The first rank's choice where every rank
    passed its self-test, else the first backend (in the op's order) that passed on every rank; one log line
    where this rank's choice changes. Forced ops are left alone (the same variable on every rank)."""
    device = torch.device(device)
    mine = {}
    for name, dtype in dtypes.items():
        op = get_op(name)
        if dtype is not None and op.forced() == "auto":
            chosen = decide(name, device, dtype)
            ok = [b.name for b in op.backends if _tested.get((op.name, b.name, device_key(device), dtype), "") is None]
            mine[name] = (chosen, ok)
    ranks = gather(mine)
    for name, (chosen, _) in mine.items():
        op, dtype = get_op(name), dtypes[name]
        everywhere = [b.name for b in op.backends if all(b.name in theirs[name][1] for theirs in ranks)]
        first = ranks[0][name][0]
        agreed = first if first in everywhere else (everywhere[0] if everywhere else op.fallback)
        if agreed != chosen:
            key = (op.name, device_key(device), dtype)
            with _lock:
                _chosen[key] = agreed
            _tell(op.name)
            logger.info("%s on %s: %s, as on every rank (this rank had chosen %s)", op.name, _where(key), agreed,
                        chosen)


def decided(op_name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str | None:
    """The backend ``op_name`` runs on ``device`` for ``dtype`` as decided so far (forced, or chosen and agreed
    between ranks), None while undecided: read, never decided, by what depends on a start-up decision."""
    forced = get_op(op_name).forced()
    return forced if forced != "auto" else _chosen.get((op_name, device_key(device), dtype))


def decisions() -> dict[str, str]:
    """Every decision so far: ``"op[device, dtype]"`` -> backend name."""
    with _lock:
        return {f"{key[0]}[{_where(key)}]": name for key, name in sorted(_chosen.items(), key=lambda kv: str(kv[0]))}


def resolve(device: torch.device | str, dtypes: Mapping[str, torch.dtype | None]) -> str:
    """Decide now each op of ``dtypes`` (op name -> the dtype its calls use; None: the op is not called)
    on ``device`` and say which backend each uses, in one line: ``mla_decode=flashinfer fp8_gemm=triton``.
    Off CUDA every op runs its torch reference (or the CPU kernels) and nothing is tested."""
    device = torch.device(device)
    if device.type != "cuda":
        summary = f"torch reference ({device.type})"
    else:
        parts = [f"{op}={select(op, device, dtype)}" for op, dtype in dtypes.items() if dtype is not None]
        summary = " ".join(parts) or "none"
    for hook in _after:
        hook(device, dict(dtypes))
    return summary
