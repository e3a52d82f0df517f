"""Kernel ops declared once (``kernels/opdef.py``): how a call chooses (traced -> the custom op or torch code,
eager -> the device's implementations in order, a declining one -> the next, then the reference), that the
table is filled once, that every declared op and implementation exists, and that no module of ``kernels/``
imports one that imports it back."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
import types
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from epserve.kernels import backends, opdef, ops
from epserve.kernels.device import trace_as_cuda
from epserve.kernels.opdef import OpDef

CPU = torch.device("cpu")
KERNELS = Path(__file__).resolve().parents[2] / "src" / "epserve" / "kernels"

CALLS: list[str] = []
toy = types.ModuleType("opdef_toy_impls")  # implementations named "module:function", as the kernels' are
sys.modules[toy.__name__] = toy


def _impl(tag: str, result: object = "tensor"):  # noqa: ANN202
    def run(x: torch.Tensor, k: int) -> object:
        CALLS.append(tag)
        return x * k if result == "tensor" else result

    return run


toy.declines = _impl("declines", None)
toy.refuses = _impl("refuses", False)
toy.kernel = _impl("kernel")
toy.inline = _impl("inline")


def _toy(name: str, **options: object) -> OpDef:
    def reference(x: torch.Tensor, k: int) -> torch.Tensor:
        CALLS.append("reference")
        return x * k

    return OpDef(reference, name=f"test_opdef_{name}", fake=lambda x, k: torch.empty_like(x), **options)


@pytest.fixture(autouse=True)
def _calls():
    CALLS.clear()
    yield


def test_eager_runs_the_first_implementation_that_takes_the_call_else_the_reference():
    op = _toy("eager")
    op.implement("cpu", "opdef_toy_impls:declines")
    op.implement("cpu", "opdef_toy_impls:refuses")
    op.implement("cpu", "opdef_toy_impls:kernel", takes=lambda x, k: k > 0)
    x = torch.ones(3)
    assert torch.equal(op(x, 2), x * 2) and CALLS == ["declines", "refuses", "kernel"]
    CALLS.clear()
    assert torch.equal(op(x, -1), -x) and CALLS == ["declines", "refuses", "reference"]  # the kernel does not take it
    CALLS.clear()
    out = op(torch.ones(2, device="meta"), 3)
    assert out.device.type == "meta" and CALLS == ["reference"]  # no meta implementations: the reference


def test_the_table_is_filled_once_per_device_and_dtype_and_sees_a_replaced_function():
    op = _toy("table")
    op.implement("cpu", "opdef_toy_impls:kernel")
    fills = []
    fill = op.fill
    op.fill = lambda where, dtype: fills.append((where, dtype)) or fill(where, dtype)
    x = torch.ones(2)
    for _ in range(3):
        op(x, 1)
        op(x.double(), 1)
    assert fills == [("cpu", torch.float32), ("cpu", torch.float64)]
    assert op.chosen("cpu", torch.float32) == ["opdef_toy_impls:kernel"]
    original, toy.kernel = toy.kernel, _impl("replaced", None)  # as a test that patches a C front end does
    try:
        CALLS.clear()
        op(x, 1)
        assert CALLS == ["replaced", "reference"]
    finally:
        toy.kernel = original


def test_a_trace_sees_the_custom_op_torch_code_or_the_reference():
    hidden = _toy("hidden")  # a C kernel only: passed over, the reference is traced
    hidden.implement("cpu", "opdef_toy_impls:kernel")
    launched = _toy("launched")  # Triton-like on CUDA: the custom op where it takes the call
    launched.implement("cuda", "opdef_toy_impls:inline", takes=lambda x, k: k > 1, traced="inline")
    launched.implement("cuda", "opdef_toy_impls:kernel", traced="op")
    opaque = _toy("opaque", opaque=True)
    with FakeTensorMode():
        x = torch.empty(4)
        assert hidden(x, 2).shape == (4,) and CALLS == ["reference"]
        CALLS.clear()
        assert opaque(x, 2).shape == (4,) and CALLS == []  # the fake ran, nothing else
    with trace_as_cuda(), FakeTensorMode():
        x = torch.empty(4, device="meta")
        assert launched(x, 1).shape == (4,) and CALLS == []  # the custom op's fake
        assert launched(x, 2).shape == (4,) and CALLS == ["inline"]  # torch code, traced into


def test_the_custom_op_runs_the_eager_choice():
    op = _toy("custom")
    op.implement("cpu", "opdef_toy_impls:declines")
    op.implement("cpu", "opdef_toy_impls:kernel")
    assert str(op.custom) == "<CustomOpDef(epserve::test_opdef_custom)>"
    x = torch.ones(2)
    assert torch.equal(torch.ops.epserve.test_opdef_custom(x, 3), x * 3) and CALLS == ["declines", "kernel"]


def test_resolve_fills_every_declared_op_for_the_device():
    assert backends.resolve("cpu", {"mla_decode": torch.bfloat16}) == "torch reference (cpu)"
    assert all(("cpu", torch.bfloat16) in op._table for op in ops.defined().values())
    assert "epserve.kernels.cpu_ops:rms_norm" in ops.rms_norm.chosen("cpu", torch.bfloat16)


SELF_TESTS: list[torch.dtype] = []
FORCED = ["auto"]


def _fast_self_test(device: torch.device, dtype: torch.dtype) -> None:
    SELF_TESTS.append(dtype)
    if dtype != torch.float32:
        raise backends.KernelMismatch(f"off the reference for {dtype}")


@pytest.fixture
def gated():  # noqa: ANN201
    """A toy op with two CPU implementations: ``fast``, the ``test_gate`` backend of that name (its self-test
    passes for fp32 only), then ``kernel``, the backend's fallback."""
    SELF_TESTS.clear()
    FORCED[0] = "auto"
    backends.register(backends.KernelOp("test_gate", (backends.KernelBackend("fast", _fast_self_test),
                                                      backends.KernelBackend("kernel")), forced=lambda: FORCED[0]))
    op = _toy("gated")
    op.implement("cpu", "opdef_toy_impls:fast", backend=("test_gate", "fast"))
    op.implement("cpu", "opdef_toy_impls:kernel")
    yield op
    backends.unregister("test_gate")
    opdef._DEFS.pop(op.name)  # declared for the test only


toy.fast = _impl("fast")


def test_a_backends_implementation_is_listed_for_the_dtypes_it_was_chosen_for(gated):
    x32, x64 = torch.ones(3), torch.ones(3, dtype=torch.float64)
    assert torch.equal(gated(x32, 2), x32 * 2) and torch.equal(gated(x64, 2), x64 * 2)
    assert CALLS == ["fast", "kernel"] and SELF_TESTS == [torch.float32, torch.float64]
    assert gated.chosen("cpu", torch.float32) == ["opdef_toy_impls:fast", "opdef_toy_impls:kernel"]
    assert gated.chosen("cpu", torch.float64) == ["opdef_toy_impls:kernel"]
    assert backends.decisions()["test_gate[cpu, float32]"] == "fast"
    CALLS.clear()
    gated(x32, 1), gated(x64, 1)
    assert CALLS == ["fast", "kernel"] and len(SELF_TESTS) == 2  # decided once per dtype
    # a failure the self-test did not cover hands the dtype to the fallback: the op's table follows
    backends.fall_back("test_gate", CPU, torch.float32, "M=7: illegal memory access")
    CALLS.clear()
    gated(x32, 1)
    assert CALLS == ["kernel"] and gated.chosen("cpu", torch.float32) == ["opdef_toy_impls:kernel"]


def test_a_forced_backend_is_listed_without_its_self_test(gated):
    FORCED[0] = "fast"
    gated(torch.ones(2, dtype=torch.float64), 1)
    assert CALLS == ["fast"] and SELF_TESTS == []
    FORCED[0] = "kernel"  # read when a key is filled: forgetting the decisions refills
    backends.forget("test_gate")
    CALLS.clear()
    gated(torch.ones(2), 1)
    assert CALLS == ["kernel"] and SELF_TESTS == []


def test_a_call_inside_a_capture_reaches_what_an_eager_call_reaches(gated, monkeypatch):
    """Capture changes no choice: an op undecided inside a capture raises (nothing is self-tested, nothing
    decided there) instead of running the fallback; once decided, a table filled inside a capture lists what an
    eager call's lists."""
    monkeypatch.setattr(backends, "_capturing", lambda device: True)
    x = torch.ones(2)
    with pytest.raises(backends.KernelUndecided, match=r"test_gate on cpu, float32 was first reached inside a CUDA "
                                                        r"graph capture"):
        gated(x, 1)
    assert CALLS == [] and SELF_TESTS == [] and ("cpu", torch.float32) not in gated._table
    assert "test_gate[cpu, float32]" not in backends.decisions()
    with pytest.raises(backends.KernelUndecided, match="fast's self-test on cpu, float32 was asked inside a CUDA"):
        backends.passes("test_gate", "fast", CPU, torch.float32)
    monkeypatch.setattr(backends, "_capturing", lambda device: False)
    gated(x, 1)  # an eager call decides
    assert CALLS == ["fast"] and SELF_TESTS == [torch.float32] and ("cpu", torch.float32) in gated._table
    monkeypatch.setattr(backends, "_capturing", lambda device: True)
    gated.forget()  # the table filled again inside a capture
    CALLS.clear()
    gated(x, 1)
    assert CALLS == ["fast"] and SELF_TESTS == [torch.float32]
    assert backends.passes("test_gate", "fast", CPU, torch.float32)


def test_record_calls_names_the_implementation_each_call_ran(gated):
    x32, x64 = torch.ones(2), torch.ones(2, dtype=torch.float64)
    with opdef.record_calls() as calls:
        gated(x32, 1), gated(x64, 1)
        with opdef.record_calls() as inner:
            _toy("recorded")(x32, 1)  # no implementation: the reference
    assert calls == [(gated.name, "opdef_toy_impls:fast"), (gated.name, "opdef_toy_impls:kernel")]
    assert inner == [("test_opdef_recorded", opdef.REFERENCE)]
    gated(x32, 1)
    assert len(calls) == 2  # outside the block nothing is recorded
    opdef._DEFS.pop("test_opdef_recorded")


def test_without_backends_runs_what_runs_where_no_backend_was_chosen(gated):
    x = torch.ones(2)
    assert torch.equal(gated.without_backends(x, 3), x * 3) and CALLS == ["kernel"] and SELF_TESTS == []
    CALLS.clear()
    gated(x, 3)
    assert CALLS == ["fast"]  # the op itself: the backend chosen for fp32


def test_resolve_fills_a_gated_op_for_its_backends_dtype_only(gated):
    backends.resolve("cpu", {"test_gate": torch.float64, "mla_decode": torch.bfloat16})
    assert [key for key in gated._table] == [("cpu", torch.float64)] and SELF_TESTS == [torch.float64]


def _top_level_functions(module: str) -> set[str]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    tree = ast.parse(Path(spec.origin).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


@pytest.mark.parametrize("name", sorted(ops.defined()))
def test_every_op_is_declared_with_a_schema_and_existing_implementations(name):
    """Each op's reference has the op's full signature (annotated: the custom op's schema comes from it) and
    every implementation names a function that exists (read from the source: Triton modules not imported)."""
    op = ops.defined()[name]
    signature = inspect.signature(op.reference)
    assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values()), name
    assert op.custom is None or str(op.custom) == f"<CustomOpDef(epserve::{name})>"
    for impls in op.impls.values():
        for impl in impls:
            module, _, fn = impl.target.partition(":")
            assert fn in _top_level_functions(module), impl.target


def test_each_backends_implementation_names_a_tested_backend_followed_by_its_fallback():
    """An implementation gated by ``kernels.backends`` names a backend with a self-test, and an ungated
    implementation follows it on its device (what runs where the backend was not chosen)."""
    gated = [(op, impls, i) for op in ops.defined().values() for impls in op.impls.values()
             for i, impl in enumerate(impls) if impl.backend is not None]
    assert {impls[i].backend for _, impls, i in gated} >= {("mla_decode", "flashinfer"), ("fp8_gemm", "scaled_mm")}
    for op, impls, i in gated:
        kernel_op, name = impls[i].backend
        assert backends.get_op(kernel_op).backend(name).self_test is not None, op.name
        assert any(impl.backend is None for impl in impls[i + 1 :]), op.name


def test_the_model_calls_each_op_by_one_name():
    assert ops.mla_decode is ops.paged_mla_decode and ops.rms_norm.name == "rms_norm"
    assert {op.name for op in (ops.act_quant, ops.block_fp8_gemm)} == {"fp8_act_quant", "fp8_block_gemm"}


def _imports(path: Path) -> set[str]:
    """Every ``epserve.kernels`` module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "epserve.kernels":
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("epserve.kernels."):
            found.add(node.module.split(".")[2])
    return found


def test_no_module_of_kernels_imports_one_that_imports_it_back():
    graph = {p.stem: _imports(p) & {q.stem for q in KERNELS.glob("*.py")} - {p.stem} for p in KERNELS.glob("*.py")}
    graph.pop("__init__")
    for g in graph.values():
        g.discard("__init__")

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, circles
