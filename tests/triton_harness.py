"""Running a test file's Triton checks under the interpreter (``TRITON_INTERPRET=1``), which triton
reads when it decorates kernels: so they run in a subprocess of their own, the test file run as a
script, and report one JSON line of ``{case: None | traceback}`` that the parent's tests read."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    # the test file runs as a script from its area folder: the harness modules sit in tests/
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


_RUNS: dict[str, subprocess.Popen] = {}  # test file -> its interpreter run, started with its siblings


def _stop_leftovers() -> None:
    """Runs whose tests were deselected after collection: not left running past the session."""
    for proc in _RUNS.values():
        proc.kill()
        proc.wait()


def _start(test_file: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(test_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=subprocess_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""))


def interpreter_results(test_file: str) -> dict[str, str | None]:
    """Run ``test_file`` as a script under the interpreter (no GPU visible); its cases' outcomes. The
    first call also starts every collected sibling test file that reports cases, so the interpreter
    runs (single-threaded Python, most of their time) overlap instead of queueing one after another."""
    path = Path(test_file).resolve()
    if not _RUNS:
        collected = {name.rsplit(".", 1)[-1] for name in sys.modules}  # the test modules pytest imported
        for sibling in sorted(path.parent.glob("test_*.py")):
            if sibling != path and sibling.stem in collected and "triton_harness.report_cases" in sibling.read_text():
                _RUNS[str(sibling)] = _start(sibling)
        atexit.register(_stop_leftovers)
    proc = _RUNS.pop(str(path), None) or _start(path)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and stdout.strip(), stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def interpreter_tests(test_file: str, cases: Iterable[str]) -> tuple[Callable, Callable]:
    """A test file's module-scoped fixture ``interpreter_results`` (the file run under the interpreter, once:
    :func:`interpreter_results`; skipped without triton) and ``test_triton_under_interpreter``, a test per case,
    for the file to bind: ``interpreter_results, test_triton_under_interpreter = interpreter_tests(__file__,
    CASES)``."""
    import importlib.util

    import pytest

    @pytest.fixture(scope="module", name="interpreter_results")
    def results() -> dict[str, str | None]:
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        return interpreter_results(test_file)

    @pytest.mark.parametrize("case", sorted(cases))
    def test_triton_under_interpreter(case: str, interpreter_results: dict[str, str | None]) -> None:
        assert interpreter_results[case] is None, interpreter_results[case]

    return results, test_triton_under_interpreter


def report_cases(cases: dict[str, Callable[[ModuleType], None]], kernels: ModuleType,
                 results: dict[str, str | None] | None = None) -> None:
    """In the subprocess: run every case against the Triton module ``kernels``; print the JSON line."""
    results = dict(results or {})
    for name, case in cases.items():
        try:
            results[name] = case(kernels)  # None
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
    print(json.dumps(results))
