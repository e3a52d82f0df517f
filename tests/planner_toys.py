"""Shared inputs of the planner's hand-computed tests: DeepSeek-V3's config and a toy GPU with round
numbers."""

from __future__ import annotations

from epserve.planner import resolve_model
from epserve.planner.hardware import Efficiency, HardwareSpec

V3 = resolve_model("deepseek-v3")[1]
TOY = HardwareSpec(
    name="toy", peak_flops={"bf16": 1e12}, memory_bytes=10 * 2**30, memory_bandwidth=1e11,
    nvlink_bandwidth=1e10, ib_bandwidth=1e9, gpus_per_node=4,
    efficiency={c: Efficiency(0.5, 0.5) for c in ("gemm", "group_gemm", "attention", "other")},
    nvlink_efficiency=0.5, ib_efficiency=0.5, nvlink_latency_us=10.0, ib_latency_us=30.0,
    collective_latency_us=5.0, kernel_latency_us=2.0, reserved_memory_fraction=0.0,
)
