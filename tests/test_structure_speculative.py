"""Walls from issue 44: the MTP start-up probe's prompts and callers in one place, every dispatcher told which
of a step's rows are real, and a rank that outlives its world joining gloo's threads before the interpreter's
shutdown. The layering walls are in ``test_structure.py``."""

from __future__ import annotations

import ast

from tests.test_structure import PACKAGE, _importers, _sources


def _trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(PACKAGE)): ast.parse(p.read_text()) for p in _sources(PACKAGE)}


def test_the_mtp_probe_has_one_home():
    """The probe's prompts are written once (the planner's acceptance measurement reads the engine's), and
    only the engine's start-up and the planner reach the probe."""
    assigned = sorted(name for name, tree in _trees().items() for node in ast.walk(tree)
                      if isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == "MTP_PROMPTS" for t in node.targets))
    assert assigned == ["engine/spec_probe.py"]
    assert set(_importers("epserve.engine.spec_probe")) <= {"engine/engine.py", "engine/llm.py",
                                                            "planner/calibrate_engine.py"}


def test_every_dispatcher_takes_the_real_rows():
    """Each backend's ``dispatch_send`` has the base's signature: ``real_rows`` (a captured bucket's padding
    rows marked False) defaulting to None, so no caller can leave a backend counting padding unknowingly."""
    found = {}
    for name, tree in _trees().items():
        if not name.startswith("moe/dispatch/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "dispatch_send":
                args = node.args.args + node.args.kwonlyargs
                defaults = dict(zip([a.arg for a in node.args.args][-len(node.args.defaults):] if node.args.defaults
                                    else [], node.args.defaults))
                defaults.update({a.arg: d for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d})
                real = defaults.get("real_rows")
                found[name] = ("real_rows" in [a.arg for a in args]
                               and isinstance(real, ast.Constant) and real.value is None)
    assert len(found) >= 5 and all(found.values()), found


def test_a_rank_that_outlives_its_world_collects_after_closing_it():
    """Where a process goes on after closing its engine worker (a torchrun rank returning to the interpreter),
    the function that closes it also collects, so gloo's threads end there and not in the interpreter's
    shutdown (where one taking the GIL aborts the process). Spawned ranks end with os._exit."""
    closers = []
    for name, tree in _trees().items():
        if name == "parallel/spawned.py":
            continue
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            calls = [n.func for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            if any(c.attr == "close" and isinstance(c.value, ast.Name) and c.value.id == "worker" for c in calls):
                collects = any(c.attr == "collect" and isinstance(c.value, ast.Name) and c.value.id == "gc"
                               for c in calls)
                closers.append((name, fn.name, collects))
    assert closers and all(collects for _, _, collects in closers), closers
