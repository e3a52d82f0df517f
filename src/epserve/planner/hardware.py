"""A hardware entry (:class:`HardwareSpec`): datasheet peaks, link bandwidths and the *achievable*
fractions of each, and its file (``save_hardware``; ``gpus.load_hardware`` reads one, and holds the
built-in entries).

A kernel never reaches its datasheet peak; each class of kernel gets its own fraction of compute and
of memory bandwidth. The built-in entries' (``gpus``) come from public kernel tables (``kernel_tables``,
``kernel_fits``): ``efficiency_curves`` (per class, by the rows a GEMM applies each weight to, and its
depth through ``gemm_depth_half``), ``kernel_floors`` per class and ``all_to_all_fits`` (decode
dispatch and combine per link and direction), every point with its source, and ``sources`` for the
remaining parameters. ``epserve plan calibrate`` replaces them with what it measures on the current
device and writes a file ``load_hardware`` reads.

Three more properties describe how a runtime, not just the silicon, spends time:

- ``memory_by_rows``: an *achievable-bandwidth curve* per kernel class, the memory fraction as a
  function of the rows a kernel applies each weight to (``m`` of a GEMM, tokens per expert of a
  grouped GEMM), measured at one or more weight-matrix sizes. A decode GEMV kernel streams weights
  near the memory's speed; at 16 rows the same kernel is compute-bound and delivers a fraction of
  it; small matrices stream slower than large ones. Empty (the GPU entries): the class's constant
  fraction.
- ``op_overhead_us`` + ``op_overhead_per_token_us`` x tokens: host time per operation of the stage
  list that runs (Python, framework dispatch, kernel launches, and the unfused elementwise chains
  of an eager runtime, which grow with the tokens). Zero on the GPU entries, which assume CUDA
  graphs and fused kernels.
- ``kernel_latency_us`` / ``step_overhead_us``: the floor of every kernel, and the host time per step
  outside the model (scheduling, batch building).
- ``dispatch_handshake_us`` / ``step_sync_us``: blocking host-side collectives of a multi-rank
  engine. Our ``all_to_all`` dispatcher exchanges the per-(rank, slot) counts with a synchronous
  all-to-all before it starts the rows' transfer, once per dispatch (EP > 1); every step starts with
  an all-reduce of the batch metadata over all ranks (DP > 1). Zero on the GPU entries: the
  low-latency dispatch kernels whose published latency they use (``nvlink_latency_us``) exchange
  counts on the device inside that latency, and a GPU server overlaps the step's metadata exchange
  with the previous step's kernels. ``epserve plan calibrate`` sets both to the collective latency it
  measures between rank processes.
- ``stream_efficiency``: the share of the calibrated weight-streaming rate (the memory fraction of
  the ``gemm`` and ``group_gemm`` classes, curve or constant) that those kernels reach inside a real
  decode step, where they run at the engine's own shapes (a few experts picked out of many, matrices
  of 0.5-6 MiB) with the host's work between them, rather than back to back on the calibration's
  shapes. 1.0 on the GPU entries (their fractions come from published kernel benchmarks);
  ``epserve plan calibrate`` fits it from decode steps of a synthetic model whose weights exceed the
  last-level cache several times.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epserve.planner.errors import PlanError
from epserve.planner.kernel_fits import AllToAllFit, CurvePoint, KernelFloor, curve_fraction

GiB = 1 << 30
KERNEL_CLASSES = ("gemm", "group_gemm", "attention", "attention_prefill", "other")
CLASS_FALLBACK = {"attention_prefill": "attention"}  # a class a file lacks is priced as this one
# The four-bit kernels' own classes, where a calibration measured them (``calibrate_fp4``; ``kernel_class``)
FP4_CLASSES = {"gemm": "gemm_fp4", "group_gemm": "group_gemm_fp4"}
# the weight-streaming classes ``stream_efficiency`` scales
STREAM_CLASSES = ("gemm", "group_gemm", *FP4_CLASSES.values())
DEFAULT_LOCAL_FILE = Path.home() / ".cache" / "epserve" / "hardware-local.json"


@dataclass(frozen=True)
class Efficiency:
    """Achievable fraction of the datasheet peak for one class of kernel."""

    compute: float
    memory: float


@dataclass(frozen=True)
class MeasuredPoint:
    """One calibration measurement (kept in the hardware file for the roofline plots)."""

    kind: str
    shape: str
    flops: float
    bytes: float
    time_us: float


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator and its links. Rates in FLOP/s and bytes/s, sizes in bytes, times in µs."""

    name: str
    peak_flops: dict[str, float]  # dense tensor-core peak by dtype: bf16, fp8, fp4 (absent: unsupported)
    memory_bytes: int
    memory_bandwidth: float
    nvlink_bandwidth: float  # per GPU, per direction
    ib_bandwidth: float  # per GPU, per direction (one NIC per GPU)
    gpus_per_node: int = 8  # the NVLink domain
    efficiency: dict[str, Efficiency] = field(default_factory=dict)  # by KERNEL_CLASSES (FP4_CLASSES if measured)
    nvlink_efficiency: float = 0.75
    ib_efficiency: float = 0.78
    nvlink_latency_us: float = 40.0  # fixed cost of one dispatch or combine inside a node
    ib_latency_us: float = 90.0  # ... and across nodes
    collective_latency_us: float = 10.0  # fixed cost of a TP reduce-scatter / all-gather (NVLink)
    dispatch_handshake_us: float = 0.0  # blocking count exchange before each dispatch's rows (EP > 1)
    step_sync_us: float = 0.0  # per step, the metadata all-reduce that keeps DP groups in lockstep (DP > 1)
    kernel_latency_us: float = 3.0  # floor of any kernel (launch + ramp) under CUDA graphs
    op_overhead_us: float = 0.0  # host time per stage op run (Python + dispatch); 0 with CUDA graphs
    op_overhead_per_token_us: float = 0.0  # ... plus this per token the op processes (eager elementwise chains)
    step_overhead_us: float = 0.0  # per step, outside the model (scheduler, batch building)
    stream_efficiency: float = 1.0  # in-step share of the calibrated gemm / group_gemm memory fraction
    reserved_memory_fraction: float = 0.10  # context, activations, graphs, communication buffers
    # Achievable-bandwidth curve per kernel class: ((rows, bytes of one weight matrix, memory fraction), ...)
    memory_by_rows: dict[str, tuple[tuple[float, float, float], ...]] = field(default_factory=dict)
    source: str = "datasheet"
    points: tuple[MeasuredPoint, ...] = ()
    # The MTP draft acceptance rate this engine measured (``calibrate --mtp-model``): the planner's default.
    mtp_accept: float | None = None
    # Achieved fractions by shape from public kernel tables, per class ((rows, compute, memory, source), ...):
    # they take precedence over ``efficiency`` (a calibrated ``memory_by_rows`` over both, for memory).
    efficiency_curves: dict[str, tuple[CurvePoint, ...]] = field(default_factory=dict)
    kernel_floors: dict[str, KernelFloor] = field(default_factory=dict)  # by class; absent: kernel_latency_us
    # A GEMM of depth K reaches K / (K + gemm_depth_half) of its curve's compute fraction (0: no depth effect).
    gemm_depth_half: float = 0.0
    # Decode all-to-all by link and direction ("nvlink_dispatch", "ib_combine", ...): floor, intercept and
    # efficiency from published latency tables; absent: ``*_latency_us`` + bytes / (link x ``*_efficiency``).
    all_to_all_fits: dict[str, AllToAllFit] = field(default_factory=dict)
    # Where each other parameter comes from ("efficiency.gemm", "ib_latency_us", ...); a calibrated file's
    # points are its sources.
    sources: dict[str, str] = field(default_factory=dict)

    def kernel_class(self, base: str, weight_dtype: str) -> str:
        """The class that prices a ``base`` GEMM (``gemm``, ``group_gemm``) on ``weight_dtype`` weights: the
        four-bit kernels' own (``gemm_fp4``, ``group_gemm_fp4``) where this file has their measured curves, else
        ``base`` (a datasheet entry prices FP4 by its bytes at the bf16 kernels' fractions)."""
        fp4 = FP4_CLASSES.get(base)
        return fp4 if weight_dtype == "fp4" and fp4 in self.memory_by_rows else base

    def compute_dtype(self, dtype: str) -> str:
        """The tensor-core dtype that runs ``dtype`` data: itself if native, else the next wider one."""
        chain = {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16")}.get(dtype, (dtype,))
        return next((d for d in chain if d in self.peak_flops), "bf16")

    def flops_for(self, dtype: str) -> float:
        """Peak for ``dtype``, run at the next wider dtype if the hardware lacks it."""
        native = self.compute_dtype(dtype)
        if native not in self.peak_flops:
            raise PlanError(f"hardware {self.name!r} has no peak for {dtype}")
        return self.peak_flops[native]

    def eff(self, kernel_class: str) -> Efficiency:
        while kernel_class not in self.efficiency and kernel_class in CLASS_FALLBACK:
            kernel_class = CLASS_FALLBACK[kernel_class]
        return self.efficiency.get(kernel_class, self.efficiency.get("gemm", Efficiency(1.0, 1.0)))

    def compute_fraction(self, kernel_class: str, rows: float = 0.0, depth: float = 0.0) -> float:
        """Achievable share of the peak FLOP/s: the class's curve at ``rows`` when it has compute points,
        else its constant fraction; a GEMM class's times ``depth / (depth + gemm_depth_half)`` (its K)."""
        curve = self.efficiency_curves.get(kernel_class)
        fraction = curve_fraction(curve, rows, "compute") if curve and rows > 0 else 0.0
        fraction = fraction or self.eff(kernel_class).compute
        if self.gemm_depth_half > 0 and depth > 0 and kernel_class in STREAM_CLASSES:
            fraction *= depth / (depth + self.gemm_depth_half)
        return fraction

    def floor_us(self, kernel_class: str) -> float:
        """The floor of one kernel of ``kernel_class``: its published floor, else ``kernel_latency_us``."""
        floor = self.kernel_floors.get(kernel_class) or self.kernel_floors.get(CLASS_FALLBACK.get(kernel_class, ""))
        return floor.us if floor else self.kernel_latency_us

    def memory_fraction(self, kernel_class: str, rows: float = 0.0, matrix_bytes: float = 0.0) -> float:
        """Achievable share of the memory bandwidth for a kernel applying each weight (of
        ``matrix_bytes``) to ``rows`` rows: the class's curve when it has one, else its constant
        fraction. Between row counts the time per byte is linear in rows; between matrix sizes the
        fraction is interpolated in log size; flat outside the measured range (an unknown size
        takes the largest measured one). The weight-streaming classes (``STREAM_CLASSES``) are
        scaled by ``stream_efficiency``."""
        scale = self.stream_efficiency if kernel_class in STREAM_CLASSES else 1.0
        return scale * self._memory_fraction(kernel_class, rows, matrix_bytes)

    def _memory_fraction(self, kernel_class: str, rows: float, matrix_bytes: float) -> float:
        curve = self.memory_by_rows.get(kernel_class)
        if not curve or rows <= 0:
            points = self.efficiency_curves.get(kernel_class)
            fraction = curve_fraction(points, rows, "memory") if points and rows > 0 else 0.0
            return fraction or self.eff(kernel_class).memory
        sizes = sorted({size for _, size, _ in curve})

        def at(size: float) -> float:
            return interpolate_fraction(tuple((r, f) for r, s, f in curve if s == size), rows)

        if matrix_bytes <= 0 or matrix_bytes >= sizes[-1]:
            return at(sizes[-1])
        if matrix_bytes <= sizes[0]:
            return at(sizes[0])
        hi = next(i for i, size in enumerate(sizes) if size >= matrix_bytes)
        s0, s1 = sizes[hi - 1], sizes[hi]
        a = math.log(matrix_bytes / s0) / math.log(s1 / s0)
        return 1.0 / ((1 - a) / at(s0) + a / at(s1))

    # ---- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> HardwareSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise PlanError(f"hardware file has unknown fields: {', '.join(sorted(unknown))}")
        data = dict(raw)
        data["efficiency"] = {k: Efficiency(**v) for k, v in raw.get("efficiency", {}).items()}
        data["points"] = tuple(MeasuredPoint(**p) for p in raw.get("points", ()))
        data["peak_flops"] = {k: float(v) for k, v in raw["peak_flops"].items()}
        data["memory_by_rows"] = {k: tuple(tuple(float(x) for x in point) for point in v)
                                  for k, v in raw.get("memory_by_rows", {}).items()}
        data["efficiency_curves"] = {k: tuple(CurvePoint(**p) for p in v)
                                     for k, v in raw.get("efficiency_curves", {}).items()}
        data["kernel_floors"] = {k: KernelFloor(**v) for k, v in raw.get("kernel_floors", {}).items()}
        data["all_to_all_fits"] = {k: AllToAllFit(**{**v, "floors": tuple(tuple(f) for f in v["floors"])})
                                   for k, v in raw.get("all_to_all_fits", {}).items()}
        try:
            return cls(**data)
        except TypeError as e:
            raise PlanError(f"hardware file is incomplete: {e}") from None


def interpolate_fraction(curve: tuple[tuple[float, float], ...], rows: float) -> float:
    """A fraction at ``rows`` from ``(rows, fraction)`` points: the inverse (time per byte) is linear
    in rows between neighbours, which is exact for a kernel whose time grows linearly with its rows;
    flat beyond the first and last points."""
    points = sorted(curve)
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, f0), (r1, f1) in zip(points, points[1:]):
        if rows <= r1:
            a = (rows - r0) / (r1 - r0)
            return 1.0 / ((1 - a) / f0 + a / f1)
    return points[-1][1]


def save_hardware(spec: HardwareSpec, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec.to_dict(), indent=1) + "\n")
    return path
