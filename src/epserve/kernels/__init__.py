"""Kernel selection for the model's hot ops: custom kernels where they apply, torch otherwise.

The model calls these instead of ``F.linear`` so the choice is made in one place, per call, from
the tensors' device, dtype and shape (never from the parallel layout).
"""

from epserve.kernels.cpu import linear, moe_swiglu

__all__ = ["linear", "moe_swiglu"]
