"""The code's shape, checked: the request path's layers import only downward, class names are unique,
every file stays under 400 lines, and ``EPSERVE_*`` variables are read in one module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "epserve"

# serve -> engine -> model -> moe, with parallel/ and kernels/ below them (docs/structure.md). A
# module may import its own package and any of a lower rank, never one of the same or a higher rank.
RANKS = {
    "env": 0, "config": 0,
    "chat_template": 0,
    "kernels": 1, "parallel": 1, "checkpoint": 1, "tokenizer": 1,
    "eplb": 1,
    "moe": 2, "presets": 2,
    "model": 3,
    "messages": 1,
    "rpc": 2,
    "engine": 4,
    "engine_server": 5, "router": 5, "planner": 5, "bench": 5, "training": 5,
    "launcher": 6,
    "cli": 7, "__init__": 8,
    "__version__": 0,  # `from epserve import __version__`: a constant (epserve/__init__ imports nothing eagerly)
}
TOP_LEVEL_NAMES = {"LLM": "engine", "SamplingParams": "engine"}  # what `from epserve import X` reaches


def _sources(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.rglob("*.py") if "proto" not in p.parts)


def _unit(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def _imported_units(tree: ast.AST) -> set[str]:
    units = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "epserve":
                units |= {TOP_LEVEL_NAMES.get(a.name, a.name) for a in node.names}
            elif node.module.startswith("epserve."):
                units.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            units |= {a.name.split(".")[1] for a in node.names if a.name.startswith("epserve.")}
    return units


def test_every_unit_has_a_rank():
    assert {_unit(p) for p in _sources(PACKAGE)} <= set(RANKS)


@pytest.mark.parametrize("path", _sources(PACKAGE), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_go_down_the_request_path(path: Path):
    unit = _unit(path)
    upward = sorted(u for u in _imported_units(ast.parse(path.read_text())) - {unit} if RANKS[u] >= RANKS[unit])
    assert not upward, f"{path.relative_to(PACKAGE)} ({unit}) imports {upward}: not below it"


def test_class_names_are_unique():
    seen: dict[str, list[str]] = {}
    for path in _sources(PACKAGE):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: where for name, where in seen.items() if len(where) > 1} == {}


def test_no_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources(PACKAGE, ROOT / "tests", ROOT / "benchmarks")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_environment_variables_are_read_in_one_module():
    """Only env.py names an ``EPSERVE_*`` variable in code (docstrings may mention them)."""
    name = re.compile(r"EPSERVE_[A-Z_]+")
    readers = sorted({
        str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE) for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and name.fullmatch(node.value)
    })
    assert readers == ["env.py"]


def _imported_modules(tree: ast.AST) -> set[str]:
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("epserve"):
            modules |= {f"{node.module}.{a.name}" for a in node.names} if node.module == "epserve" else {node.module}
        elif isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.startswith("epserve")}
    return modules


# The router process (HTTP, tokenizer, routing) reaches the engines through gRPC only: of the code below
# it, it may import the message vocabulary, the gRPC conversions, the tokenizer and its chat templates, env and config, the
# torch-free process helpers, (lazily, when it runs alone on the built-in model) the preset writer, and
# the package's version (``epserve/__init__`` imports nothing eagerly).
ROUTER_MAY_IMPORT = ("epserve.router", "epserve.messages", "epserve.rpc", "epserve.tokenizer", "epserve.env",
                     "epserve.config", "epserve.parallel.process", "epserve.presets", "epserve.__version__",
                     "epserve.chat_template")


@pytest.mark.parametrize("path", sorted((PACKAGE / "router").glob("*.py")), ids=lambda p: p.name)
def test_the_router_imports_no_engine_code(path: Path):
    imported = _imported_modules(ast.parse(path.read_text()))
    assert sorted(m for m in imported if not m.startswith(ROUTER_MAY_IMPORT)) == []


def test_messages_import_only_messages_and_config():
    for path in (PACKAGE / "messages").glob("*.py"):
        imported = _imported_modules(ast.parse(path.read_text()))
        assert all(m.startswith(("epserve.messages", "epserve.config")) for m in imported), (path.name, imported)


def test_the_router_and_the_messages_load_without_torch():
    """What the router process imports to serve (the app, its process entry, the messages) loads none of
    torch, the engine, the KV manager or the sampler: the router starts in a fraction of the time."""
    import subprocess
    import sys

    code = ("import sys, epserve.router.app, epserve.router.server, epserve.messages.commands, "
            "epserve.messages.engine, epserve.rpc.convert; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'epserve.engine', "
            "'epserve.model', 'epserve.moe', 'epserve.kernels', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_running_router_has_no_torch_loaded(tiny_ckpt):
    """``epserve router`` as a user starts it, serving (``/health`` answers 503: no engine is up): its
    process has not loaded torch's library."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "epserve.cli", "router", str(tiny_ckpt), "--engine",
                             f"127.0.0.1:{free_port()}", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
            except urllib.error.HTTPError as e:
                assert e.code == 503
                break
            except OSError:
                time.sleep(0.05)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "torch/_C" not in maps
    finally:
        proc.terminate()
        proc.wait(30)
