"""The C kernels' signatures, one table per library: each exported function's name, its arguments' kinds in
order and its return's kind. Everything else about a call across the C boundary is derived from the table
once, when ``kernels.cpu`` loads a library: the ctypes ``argtypes``/``restype`` of each function
(:func:`bind`), its packed twin (the function called with its arguments as one int64 array: pointers as
addresses, floats as their bits), generated as C and built into the library with the kernels
(:func:`twins_source`), and the packing of a call's arguments for that twin while a decode step is recorded
(:meth:`Twin.pack`, ``kernels/cpu_graph.py``). ``tests/kernels/test_kernels.py`` reads the C sources'
definitions and checks each table against them.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

PTR, I64, INT, F32 = "ptr", "i64", "int", "f32"  # an argument's kind: any pointer, int64_t, int, float
THREADS = "threads"  # in fn()'s string: an int, the OpenMP threads the kernel runs on (a replay may change it)
_CTYPES = {PTR: ctypes.c_void_p, I64: ctypes.c_int64, INT: ctypes.c_int, F32: ctypes.c_float}
_C_TYPES = {PTR: "void *", I64: "int64_t", INT: "int", F32: "float", None: "void"}
_UNPACKED = {PTR: "(void *)(intptr_t)a[{i}]", I64: "a[{i}]", INT: "(int)a[{i}]", F32: "packed_float(a[{i}])"}


@dataclass(frozen=True)
class Signature:
    """One exported C function: its arguments' kinds in order, its return's (None: void; a packed twin returns
    0 for void), whether it has a packed twin (whether a recorded step may call it), and which argument (an
    int) is its thread count, if one is (``kernels/cpu_threads.py`` sets it, in recorded calls too)."""

    name: str
    args: tuple[str, ...]
    returns: str | None = None
    recorded: bool = True
    threads: int | None = None

    def __post_init__(self) -> None:
        if any(k not in _CTYPES for k in self.args) or self.returns not in (None, INT, I64):
            raise ValueError(f"{self.name}: kinds are {tuple(_CTYPES)}, returns one of None, {INT!r}, {I64!r}")
        if self.recorded and self.returns == I64:
            raise ValueError(f"{self.name}: a packed twin returns an int code")
        if self.threads is not None and self.args[self.threads] != INT:
            raise ValueError(f"{self.name}: the thread count is an {INT!r} argument")


def fn(name: str, args: str, returns: str | None = None, recorded: bool = True) -> Signature:
    """A signature with its arguments' kinds written as one space-separated string, the thread count's as
    ``threads`` (an int)."""
    kinds = args.split()
    threads = kinds.index(THREADS) if THREADS in kinds else None
    return Signature(name, tuple(INT if k == THREADS else k for k in kinds), returns, recorded, threads)


OPS_TABLE: tuple[Signature, ...] = (  # cpu_ops.c, cpu_ops_mla.c, cpu_ops_heads.c, cpu_ops_moe.c, cpu_threads.c
    fn("epserve_mla_decode", "ptr i64 i64 i64 ptr int i64 i64 ptr i64 ptr f32 i64 ptr threads", INT),
    fn("epserve_head_matmul", "ptr int i64 i64 i64 i64 i64 ptr i64 ptr i64 i64 int threads"),
    fn("epserve_rope_heads", "ptr i64 i64 i64 ptr ptr i64 int int"),
    fn("epserve_append_latent", "ptr i64 i64 i64 i64 ptr f32 ptr ptr int int ptr ptr i64 int", INT),
    fn("epserve_grouped_topk", "ptr i64 i64 i64 i64 i64 int int int int f32 ptr ptr i64 ptr ptr"),
    fn("epserve_group_by_expert", "ptr i64 i64 ptr ptr", INT),
    fn("epserve_weighted_combine", "ptr i64 i64 ptr ptr i64 int ptr", INT),
    fn("epserve_local_dispatch", "ptr i64 i64 i64 ptr i64 ptr i64 ptr ptr ptr ptr", INT),
    fn("epserve_index_add_i64", "ptr i64 ptr ptr i64", INT),
    fn("epserve_rms_norm", "ptr ptr i64 i64 i64 f32 int ptr"),
    fn("epserve_gather_rows", "ptr i64 ptr i64 i64 int ptr int", INT),
    fn("epserve_copy_cast", "ptr int i64 i64 i64 i64 i64 ptr int i64 i64"),
    fn("epserve_add", "ptr ptr i64 int ptr"),
    fn("epserve_silu_mul", "ptr i64 i64 i64 int ptr"),
    fn("epserve_replay", "ptr ptr i64 ptr ptr", I64, recorded=False),
    fn("epserve_brief_waits", "int", INT, recorded=False),  # cpu_threads.c
)


def experts_table(suffix: str) -> tuple[Signature, ...]:
    """The GEMM library of one element type (``cpu_bf16.c``: "bf16", ``cpu_f32.c``: "f32"). The experts on
    host counts are never recorded (their offsets come from the host)."""
    return (
        fn(f"epserve_linear_{suffix}", "ptr i64 ptr i64 i64 ptr threads"),
        fn(f"epserve_moe_swiglu_{suffix}", "ptr ptr i64 ptr ptr i64 i64 ptr threads", recorded=False),
        fn(f"epserve_moe_swiglu_counts_{suffix}", "ptr i64 ptr i64 ptr ptr i64 i64 ptr threads", INT),
    )


NVFP4_TABLE: tuple[Signature, ...] = (  # cpu_nvfp4.c; the dequantize serves prefill's GEMMs, never recorded
    fn("epserve_nvfp4_linear", "ptr int i64 ptr ptr ptr i64 i64 i64 ptr threads"),
    fn("epserve_nvfp4_dequantize", "ptr ptr ptr i64 i64 i64 i64 i64 ptr threads", recorded=False),
    fn("epserve_nvfp4_moe_swiglu", "ptr int i64 ptr i64 ptr ptr ptr i64 ptr ptr ptr i64 i64 i64 ptr threads", INT),
)


def twins_source(table: tuple[Signature, ...]) -> str:
    """C source of the packed twins of ``table``'s recorded functions (``<name>_packed``), each calling its
    function through a prototype written from the table."""
    out = ["/* Packed twins, generated by kernels/cpu_abi.py from its signature table. */",
           "#include <stdint.h>", "#include <string.h>", "",
           "static inline float packed_float(int64_t v) {", "  const uint32_t bits = (uint32_t)v;", "  float f;",
           "  memcpy(&f, &bits, 4);", "  return f;", "}"]
    for sig in table:
        if not sig.recorded:
            continue
        params = ", ".join(_C_TYPES[k] for k in sig.args) or "void"
        call = f"{sig.name}({', '.join(_UNPACKED[k].format(i=i) for i, k in enumerate(sig.args))})"
        body = f"  return {call};" if sig.returns == INT else f"  {call};\n  return 0;"
        out += ["", f"{_C_TYPES[sig.returns]} {sig.name}({params});",
                f"int {sig.name}_packed(const int64_t *a) {{", body, "}"]
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Twin:
    """A loaded function's packed twin: ``fn`` (ctypes, one pointer argument), its address (what a replay
    calls), and how many arguments it packs, which of them floats, which its thread count (or None)."""

    name: str
    fn: ctypes._CFuncPtr
    address: int
    count: int
    floats: tuple[int, ...]
    threads: int | None = None

    def pack(self, values: tuple) -> ctypes.Array:
        """A call's arguments as the twin takes them: pointers as addresses (None as 0), floats as their bits."""
        if len(values) != self.count:
            raise TypeError(f"{self.name} takes {self.count} arguments, given {len(values)}")
        packed = [struct.unpack("<I", struct.pack("<f", v))[0] if i in self.floats else 0 if v is None else int(v)
                  for i, v in enumerate(values)]
        return (ctypes.c_int64 * max(self.count, 1))(*packed)


def bind(lib: ctypes.CDLL, table: tuple[Signature, ...]) -> dict[str, Twin]:
    """Sets each function's ctypes signature on ``lib`` from ``table``; returns the recorded ones' twins."""
    twins = {}
    for sig in table:
        f = getattr(lib, sig.name)
        f.argtypes = [_CTYPES[k] for k in sig.args]
        f.restype = None if sig.returns is None else _CTYPES[sig.returns]
        if sig.recorded:
            twin = getattr(lib, f"{sig.name}_packed")
            twin.argtypes, twin.restype = [ctypes.c_void_p], ctypes.c_int
            floats = tuple(i for i, k in enumerate(sig.args) if k == F32)
            twins[sig.name] = Twin(sig.name, twin, ctypes.cast(twin, ctypes.c_void_p).value or 0, len(sig.args), floats,
                                   sig.threads)
    return twins
