"""The CPU's captured decode: a decode step recorded once as the sequence of C kernel calls it makes, then
replayed from C in one call, with no Python and no torch dispatch between the kernels (the CPU twin of a
CUDA graph).

:func:`record` runs a forward once with every call of the ``kernels.cpu`` libraries going through a
:class:`Recorder`: each call runs as it is recorded, through the kernel's packed twin (its arguments as
one int64 array, ``kernels/cpu_abi.py``), so what is recorded is exactly what ran. Like a CUDA graph, the replay
reads and writes the same memory: the step's inputs are copied into the recorded input tensors before each
replay (``engine/graphs.py``), every intermediate tensor is kept alive with the graph, and the kernels read
the step's data (token ids, positions, lengths, block tables, expert counts) from memory at replay time,
never as host values baked into the recording.

A recording holds only if nothing but those kernels computed on the step's data. A torch dispatch mode
(:class:`_Guard`) watches every torch op of the recorded forward: allocations and views pass, as do ops on
weights alone; an op that reads the inputs, the KV cache, a module buffer or any tensor made during the
recording (a torch fallback, a host read such as ``.tolist()``) ends the recording with
:class:`CaptureError` before it runs, and the caller runs that bucket eagerly instead.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from epserve.kernels import cpu, cpu_abi, cpu_ops, cpu_threads


class CaptureError(RuntimeError):
    """The forward computed on the step's data outside the C kernels: it cannot be replayed."""


_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Guard(TorchDispatchMode):
    """Refuses every torch op that computes on the step's data (``dynamic`` storages: given, and every tensor
    made under the guard, which a kernel may write); keeps every tensor it sees made alive in ``keep``."""

    def __init__(self, dynamic: Iterable[torch.Tensor], keep: list[torch.Tensor]) -> None:
        super().__init__()
        self.dynamic = {_storage(t) for t in dynamic} - {0}  # (0: empty tensors, which hold no data)
        self.keep = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _ALLOCATIONS:
            out = func(*args, **kwargs)
            self.dynamic.add(_storage(out))
            self.dynamic.discard(0)
            self.keep.append(out)
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        reads_step = any(_storage(t) in self.dynamic for t in inputs)
        if reads_step and not func.is_view:
            raise CaptureError(f"{func} ({_shapes(inputs)}) computes on the step's data outside the C kernels")
        out = func(*args, **kwargs)
        aliased = {_storage(t) for t in inputs}
        made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and _storage(t) not in aliased]
        if made and reads_step:  # an op that may alias (``to``, ``contiguous``, ``reshape``) copied instead
            raise CaptureError(f"{func} ({_shapes(inputs)}) copies the step's data outside the C kernels")
        self.keep.extend(made)
        self.dynamic.update(_storage(t) for t in made if t.numel())  # a kernel may write it: the step's data now
        return out


def _shapes(tensors: list[torch.Tensor]) -> str:
    return ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in tensors)


@dataclass(frozen=True)
class Call:
    """One recorded kernel call: its name (for errors), its packed twin's address, its arguments, which of
    them is its thread count (or None)."""

    name: str
    fn: int
    args: ctypes.Array
    threads: int | None = None


class _RecordingLibrary:
    """A loaded kernel library whose calls are recorded as they run (``twins``: its functions' packed twins,
    ``kernels/cpu_abi.py``)."""

    def __init__(self, twins: dict[str, cpu_abi.Twin], recorder: Recorder) -> None:
        self._twins = twins
        self._recorder = recorder

    def __getattr__(self, name: str) -> Callable[..., int]:
        twin = self._twins.get(name)
        if twin is None:
            raise CaptureError(f"{name} has no packed twin: a recorded step cannot call it")
        return partial(self._recorder.call, twin)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Call] = []

    def library(self, twins: dict[str, cpu_abi.Twin]) -> _RecordingLibrary:
        return _RecordingLibrary(twins, self)

    def call(self, twin: cpu_abi.Twin, *values: Any) -> int:
        """Runs a kernel through its packed twin with these arguments, recorded; returns its code."""
        args = twin.pack(values)
        self.calls.append(Call(twin.name, twin.address, args, twin.threads))
        return int(twin.fn(ctypes.addressof(args)))


class CpuGraph:
    """A recorded forward: :meth:`replay` runs its kernel calls again, in one C call, on the threads
    ``kernels/cpu_threads.py`` gives the kernels at the time (the calls' thread counts are rewritten when that
    changed; the kernels' results do not depend on it)."""

    def __init__(self, calls: list[Call], keep: list[torch.Tensor]) -> None:
        self.calls = tuple(calls)
        self._keep = keep  # every tensor the calls point into
        n = len(self.calls)
        self._program = ((ctypes.c_int64 * max(n, 1))(*(c.fn for c in self.calls)),
                         (ctypes.c_int64 * max(n, 1))(*(ctypes.addressof(c.args) for c in self.calls)), n)
        self._thread_slots = tuple((c.args, c.threads) for c in self.calls if c.threads is not None)
        self.threads = self._thread_slots[0][0][self._thread_slots[0][1]] if self._thread_slots else None

    def set_threads(self, threads: int) -> None:
        """Every recorded call with a thread count runs on ``threads`` threads from the next replay."""
        if threads != self.threads:
            for args, i in self._thread_slots:
                args[i] = threads
            self.threads = threads

    def replay(self, seconds: ctypes.Array | None = None) -> None:
        """One replay; each call's wall time added to ``seconds`` (``timer()``'s array) when given."""
        if self._thread_slots:
            self.set_threads(cpu_threads.threads())
        failed, code = cpu_ops.replay(self._program, seconds)
        if failed >= 0:
            raise IndexError(f"the captured CPU decode's {self.calls[failed].name} refused this step's inputs "
                             f"(code {code}): a block, slot or id out of range")

    def timer(self) -> ctypes.Array:
        """Zeroed per-call seconds for :meth:`replay` (where a step goes: ``benchmarks/cpu_decode.py``)."""
        return (ctypes.c_double * max(len(self.calls), 1))()


@contextmanager
def _recording(recorder: Recorder):  # noqa: ANN202
    if getattr(cpu._recording, "recorder", None) is not None:
        raise RuntimeError("this thread is already recording a CPU decode step")
    cpu._recording.recorder = recorder  # this thread's kernel calls only
    try:
        yield
    finally:
        cpu._recording.recorder = None


def record(forward: Callable[[], torch.Tensor], dynamic: Iterable[torch.Tensor]) -> tuple[CpuGraph, torch.Tensor]:
    """Runs ``forward()`` once, recorded: (the graph that replays it, its output, which every replay rewrites).
    ``dynamic``: what changes between replays (the inputs, the KV caches, the modules' buffers). Raises
    CaptureError, part way through the forward, when it computes on them outside the kernels."""
    if not cpu.available(cpu.OPS):
        raise CaptureError("the CPU kernels of kernels/cpu_ops*.c are not available")
    recorder, keep = Recorder(), []
    with _recording(recorder), _Guard(dynamic, keep):
        out = forward()
    if not recorder.calls:
        raise CaptureError("the forward called no C kernel")
    keep.append(out)
    return CpuGraph(recorder.calls, keep), out
