"""The built-in hardware entries (H100, H200, H800, B200, GB200): datasheet peaks and links, with the
achievable fractions, kernel floors and all-to-all fits taken from public kernel tables (``kernel_tables``,
``kernel_fits``), and where each number comes from (``sources``). :func:`load_hardware` resolves a name
among them, ``local`` (this machine's calibration, ``epserve plan calibrate``) or a hardware file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epserve.planner.errors import PlanError
from epserve.planner.hardware import DEFAULT_LOCAL_FILE, Efficiency, GiB, HardwareSpec
from epserve.planner.kernel_fits import (
    blackwell_nvlink,
    curve_fraction,
    fit_gemm,
    hopper_curves,
    hopper_floors,
    hopper_links,
)
from epserve.planner.kernel_tables import (
    DEEPEP_LL,
    DEEPEP_NORMAL,
    DEEPGEMM,
    FLASHMLA,
    FLASHMLA_DENSE_GBS,
    FLASHMLA_DENSE_TFLOPS,
    FLASHMLA_SPARSE,
    FLASHMLA_SPARSE_TFLOPS,
)

DEEPGEMM_CITE = DEEPGEMM.cite()
DEEPEP_NORMAL_CITE = DEEPEP_NORMAL.cite("153 / 158 GB/s of H800's 200 (0.75)")

# Fractions of the datasheet peaks reached by published kernels (``kernel_fits`` computes the GEMM ones
# from DeepGEMM's rows; the constants are the curves' values where a kernel has no rows to speak of):
_GEMM = hopper_curves()
_FIT_M64 = _GEMM["gemm"][0].memory


def _at(cls: str, what: str, rows: float) -> float:
    return round(curve_fraction(_GEMM[cls], rows, what), 4)


_ATTENTION = Efficiency(compute=round(FLASHMLA_DENSE_TFLOPS / 989, 4), memory=round(FLASHMLA_DENSE_GBS / 3350, 4))
_HOPPER_EFFICIENCY = {
    "gemm": Efficiency(compute=_at("gemm", "compute", 4096), memory=_FIT_M64),
    "group_gemm": Efficiency(compute=_at("group_gemm", "compute", 4096), memory=_FIT_M64),
    "attention": _ATTENTION,
    "other": Efficiency(compute=0.50, memory=0.70),
}
# Blackwell: Hopper's GEMM fractions (no public Blackwell GEMM table found); MLA decode from FlashMLA's
# only B200 decode figure (the sparse kernel, 350 TFLOP/s) scaled by the dense/sparse ratio FlashMLA
# publishes on H800 (660 / 410); MHA prefill from FlashMLA's SM100 dense prefill (1460 TFLOP/s).
_B200_MLA_DECODE = FLASHMLA_SPARSE_TFLOPS["b200"] * FLASHMLA_DENSE_TFLOPS / FLASHMLA_SPARSE_TFLOPS["h800"]
_BLACKWELL_EFFICIENCY = {
    **_HOPPER_EFFICIENCY,
    "attention": Efficiency(compute=round(_B200_MLA_DECODE / 2250, 4), memory=_ATTENTION.memory),
    "attention_prefill": Efficiency(compute=round(1460 / 2250, 4), memory=_ATTENTION.memory),
}
_LATENCY = ("constant where no fit applies (prefill's high-throughput kernels); pplx-kernels' one-token "
            "figures rounded (" + DEEPEP_LL.cite() + " has none at one token)")
# Where every parameter of the built-in entries comes from (the curves, floors and fits carry their own):
ACHIEVABLE_SOURCES = {
    "efficiency.gemm": "efficiency_curves['gemm'] at M=4096 (compute, deep K) and M=64 (memory)",
    "efficiency.group_gemm": "efficiency_curves['group_gemm'] at M=4096 (compute, deep K); memory the dense fit's",
    "efficiency.attention": FLASHMLA.cite(f"dense MLA decode {FLASHMLA_DENSE_GBS:g} GB/s memory-bound, "
                                          f"{FLASHMLA_DENSE_TFLOPS:g} TFLOPS compute-bound "
                                          "(of 3350 GB/s, 989 TFLOP/s)"),
    "efficiency.attention_prefill": "falls back to efficiency.attention (no separate Hopper figure)",
    "efficiency.other": "assumption: norms, rotary, top-k and cache writes are elementwise kernels at ~70% of HBM",
    "gemm_depth_half": DEEPGEMM_CITE + ": 1/c linear in 1/K over the compute-bound rows",
    "kernel_latency_us": "kernel_floors['gemm']",
    "nvlink_efficiency": "constant for prefill's normal kernels: " + DEEPEP_NORMAL_CITE,
    "ib_efficiency": "constant for prefill's normal kernels: DeepEP's low-latency RDMA 39-46 GB/s of 50",
    "nvlink_latency_us": _LATENCY,
    "ib_latency_us": _LATENCY,
    "collective_latency_us": "assumption: 10 us per TP reduce-scatter / all-gather (no public small-message table "
    "found)",
}
_BLACKWELL_SOURCES = {
    **ACHIEVABLE_SOURCES,
    "efficiency.gemm": "Hopper's (no public Blackwell GEMM table found): " + ACHIEVABLE_SOURCES["efficiency.gemm"],
    "efficiency.group_gemm": "Hopper's: " + ACHIEVABLE_SOURCES["efficiency.group_gemm"],
    "efficiency.attention": f"estimated: {FLASHMLA_SPARSE.cite('sparse decode 350 TFLOPS on B200, 410 on H800')} x "
    f"the dense/sparse ratio on H800 ({FLASHMLA_DENSE_TFLOPS:g} / 410) = {_B200_MLA_DECODE:.0f} TFLOPS of 2250; "
    "memory Hopper's",
    "efficiency.attention_prefill": "deepseek-ai/FlashMLA README.md @c28eca99dc, SM100 dense MHA prefill: up to "
    "1460 TFLOPS forward on B200 (of 2250)",
}

T = 1e12
GB = 1e9
_HOPPER_TABLES: dict[str, Any] = {"efficiency": _HOPPER_EFFICIENCY, "efficiency_curves": _GEMM,
                                  "kernel_floors": hopper_floors(), "kernel_latency_us": hopper_floors()["gemm"].us,
                                  "gemm_depth_half": round(fit_gemm().depth_half, 1),
                                  "all_to_all_fits": hopper_links(50 * GB), "sources": ACHIEVABLE_SOURCES}
_BLACKWELL_TABLES: dict[str, Any] = {**_HOPPER_TABLES, "efficiency": _BLACKWELL_EFFICIENCY,
                                     "all_to_all_fits": {**hopper_links(50 * GB), **blackwell_nvlink(900 * GB)},
                                     "sources": _BLACKWELL_SOURCES}
BUILTIN: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="h100",
        peak_flops={"bf16": 989 * T, "fp8": 1979 * T},
        memory_bytes=80 * GiB,
        memory_bandwidth=3350 * GB,
        nvlink_bandwidth=450 * GB,
        ib_bandwidth=50 * GB,
        **_HOPPER_TABLES,
        source="NVIDIA H100 SXM datasheet (dense); NDR 400 Gb/s NIC per GPU",
    ),
    "h200": HardwareSpec(
        name="h200",
        peak_flops={"bf16": 989 * T, "fp8": 1979 * T},
        memory_bytes=141 * GiB,
        memory_bandwidth=4800 * GB,
        nvlink_bandwidth=450 * GB,
        ib_bandwidth=50 * GB,
        **_HOPPER_TABLES,
        source="NVIDIA H200 SXM datasheet (dense); NDR 400 Gb/s NIC per GPU",
    ),
    "h800": HardwareSpec(
        name="h800",
        peak_flops={"bf16": 989 * T, "fp8": 1979 * T},
        memory_bytes=80 * GiB,
        memory_bandwidth=3350 * GB,
        nvlink_bandwidth=200 * GB,
        ib_bandwidth=50 * GB,
        **_HOPPER_TABLES,
        source="H800 SXM: H100 compute and HBM, NVLink 400 GB/s bidirectional; CX7 400 Gb/s per GPU",
    ),
    "b200": HardwareSpec(
        name="b200",
        peak_flops={"bf16": 2250 * T, "fp8": 4500 * T, "fp4": 9000 * T},
        memory_bytes=180 * GiB,
        memory_bandwidth=7700 * GB,
        nvlink_bandwidth=900 * GB,
        ib_bandwidth=50 * GB,
        **_BLACKWELL_TABLES,
        source="NVIDIA HGX B200 datasheet (dense); ConnectX-7 400 Gb/s per GPU; "
        "Hopper GEMM fractions, FlashMLA attention",
    ),
    "gb200": HardwareSpec(
        name="gb200",
        peak_flops={"bf16": 2500 * T, "fp8": 5000 * T, "fp4": 10000 * T},
        memory_bytes=186 * GiB,
        memory_bandwidth=8000 * GB,
        nvlink_bandwidth=900 * GB,
        ib_bandwidth=50 * GB,
        gpus_per_node=72,
        **_BLACKWELL_TABLES,
        source="NVIDIA GB200 NVL72 datasheet / 72 (dense); one NVLink domain of 72 GPUs; "
        "Hopper GEMM fractions, FlashMLA attention",
    ),
}
GPU_CHOICES = (*BUILTIN, "local")


def load_hardware(name: str | Path) -> HardwareSpec:
    """A built-in entry (``h100``…), ``local`` (this machine's calibration file), or a JSON path."""
    key = str(name).lower()
    if key in BUILTIN:
        return BUILTIN[key]
    if key == "local":
        if not DEFAULT_LOCAL_FILE.is_file():
            raise PlanError(
                f"no calibration for this machine at {DEFAULT_LOCAL_FILE}; run `epserve plan calibrate` first"
            )
        return load_hardware(DEFAULT_LOCAL_FILE)
    path = Path(name)
    if not path.is_file():
        raise PlanError(f"unknown GPU {str(name)!r}: expected one of {', '.join(GPU_CHOICES)} or a JSON file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read hardware file {path}: {e}") from None
    if not isinstance(raw, dict) or "peak_flops" not in raw:
        raise PlanError(f"{path} is not a hardware file (no peak_flops)")
    return HardwareSpec.from_dict(raw)
