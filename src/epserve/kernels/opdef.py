"""A kernel op declared once: its signature and torch reference (one function), its argument checks, its fake
implementation, and its implementations per device, chosen in one place.

:func:`declare` turns the reference into an :class:`OpDef`; the op's definition module (``kernels.fused``,
``kernels.gate``, ``kernels.mla_decode``, ``kernels.fp8``, ``kernels.grouped``, ``kernels.moe_ops``) then lists
the implementations with :meth:`OpDef.implement`: the C kernels on the CPU, Triton, FlashInfer or
``torch._scaled_mm`` on CUDA, each named ``"module:function"`` and imported only when its device first needs it
(so the definition module never imports its Triton half, which imports the checks from it, and the CPU engine
never loads triton). Calling the op is the only place that decides:

- traced (:func:`~epserve.kernels.device.tracing`): the first implementation that takes the call decides how
  a trace sees it: an ``"op"`` implementation (a Triton launch, a host read) as the custom op
  ``torch.ops.epserve.<name>`` with the fake implementation, an ``"inline"`` one (torch code) traced into; C
  kernels (``"skip"``) are passed over; the reference otherwise. ``opaque=True`` ops are always the custom op;
- eager: the device's implementations in order (the table, filled once per device type at start-up, after
  ``kernels.backends`` ran its self-tests, or on the device's first call), the first that takes the call runs;
  an implementation may also decline by returning None (or False), as the C front ends do for what they do not
  take; then the reference runs. The custom op's own body is this eager choice.

An implementation's ``takes`` reads shapes and dtypes only (never a value), so it answers in a trace as well.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
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

_DEFS: dict[str, OpDef] = {}


@dataclass(frozen=True)
class OpImpl:
    """One implementation of an op on one device type: ``target`` ``"module:function"`` with the op's
    signature; ``takes`` (shapes and dtypes only) says which calls it runs, else it may decline by returning
    None or False (a C front end does where its library is missing); ``traced`` says how a trace sees it (see
    the module docstring)."""

    device: str
    target: str
    takes: Callable[..., bool] | None = None
    traced: Traced = "skip"

    def function(self) -> Callable[..., Any]:
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)


def _first_tensor(*args: Any, **kwargs: Any) -> str:
    return device_type(args[0])


class OpDef:
    """A kernel op: call it as the function it declares (see the module docstring for how a call is run)."""

    def __init__(self, reference: Callable[..., Any], *, name: str, fake: Callable[..., Any] | None = None,
                 check: Callable[..., None] | None = None, mutates_args: tuple[str, ...] = (),
                 opaque: bool = False, device_of: Callable[..., str] = _first_tensor,
                 custom_body: Callable[..., Any] | None = None) -> None:
        self.name = name
        self.reference = reference
        self.check = check
        self.opaque = opaque
        self.device_of = device_of
        self.returns_none = inspect.signature(reference).return_annotation in (None, "None")
        self.__doc__ = reference.__doc__
        self.__name__ = self.__qualname__ = reference.__name__
        self.__module__ = reference.__module__
        self.impls: dict[str, list[OpImpl]] = {}
        self._table: dict[str, tuple[_Row, ...]] = {}
        self.custom = None
        if fake is not None:
            schema = torch.library.infer_schema(reference, mutates_args=mutates_args)
            body = custom_body or self.eager
            self.custom = torch.library.custom_op(f"epserve::{name}", body, mutates_args=mutates_args, schema=schema)
            self.custom.register_fake(fake)
        _DEFS[name] = self

    def implement(self, device: str, target: str, *, takes: Callable[..., bool] | None = None,
                  traced: Traced = "skip") -> None:
        """Add an implementation for ``device`` after those already listed (earlier ones are tried first)."""
        self.impls.setdefault(device, []).append(OpImpl(device, target, takes, traced))
        self._table.pop(device, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():
            return self.traced(*args, **kwargs)
        return self.eager(*args, **kwargs)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The call run eagerly: the device's first implementation that takes it, else the reference."""
        if self.check is not None:
            self.check(*args, **kwargs)
        where = self.device_of(*args, **kwargs)
        rows = self._table.get(where)
        if rows is None:
            rows = self.fill(where)
        for takes, module, fn, may_decline in rows:
            if takes is not None and not takes(*args, **kwargs):
                continue
            out = getattr(module, fn)(*args, **kwargs)
            if may_decline and (out is None or out is False):
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

    def fill(self, where: str) -> tuple[_Row, ...]:
        """Decide (once) the implementations that run on device type ``where``, in order."""
        rows = []
        for impl in self.impls.get(where, ()):
            module, _, fn = impl.target.partition(":")
            rows.append((impl.takes, importlib.import_module(module), fn, impl.takes is None))
        self._table[where] = table = tuple(rows)
        return table

    def chosen(self, where: str) -> list[str]:
        """The targets that run on device type ``where``, in the order they are tried (then the reference)."""
        rows = self._table.get(where) or self.fill(where)
        return [f"{module.__name__}:{fn}" for _, module, fn, _ in rows]


def declare(name: str, **options: Any) -> Callable[[Callable[..., Any]], OpDef]:
    """``@declare("rms_norm", fake=...)`` over the op's reference: the op (see :class:`OpDef`)."""
    return lambda reference: OpDef(reference, name=name, **options)


def defined() -> dict[str, OpDef]:
    """Every op declared so far (the definition modules declare theirs when imported), by name."""
    return dict(_DEFS)


def prepare(device: torch.device | str) -> None:
    """Fill every declared op's table for ``device``'s type (imports its implementation modules)."""
    where = "cuda" if torch.device(device).type == "cuda" else torch.device(device).type
    for op in list(_DEFS.values()):
        op.fill(where)


backends.after_resolve(prepare)
