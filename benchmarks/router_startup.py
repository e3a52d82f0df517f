"""How long ``epserve router`` takes to answer HTTP, and what importing its app costs, for this tree
and (``--other SRC``) another source tree, alternated in one run.

    .venv/bin/python benchmarks/router_startup.py [--other /path/to/old/src] [--rounds 5]

Each round starts ``epserve router --engine 127.0.0.1:<closed port> --port <free>`` on the built-in tiny
model's directory (no engine is up: ``/health`` answers 503, which counts, since the router is serving)
and times the first HTTP answer; then it times ``import epserve.router.app`` (or, for a tree without it,
the module path given by ``--other-app``) in a fresh interpreter, and whether torch was loaded. Medians
over the rounds; JSON with ``--json``. Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def time_to_http(src: Path, model: Path, timeout_s: float = 60.0) -> float:
    """Seconds from starting ``epserve router`` to its first HTTP answer (any status)."""
    port = _free_port()
    cmd = [sys.executable, "-c", "import sys; from epserve.cli import main; sys.exit(main())", "--log-level",
           "WARNING", "router", str(model), "--engine", f"127.0.0.1:{_free_port()}", "--port", str(port)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(src), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"the router exited with code {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1.0).close()
                return time.perf_counter() - start
            except urllib.error.HTTPError:  # 503: serving, no engine up
                return time.perf_counter() - start
            except (urllib.error.URLError, OSError):
                time.sleep(0.01)
        raise RuntimeError(f"no HTTP answer within {timeout_s:.0f} s")
    finally:
        proc.terminate()
        proc.wait(30)


def import_time(src: Path, module: str) -> tuple[float, bool]:
    """Seconds to import ``module`` in a fresh interpreter, and whether that loaded torch."""
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            "print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=_env(src), capture_output=True, text=True, check=True)
    seconds, torch_loaded = out.stdout.split()
    return float(seconds), torch_loaded == "True"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--other", type=Path, help="another tree's src/ directory to compare with")
    p.add_argument("--other-app", default="epserve.serve.openai_api", help="the router app's module in --other")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from epserve.env import builtin_model_dir

    model = builtin_model_dir()
    if not (model / "config.json").is_file():
        from epserve.presets import default_model_path

        model = default_model_path()
    sides = {"this tree": (ROOT / "src", "epserve.router.app")}
    if args.other is not None:
        sides["other tree"] = (args.other, args.other_app)
    figures: dict[str, dict[str, list]] = {name: {"http_s": [], "import_s": [], "torch": []} for name in sides}
    for r in range(args.rounds):
        for name, (src, app) in sides.items():  # alternated, so both see the same machine
            figures[name]["http_s"].append(time_to_http(src, model))
            seconds, torch_loaded = import_time(src, app)
            figures[name]["import_s"].append(seconds)
            figures[name]["torch"].append(torch_loaded)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {f['http_s'][-1]:.2f} s to HTTP, import {f['import_s'][-1]:.2f} s" for n, f in figures.items()),
            flush=True)
    summary = {name: {"http_s_median": statistics.median(f["http_s"]),
                      "import_s_median": statistics.median(f["import_s"]),
                      "loads_torch": any(f["torch"]), **f} for name, f in figures.items()}
    print(f"{'side':<12} {'to HTTP (median)':>18} {'import app (median)':>20} {'loads torch':>12}")
    for name, s in summary.items():
        print(f"{name:<12} {s['http_s_median']:>16.2f} s {s['import_s_median']:>18.2f} s {str(s['loads_torch']):>12}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
