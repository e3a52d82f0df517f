"""What a kernel asks about where it runs, asked in one place: whether the call is being traced, whether
a tensor is a CUDA tensor (and may use a side stream), and the CUDA compute capability of a device.

A trace of the CUDA branches on fake tensors (``FakeTensorMode``, no GPU needed) must not ask the CUDA
driver anything: on a machine without one the question crashes, and on one with a GPU the answer would be
that GPU's, not the target's. :func:`assume_capability` pins the capability a trace is for, so one machine
can trace both the Hopper (SM90) and the pre-Hopper branches; outside it :func:`capability` asks torch.

A CPU-only torch cannot trace fake *CUDA* tensors: its Python indexing (``x[i]``, ``x[:, :n]``) takes a
CUDA device guard that such a build does not have ("PyTorch is not linked with support for cuda
devices"), whatever the fake mode. So the trace runs on fake *meta* tensors inside :func:`trace_as_cuda`,
where :func:`is_cuda` answers yes for them: every front end that asks ``is_cuda`` takes its CUDA branch
(the Triton kernels' custom ops, ``torch._grouped_mm``, the FP8 scale layouts), and a host read
(``.item()``, ``.tolist()``, a data-dependent shape) raises as it would on fake CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_pinned: list[tuple[int, int]] = []  # assume_capability's stack: the innermost answer wins
_meta_is_cuda: list[bool] = []  # trace_as_cuda's stack: non-empty, meta tensors stand for CUDA ones


def tracing() -> bool:
    """Whether this call is being traced (``torch.compile``) or run on fake tensors: the kernel
    ops then call their custom op (``kernels/opdef.py``), one opaque call with a fake implementation."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def values_readable() -> bool:
    """Whether a kernel may read tensor values on the host now (a shortcut that skips padding rows): not while
    traced, where tensors have shapes but no values."""
    return not tracing()


def side_stream_usable(x: torch.Tensor) -> bool:
    """Whether work on ``x`` may run on a second CUDA stream: a real CUDA tensor, eagerly (a trace is of
    one stream's work)."""
    return x.is_cuda and torch.cuda.is_available() and not tracing()


def is_cuda(t: torch.Tensor | torch.device | str) -> bool:
    """Whether a tensor (or device) is CUDA's: the kernels' one question about where they run. Inside
    :func:`trace_as_cuda` meta tensors count as CUDA tensors."""
    device = t.device if isinstance(t, torch.Tensor) else torch.device(t)
    return device.type == "cuda" or (device.type == "meta" and bool(_meta_is_cuda))


def device_type(t: torch.Tensor) -> str:
    """The type of ``t``'s device, ``cuda`` for the meta tensors that stand for CUDA ones (:func:`is_cuda`):
    which device's kernels a kernel op runs (asked on every call, so kept cheap)."""
    if t.is_cpu:  # (the properties are cheaper than ``t.device``)
        return "cpu"
    if t.is_cuda or (t.is_meta and _meta_is_cuda):
        return "cuda"
    return t.device.type


def capability(device: torch.device | str) -> tuple[int, int]:
    """The (major, minor) compute capability of CUDA ``device``: the pinned one inside
    :func:`assume_capability`, else the driver's."""
    device = torch.device(device)
    if not is_cuda(device):
        raise ValueError(f"a compute capability is a CUDA device's, not {device}'s")
    if _pinned:
        return _pinned[-1]
    if tracing() and not torch.cuda.is_available():
        raise RuntimeError(
            "the CUDA compute capability was asked while tracing on a machine without CUDA: pin the capability "
            "being traced with epserve.kernels.device.assume_capability((major, minor))"
        )
    return torch.cuda.get_device_capability(device)


@contextmanager
def assume_capability(cap: tuple[int, int]) -> Iterator[None]:
    """Within the block, :func:`capability` answers ``cap`` for every CUDA device (for traces on fake
    CUDA tensors, and for tests of a branch the machine's GPU would not take)."""
    if len(cap) != 2 or not all(isinstance(v, int) and v >= 0 for v in cap):
        raise ValueError(f"a compute capability is (major, minor), e.g. (9, 0); got {cap!r}")
    _pinned.append((cap[0], cap[1]))
    try:
        yield
    finally:
        _pinned.pop()


@contextmanager
def trace_as_cuda(cap: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Within the block, meta tensors stand for CUDA tensors of compute capability ``cap`` (:func:`is_cuda`,
    :func:`capability`): a fake-tensor trace on meta tensors takes the CUDA branches on a machine without
    one (see the module docstring for why not fake CUDA tensors)."""
    with assume_capability(cap):
        _meta_is_cuda.append(True)
        try:
            yield
        finally:
            _meta_is_cuda.pop()
