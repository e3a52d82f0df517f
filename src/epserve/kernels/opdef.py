"""A kernel op declared once: its signature and torch reference (one function), its argument checks, its fake
implementation, and its implementations per device and dtype, chosen in one place.

:func:`declare` turns the reference into an :class:`OpDef`; the op's definition module (``kernels.fused``,
``kernels.gate``, ``kernels.mla_decode``, ``kernels.fp8``, ``kernels.grouped``, ``kernels.moe_ops``,
``kernels.dense``) then lists the implementations with :meth:`OpDef.implement`: the C kernels on the CPU,
Triton, FlashInfer or ``torch._scaled_mm`` on CUDA, each named ``"module:function"`` and imported only when its
device first needs it (so the definition module never imports its Triton half, which imports the checks from
it, and the CPU engine never loads triton). Calling the op is the only place that decides:

- traced (:func:`~epserve.kernels.device.tracing`): the first implementation that takes the call decides how
  a trace sees it: an ``"op"`` implementation (a Triton launch, a host read) as the custom op
  ``torch.ops.epserve.<name>`` with the fake implementation, an ``"inline"`` one (torch code) traced into; C
  kernels (``"skip"``) are passed over; the reference otherwise. ``opaque=True`` ops are always the custom op;
- eager: the implementations listed for the call's (device type, dtype) in order, the first that takes the
  call runs; an implementation may also decline by returning None (or False), as the C front ends do for what
  they do not take; then the reference runs. The custom op's own body is this eager choice.

The eager table is keyed by the device type and the dtype of one argument (``dtype_of``: a tensor's dtype, or
a dtype argument itself; default the first argument's), and filled once per key: at start-up for the engine's
dtypes, after ``kernels.backends`` ran its self-tests (:func:`prepare`, run by ``backends.resolve``), else on
the key's first call. An implementation that is a ``kernels.backends`` backend (``backend=("mla_decode",
"flashinfer")``) is listed only where ``backends`` chose it for that device and dtype (its self-test passed,
or its ``EPSERVE_*`` variable forces it, read when the key is filled); the backend's fallback is the next
implementation listed. A decision that changes (``backends.fall_back``, ``forget``) drops the tables of the ops
it gates.

Capture changes nothing: a call inside a CUDA graph capture reaches the implementation an eager call with the
same tensors reaches (a key first filled there asks ``backends``, which raises for an op it has not decided
rather than answer otherwise), so the warm-up run before a capture compiles and loads exactly the kernels the
capture records. :func:`record_calls` lists which implementation each call ran (``tests/kernels/
test_capture_path.py`` compares a warm-up with a capture).

An implementation's ``takes`` reads shapes and dtypes only (never a value), so it answers in a trace as well.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from epserve.kernels import backends
from epserve.kernels.device import device_type, tracing

Traced = Literal["op", "inline", "skip"]
# (takes or None, module, function name, may decline): the eager table's row; the function is looked up on the
# module at each call (one attribute read), so a test that replaces it sees its replacement
_Row = tuple[Callable[..., bool] | None, ModuleType, str, bool]
Key = tuple[str, torch.dtype | None]  # (device type, dtype)

_DEFS: dict[str, OpDef] = {}
_records: list[list[tuple[str, str]]] = []  # record_calls' lists, innermost last (empty: nothing recorded)
REFERENCE = "reference"  # what record_calls names a call the reference ran


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op on one device type: ``target`` ``"module:function"`` with the op's
    signature; ``takes`` (shapes and dtypes only) says which calls it runs, else it may decline by returning
    None or False (a C front end does where its library is missing); ``traced`` says how a trace sees it (see
    the module docstring); ``backend`` ``(op, name)``: the ``kernels.backends`` backend it is, listed only
    where that backend was chosen."""

    device: str
    target: str
    takes: Callable[..., bool] | None = None
    traced: Traced = "skip"
    backend: tuple[str, str] | None = None

    def function(self) -> Callable[..., Any]:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


def _first_tensor(*args: Any, **kwargs: Any) -> str:
    return device_type(args[0])


def _first_tensor_key(*args: Any, **kwargs: Any) -> Key:
    return device_type(args[0]), args[0].dtype


class OpDef:
    """A kernel op: call it as the function it declares (see the module docstring for how a call is run)."""

    def __init__(self, reference: Callable[..., Any], *, name: str, fake: Callable[..., Any] | None = None,
                 check: Callable[..., None] | None = None, mutates_args: tuple[str, ...] = (),
                 opaque: bool = False, device_of: Callable[..., str] = _first_tensor, dtype_of: str | None = None,
                 custom_body: Callable[..., Any] | None = None) -> None:
        self.name = name
        self.reference = reference
        self.check = check
        self.opaque = opaque
        self.device_of = device_of
        signature = inspect.signature(reference)
        params = list(signature.parameters)
        self.dtype_of = dtype_of or params[0]
        self._dtype_at = params.index(self.dtype_of)  # where a positional call has it
        if self._dtype_at == 0 and device_of is _first_tensor:
            self.key = _first_tensor_key  # the common case, kept cheap: asked on every call
        self.returns_none = signature.return_annotation in (None, "None")
        self.__doc__ = reference.__doc__
        self.__name__ = self.__qualname__ = reference.__name__
        self.__module__ = reference.__module__
        self.impls: dict[str, list[OpImpl]] = {}
        self._table: dict[Key, tuple[_Row, ...]] = {}
        self.custom = None
        if fake is not None:
            schema = torch.library.infer_schema(reference, mutates_args=mutates_args)
            body = custom_body or self.eager
            self.custom = torch.library.custom_op(f"epserve::{name}", body, mutates_args=mutates_args, schema=schema)
            self.custom.register_fake(fake)
        _DEFS[name] = self

    def implement(self, device: str, target: str, *, takes: Callable[..., bool] | None = None,
                  traced: Traced = "skip", backend: tuple[str, str] | None = None) -> None:
        """Add an implementation for ``device`` after those already listed (earlier ones are tried first)."""
        self.impls.setdefault(device, []).append(OpImpl(device, target, takes, traced, backend))
        self._table = {key: rows for key, rows in self._table.items() if key[0] != device}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            return self.traced(*args, **kwargs)
        return self.eager(*args, **kwargs)

    def key(self, *args: Any, **kwargs: Any) -> Key:
        """The call's (device type, dtype): which row of the table runs it."""
        arg = args[self._dtype_at] if len(args) > self._dtype_at else kwargs.get(self.dtype_of)
        return self.device_of(*args, **kwargs), arg if arg is None or isinstance(arg, torch.dtype) else arg.dtype

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The call run eagerly: the first implementation listed for its key that takes it, else the reference."""
        if self.check is not None:
            self.check(*args, **kwargs)
        key = self.key(*args, **kwargs)
        rows = self._table.get(key)
        if rows is None:
            rows = self.fill(*key)
        for takes, module, fn, may_decline in rows:
            if takes is not None and not takes(*args, **kwargs):
                continue
            out = getattr(module, fn)(*args, **kwargs)
            if may_decline and (out is None or out is False):
                continue
            if _records:
                _records[-1].append((self.name, f"{module.__name__}:{fn}"))
            return None if self.returns_none else out
        if _records:
            _records[-1].append((self.name, REFERENCE))
        return self.reference(*args, **kwargs)

    def without_backends(self, *args: Any, **kwargs: Any) -> Any:
        """The call run eagerly by the implementations no ``kernels.backends`` choice gates (what runs where no
        gated backend was chosen: the fallback a backend's timed self-test is compared with), else the
        reference. Not a hot path: looked up on every call."""
        for impl in self.impls.get(self.device_of(*args, **kwargs), ()):
            if impl.backend is not None or (impl.takes is not None and not impl.takes(*args, **kwargs)):
                continue
            out = impl.function()(*args, **kwargs)
            if impl.takes is None and (out is None or out is False):
                continue
            return None if self.returns_none else out
        return self.reference(*args, **kwargs)

    def traced(self, *args: Any, **kwargs: Any) -> Any:
        """The call as a trace sees it: the custom op, an implementation in torch, or the reference."""
        if self.opaque:
            return self.custom(*args, **kwargs)
        if self.check is not None:
            self.check(*args, **kwargs)
        for impl in self.impls.get(self.device_of(*args, **kwargs), ()):
            if impl.traced == "skip" or (impl.takes is not None and not impl.takes(*args, **kwargs)):
                continue
            return self.custom(*args, **kwargs) if impl.traced == "op" else impl.function()(*args, **kwargs)
        return self.reference(*args, **kwargs)

    def fill(self, where: str, dtype: torch.dtype | None = None) -> tuple[_Row, ...]:
        """Decide (once) the implementations that run on device type ``where`` for ``dtype``, in order."""
        rows = []
        for impl in self.impls.get(where, ()):
            if impl.backend is not None and _chosen_backend(impl.backend[0], where, dtype) != impl.backend[1]:
                continue
            module, _, fn = impl.target.partition(":")
            rows.append((impl.takes, importlib.import_module(module), fn, impl.takes is None))
        table = self._table[(where, dtype)] = tuple(rows)
        return table

    def chosen(self, where: str, dtype: torch.dtype | None = None) -> list[str]:
        """The targets that run on device type ``where`` for ``dtype``, in the order they are tried (then the
        reference)."""
        rows = self._table.get((where, dtype)) or self.fill(where, dtype)
        return [f"{module.__name__}:{fn}" for _, module, fn, _ in rows]

    def gated_by(self, where: str | None = None) -> set[str]:
        """The ``kernels.backends`` ops whose choices list this op's implementations (on device type ``where``;
        None: on any)."""
        return {impl.backend[0] for device, impls in self.impls.items() for impl in impls
                if impl.backend is not None and where in (None, device)}

    def forget(self) -> None:
        """Drop the table: each key is filled again on its next call."""
        self._table = {}


def _chosen_backend(op: str, where: str, dtype: torch.dtype | None) -> str:
    """The backend ``backends`` chose for ``op`` on device type ``where`` and ``dtype`` (it raises inside a CUDA
    graph capture before deciding); the fallback for CUDA on a machine without it (a trace's stand-in)."""
    if where == "cuda" and not torch.cuda.is_available():
        return backends.get_op(op).fallback
    return backends.decide(op, torch.device(where), dtype)


def declare(name: str, **options: Any) -> Callable[[Callable[..., Any]], OpDef]:
    """``@declare("rms_norm", fake=...)`` over the op's reference: the op (see :class:`OpDef`)."""
    return lambda reference: OpDef(reference, name=name, **options)


@contextmanager
def record_calls() -> Iterator[list[tuple[str, str]]]:
    """A list of ``(op name, implementation)`` for every eager op call made inside the block, in the order the
    calls returned (an op an implementation calls comes before it): the implementation ``"module:function"``
    that ran it, or ``"reference"``. The calls a warm-up reaches can so be compared with a capture's."""
    calls: list[tuple[str, str]] = []
    _records.append(calls)
    try:
        yield calls
    finally:
        _records.pop()  # the blocks nest: this one's list is the innermost


def defined() -> dict[str, OpDef]:
    """Every op declared so far (the definition modules declare theirs when imported), by name."""
    return dict(_DEFS)


def prepare(device: torch.device | str, dtypes: dict[str, torch.dtype | None]) -> None:
    """Fill every declared op's table for ``device``'s type (imports its implementation modules) and each dtype
    of ``dtypes`` (``backends.resolve``'s: op -> the dtype its calls use); an op gated there by a ``backends`` op
    only for that op's dtype (none when it is not called)."""
    where = torch.device(device).type
    every = list(dict.fromkeys(d for d in dtypes.values() if d is not None))
    for op in list(_DEFS.values()):
        gates = op.gated_by(where)
        for dtype in [dtypes.get(g) for g in gates if dtypes.get(g) is not None] if gates else every:
            op.fill(where, dtype)


def _decisions_changed(op: str | None) -> None:
    for opdef in list(_DEFS.values()):
        if op is None and opdef.gated_by() or op in opdef.gated_by():
            opdef.forget()


backends.after_resolve(prepare)
backends.on_change(_decisions_changed)
