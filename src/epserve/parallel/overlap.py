"""Run decoder layers with one micro-batch, or two interleaved (BRIEF.md, "Overlap").

A layer's forward is a generator that yields at the end of every stage of the micro-batch schedule
(``stages.moe_layer_schedule("microbatch")``) and returns its output. With one micro-batch the
generator is simply drained. With two, micro-batch A runs ``offset`` stages ahead, then A and B
alternate one stage each, so the transfer one half started (dispatch or combine send) is in flight
while the other half computes.

:func:`straight` derives, from such a generator function, the plain function that runs it start to
finish without pausing (the same source, stage ends dropped). One micro-batch runs that: no generator
plumbing per op, and a forward ``torch.compile(fullgraph=True)`` can trace (its generator support loses
the values ``yield from`` returns on this Python).
"""

from __future__ import annotations
import __future__

import ast
import inspect
import textwrap
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from epserve.config import OVERLAP_CHOICES, OVERLAP_MODES, OverlapMode, OverlapSetting

A = TypeVar("A")
B = TypeVar("B")
Stages = Generator[None, None, A]  # a forward that yields at its stage ends and returns its output


def run_in_order(stages: Stages[A]) -> A:
    """Drain ``stages``; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def run_interleaved(first: Stages[A], second: Stages[B], offset: int) -> tuple[A, B]:
    """Two micro-batches' forwards, ``first`` leading by ``offset`` stages, then alternating."""
    results: dict[int, object] = {}
    active = {0: first, 1: second}

    def advance(i: int) -> None:
        try:
            next(active[i])
        except StopIteration as done:
            results[i] = done.value
            del active[i]

    for _ in range(offset):
        if 0 in active:
            advance(0)
    while active:
        for i in list(active):
            advance(i)
    return results[0], results[1]  # type: ignore[return-value]


STRAIGHT = "_straight"  # the plain twin of generator method ``forward`` is ``forward_straight``


class _Straighten(ast.NodeTransformer):
    """Bare ``yield`` statements go; ``yield from X.f(args)`` becomes ``X.f_straight(args)``."""

    def visit_Expr(self, node: ast.Expr) -> ast.AST | None:
        if isinstance(node.value, ast.Yield):
            if node.value.value is not None:
                raise ValueError("straight(): only bare `yield` stage ends are supported")
            return ast.Pass()
        return self.generic_visit(node)

    def visit_YieldFrom(self, node: ast.YieldFrom) -> ast.AST:
        call = node.value
        if not isinstance(call, ast.Call):
            raise ValueError("straight(): `yield from` must call a stage generator directly")
        func = call.func
        if isinstance(func, ast.Attribute):
            call.func = ast.Attribute(self.visit(func.value), func.attr + STRAIGHT, func.ctx)
        elif isinstance(func, ast.Name):
            call.func = ast.Name(func.id + STRAIGHT, func.ctx)
        else:
            raise ValueError("straight(): `yield from` must call a name or an attribute")
        call.args = [self.visit(a) for a in call.args]
        call.keywords = [self.visit(k) for k in call.keywords]
        return call

    def visit_Yield(self, node: ast.Yield) -> ast.AST:
        raise ValueError("straight(): a `yield` used as a value is not a stage end")


def straight(fn: Callable[..., Stages[A]]) -> Callable[..., A]:
    """The function that runs stage generator ``fn`` start to finish: ``fn``'s own source (line numbers
    kept, so tracebacks point at it) with its stage ends dropped and each ``yield from X.f(...)`` calling
    ``X.f_straight(...)``, the straight twin every stage generator it delegates to must define."""
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    func = tree.body[0]
    if not isinstance(func, ast.FunctionDef):
        raise ValueError(f"straight(): {fn.__qualname__} is not a plain function definition")
    func.decorator_list = []
    func.name = fn.__name__ + STRAIGHT
    tree = ast.fix_missing_locations(_Straighten().visit(tree))
    ast.increment_lineno(tree, fn.__code__.co_firstlineno - 1)
    namespace: dict[str, Any] = {}
    code = compile(tree, inspect.getsourcefile(fn) or "<straight>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, fn.__globals__, namespace)
    twin = namespace[func.name]
    twin.__qualname__ = fn.__qualname__ + STRAIGHT
    twin.__doc__ = fn.__doc__
    return twin


def choose_overlap(mode: OverlapSetting, max_tokens_per_rank: int, threshold: int | None) -> OverlapMode:
    """The schedule for this step. ``auto``: two micro-batches once every rank's FFN half holds at
    least ``threshold`` tokens (the step's global maximum decides, so all ranks agree; None: never),
    else dispatch overlap; splitting small batches only halves GEMM efficiency."""
    if mode == "auto":
        return "microbatch" if threshold is not None and max_tokens_per_rank >= threshold else "dispatch"
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode {mode!r}; choose from {OVERLAP_CHOICES}")
    return mode
