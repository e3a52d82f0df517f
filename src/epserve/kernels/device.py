"""What a kernel asks about where it runs, asked in one place: whether the call is being traced, and the
CUDA compute capability of a device.

A trace on fake CUDA tensors (``FakeTensorMode``, no GPU needed) must not ask the CUDA driver anything:
on a machine without one the question crashes, and on one with a GPU the answer would be that GPU's, not
the target's. :func:`assume_capability` pins the capability a trace is for, so one machine can trace
both the Hopper (SM90) and the pre-Hopper branches; outside it :func:`capability` asks torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_pinned: list[tuple[int, int]] = []  # assume_capability's stack: the innermost answer wins


def tracing() -> bool:
    """Whether this call is being traced (``torch.compile``) or run on fake tensors: the kernels' front
    ends then call their custom op (``kernels/ops.py``), one opaque call with a fake implementation."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def capability(device: torch.device | str) -> tuple[int, int]:
    """The (major, minor) compute capability of CUDA ``device``: the pinned one inside
    :func:`assume_capability`, else the driver's."""
    device = torch.device(device)
    if device.type != "cuda":
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
