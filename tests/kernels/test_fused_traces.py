"""Traces of the small fused ops (``kernels.fused``): on fake CUDA tensors each is its custom op, never Triton;
what the kernels do not take, and CPU tensors, trace the torch references."""

from __future__ import annotations

import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from epserve.kernels import fused
from epserve.kernels.device import trace_as_cuda

EPS = 1e-6


class OpLog(TorchDispatchMode):
    """The ops a trace ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_fake_cuda_trace_goes_through_the_custom_ops(monkeypatch):
    """On fake "CUDA" tensors (meta, ``trace_as_cuda``) at DeepSeek-V3's shapes each front end is its
    custom op, with the reference's shape and dtype, without entering Triton or reading a value; what the
    kernels do not take (fp16, a rotation promoted past q's dtype, gradients) stays the reference."""
    def no_triton(*args, **kwargs):
        raise AssertionError("a trace entered Triton")

    for op in (fused.rms_norm, fused.rope_heads, fused.append_latent):  # no eager implementation chosen or run
        monkeypatch.setattr(op, "_table", {})
        monkeypatch.setattr(op, "fill", no_triton)
    monkeypatch.setitem(sys.modules, "epserve.kernels.fused_triton", None)  # nor imported
    log = OpLog()
    with torch.inference_mode(), trace_as_cuda(), FakeTensorMode(), log:
        x = _meta(8, 7168)
        out = fused.rms_norm(x, _meta(7168, dtype=torch.float32), EPS)
        assert out.shape == (8, 7168) and out.dtype == torch.float32 and out.device.type == "meta"
        q, cos = _meta(8, 128, 192), _meta(8, 32)
        out = fused.rope_heads(q, cos, cos, True, 64)
        assert out.shape == q.shape and out.dtype == q.dtype
        cache = _meta(64, 576)
        assert fused.append_latent(_meta(8, 576), _meta(512), EPS, cos, cos, True,
                                   _meta(8, dtype=torch.int64), cache, 512) is None
    assert {"epserve.rms_norm", "epserve.rope_heads", "epserve.append_latent"} <= log.ops, log.ops
    log = OpLog()
    with trace_as_cuda(), FakeTensorMode(), log:
        assert fused.rms_norm(_meta(2, 64, dtype=torch.float16), _meta(64, dtype=torch.float16), EPS).shape == (2, 64)
        cos = _meta(2, 16, dtype=torch.float32)  # bf16 q, fp32 tables: the reference's fp32 result
        assert fused.rope_heads(_meta(2, 4, 96), cos, cos, True, 32).dtype == torch.float32
        x = torch.empty(2, 64, device="meta", requires_grad=True)
        assert fused.rms_norm(x, _meta(64, dtype=torch.float32), EPS).requires_grad
    with FakeTensorMode(), log:  # CPU tensors traced: the references (inductor fuses them), no C call
        assert fused.rms_norm(torch.randn(2, 64), torch.randn(64), EPS).shape == (2, 64)
        assert fused.rope_heads(torch.randn(2, 4, 96), torch.randn(2, 16), torch.randn(2, 16), True, 32).shape == (
            2, 4, 96)
    assert not {o for o in log.ops if o.startswith("epserve.")}, log.ops
