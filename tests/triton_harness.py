"""Running a test file's Triton checks under the interpreter (``TRITON_INTERPRET=1``), which triton
reads when it decorates kernels: so they run in a subprocess of their own, the test file run as a
script, and report one JSON line of ``{case: None | traceback}`` that the parent's tests read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    # the test file runs as a script from its area folder: the harness modules sit in tests/
    path = os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def interpreter_results(test_file: str) -> dict[str, str | None]:
    """Run ``test_file`` as a script under the interpreter (no GPU visible); its cases' outcomes."""
    proc = subprocess.run([sys.executable, test_file], capture_output=True, text=True, timeout=600,
                          env=subprocess_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
