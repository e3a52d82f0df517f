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


CAP = 400  # lines of any file; a source file under src/ (Python or C) stays 20 lines clear of it
SOURCE_MARGIN = 20


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources(PACKAGE, ROOT / "tests", ROOT / "benchmarks")
            if (n := _lines(p)) > CAP}
    assert long == {}


def test_no_source_file_pressed_against_the_cap():
    """A source file near the cap is asking for a seam, not for squeezing: every Python and C source under
    src/ stays 20 lines clear of it."""
    sources = [*_sources(PACKAGE), *sorted(PACKAGE.rglob("*.c")), *sorted(PACKAGE.rglob("*.h"))]
    near = {str(p.relative_to(ROOT)): n for p in sources if (n := _lines(p)) > CAP - SOURCE_MARGIN}
    assert near == {}


def test_the_runner_keeps_forward_kv_and_capture_only():
    """Sampling lives in its own pipeline; the runner (sequences into tensors, the forward, KV, capture)
    stays small."""
    assert _lines(PACKAGE / "engine" / "runner.py") <= 300


def test_lint_is_clean_line_length_included():
    """ruff, with pyproject's rules (line length among them), finds nothing in the code, tests or tools."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks",
                          "scripts"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _import_graph() -> dict[str, set[str]]:
    """Each module's imports of other epserve modules, lazy ones (inside functions) included; a module's
    import of its own package (``epserve.kernels`` from ``epserve.kernels.fp8``) is not an edge."""
    modules = {_module_name(p): p for p in _sources(PACKAGE)}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("epserve"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("epserve")}
        graph[name] = {d for d in deps if d in modules and d != name and not name.startswith(d + ".")}
    return graph


def test_no_import_circles():
    """No two modules import each other, directly or around a longer loop (lazy imports count): the
    module graph is acyclic, so every module has a place in the layering."""
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []


@pytest.mark.parametrize("unit", ["model", "moe"])
def test_model_and_moe_never_ask_whether_they_are_traced(unit: str):
    """Whether a call is traced is decided inside the kernel ops (kernels/), never in the network's code:
    model/ and moe/ call an op and take its tensor."""
    askers = sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE / unit)
                    for node in ast.walk(ast.parse(p.read_text()))
                    if isinstance(node, (ast.Name, ast.Attribute, ast.alias))
                    and (getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None))
                    in ("tracing", "is_compiling"))
    assert askers == []
    c_front_ends = re.compile(r"epserve\.kernels(\.| import )cpu(_ops)?\b")
    c_callers = sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE / unit)
                       if c_front_ends.search(p.read_text()))
    assert c_callers == []  # a C kernel is an op's implementation, never chosen at a call site


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
# it, it may import the message vocabulary, the gRPC conversions, the tokenizer and its chat templates,
# env and config, the torch-free process helpers and (lazily, when it runs alone on the built-in model)
# the preset writer; never the package root (whose names reach the engine).
ROUTER_MAY_IMPORT = ("epserve.router", "epserve.messages", "epserve.rpc", "epserve.tokenizer", "epserve.env",
                     "epserve.config", "epserve.parallel.process", "epserve.presets", "epserve.chat_template")


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


def test_c_kernels_are_declared_once():
    """Every C kernel's signature is written in the C source and in its library's table
    (``kernels/cpu_abi.py``) only: no hand-typed ctypes signature elsewhere in the kernels, no hand-written
    packed twin in the C sources (they are generated from the table)."""
    typed = sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE / "kernels")
                   if p.name != "cpu_abi.py" and re.search(r"\.(argtypes|restype)\s*=", p.read_text()))
    twins = sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "kernels").glob("*.c")
                   if re.search(r"\bepserve_\w+_packed\s*\(", p.read_text()))
    assert (typed, twins) == ([], [])


def test_engine_options_are_declared_once():
    """An engine option is one field of ``EngineOptions``: ``build_engine_config`` (defined in
    engine/options.py only) takes exactly those fields, and no module of the engine's commands (the engine,
    its server, the launcher) spells one of their flags by hand."""
    import dataclasses
    import inspect

    from epserve.engine.options import EngineOptions, build_engine_config

    defined = sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE) for node in ast.walk(ast.parse(
        p.read_text())) if isinstance(node, ast.FunctionDef) and node.name == "build_engine_config")
    assert defined == ["engine/options.py"]
    fields = dataclasses.fields(EngineOptions)
    assert list(inspect.signature(build_engine_config).parameters) == ["model", *(f.name for f in fields)]
    flags = {name for f in fields for flag in f.metadata.get("flags", ()) for name in flag.names}
    assert flags
    commands = _sources(PACKAGE / "engine", PACKAGE / "engine_server", PACKAGE / "launcher")
    by_hand = sorted((str(p.relative_to(PACKAGE)), node.args[0].value) for p in commands
                     for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"
                     and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in flags)
    assert by_hand == []


def _importers(name: str) -> list[str]:
    """The modules under src/ that import module ``name`` (or a name from it)."""
    return sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE)
                  if name in _imported_modules(ast.parse(p.read_text())))


def test_one_sampling_pipeline():
    """Tokens are drawn in one place: only the sampling pipeline (engine/sampling.py) reaches the draw and
    the verification; structured outputs have one seam (engine/constraints.py); the runner keeps forward,
    KV and capture, and asks nothing of sampling or grammars."""
    assert _importers("epserve.engine.sampler") == ["engine/sampling.py", "engine/spec_decode.py"]  # its filter
    assert set(_importers("epserve.engine.spec_decode")) <= {"engine/sampling.py", "engine/worker.py"}
    assert _importers("epserve.engine.structured") == ["engine/constraints.py"]
    runner = _imported_modules(ast.parse((PACKAGE / "engine" / "runner.py").read_text()))
    sampling_side = {f"epserve.engine.{m}" for m in ("sampler", "spec_decode", "logits_processor", "logits_tables",
                                                     "seen_tokens", "structured", "constraints", "prompt_logprobs")}
    assert runner & sampling_side == set()
    engine_code = {str(p.relative_to(PACKAGE)): p.read_text() for p in _sources(PACKAGE / "engine")}
    assert sorted(f for f, text in engine_code.items() if "runner.grammar" in text) == []
    assert sorted(f for f, text in engine_code.items() if re.search(r"profiler is (not )?None", text)) == []


def test_protobuf_stays_at_the_routers_edge():
    """The router's text and response code sees the message dataclasses only: protobuf is read where the
    engines are called and converted by ``rpc/convert`` (generation, text stages, metrics never see it)."""
    edge = {"engine_client.py", "instances.py", "app.py", "server.py"}
    readers = {p.name for p in (PACKAGE / "router").glob("*.py")
               if any(m.startswith("epserve.rpc.proto") for m in _imported_modules(ast.parse(p.read_text())))}
    assert readers <= edge, sorted(readers - edge)


def test_the_structure_page_has_one_short_line_per_package():
    """docs/structure.md names every package and top-level module under src/epserve/ once, in a short line."""
    lines = [line for line in (ROOT / "docs" / "structure.md").read_text().splitlines() if line.startswith("- `")]
    named = [line[3:].split("`")[0].rstrip("/").removesuffix(".py") for line in lines]
    units = {_unit(p) for p in _sources(PACKAGE)} - {"__init__"}
    assert sorted(named) == sorted(units)
    assert [line for line in lines if len(line) > 140] == []


def test_kernel_ops_decide_in_one_place():
    """Only the op's call (kernels/opdef.py) asks whether it is traced, registers a custom op or picks a
    self-tested backend; the kernels themselves (C front ends, Triton, FlashInfer, ``_scaled_mm``) just run."""
    def uses(names: set[str], path: Path) -> bool:
        return any((isinstance(node, ast.Name) and node.id in names)
                   or (isinstance(node, ast.Attribute) and node.attr in names)
                   or (isinstance(node, ast.alias) and node.name in names)
                   for node in ast.walk(ast.parse(path.read_text())))

    kernels = _sources(PACKAGE / "kernels")
    assert sorted(p.name for p in kernels if uses({"tracing", "is_compiling"}, p)) == ["device.py", "opdef.py"]
    assert sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE) if uses({"custom_op"}, p)) == [
        "kernels/opdef.py"]
    assert sorted(str(p.relative_to(PACKAGE)) for p in _sources(PACKAGE) if uses({"select", "decide"}, p)
                  and "backends" in p.read_text() and p.name != "backends.py") == ["kernels/opdef.py"]


def test_tool_calls_and_quantized_rows_have_one_home():
    """The Responses API reaches tool calls only through the chat path (their parsing exists once); in the
    dispatchers only the payload quantizes rows (FP8 or NVFP4): a dispatcher moves bytes."""
    for path in (PACKAGE / "router").glob("responses*.py"):
        imported = _imported_modules(ast.parse(path.read_text()))
        assert not imported & {"epserve.router.tool_calls", "epserve.router.tools"}, path.name
    quantizers = {"epserve.kernels.nvfp4_act", "epserve.kernels.fp8"}
    assert sorted(p.name for p in (PACKAGE / "moe" / "dispatch").glob("*.py")
                  if _imported_modules(ast.parse(p.read_text())) & quantizers) == ["payload.py"]


def test_cpu_kernels_take_their_thread_count_from_one_place():
    """Every C kernel call takes its thread count from ``kernels/cpu_threads.py`` (recorded steps are given it
    again at replay), so only that module asks torch for it; and the model's head casts through the kernels
    (no ``.float()``), so a recorded CPU decode step can hold it."""
    asking = sorted(p.name for p in _sources(PACKAGE) if "get_num_threads" in p.read_text()
                    and p.parent.name == "kernels")
    assert asking == ["cpu_threads.py"]
    model = ast.parse((PACKAGE / "model" / "deepseek_v3.py").read_text())
    heads = [f for f in ast.walk(model) if isinstance(f, ast.FunctionDef) and f.name.startswith("compute_")
             and f.name.endswith("logits")]
    assert heads and not [f.name for f in heads for node in ast.walk(f)
                          if isinstance(node, ast.Attribute) and node.attr in {"float", "to", "type"}]
