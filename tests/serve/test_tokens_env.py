"""Issue 45 (6): the API key stays out of the environment of every process ``epserve serve`` starts
(the forkserver, and so the ranks forked from it, the resource tracker, the router: the key reaches the
router with the router's options), whether given by flag, file or ``EPSERVE_API_KEY``; the router's
options carry it, apart from the engine token (``tests/serve/test_router_budget.py``: a router given
only the key calls its engines in plaintext)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from epserve import env
from epserve.cli import build_parser
from epserve.launcher.args import router_options, set_api_key
from epserve.parallel.launch import free_port
from tests.serve_harness import Proc, descendants

API_KEY = "sk-issue-45-key"


def _processes(pid: int) -> dict[int, tuple[bytes, bytes]]:
    """The live descendants of ``pid``: their command lines and environments."""
    seen = {}
    for kid in descendants(pid):
        try:
            seen[kid] = Path(f"/proc/{kid}/cmdline").read_bytes(), Path(f"/proc/{kid}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return seen


def test_serve_keeps_the_api_key_out_of_its_processes_environment(tmp_path):
    proc = Proc(["serve", "--dp", "1", "--port", str(free_port()), "--dtype", "float32", "--num-blocks", "16",
                 "--max-model-len", "64"], tmp_path / "serve.log", env={env.API_KEY: API_KEY})
    try:  # once the forkserver runs (the ranks are forked from it, with its environment)
        deadline = time.monotonic() + 120
        seen = _processes(proc.pid)
        while not any(b"forkserver" in cmdline for cmdline, _ in seen.values()):
            assert proc.proc.poll() is None and time.monotonic() < deadline, proc.output()[-3000:]
            time.sleep(0.05)
            seen = _processes(proc.pid)
        holders = [cmdline for cmdline, environ in seen.values() if f"{env.API_KEY}=".encode() in environ]
        assert not holders, f"the API key is in the environment of {holders}"
    finally:
        proc.kill_all()


@pytest.mark.parametrize("given", ["flag", "file", "environment"])
def test_router_options_carry_the_key_and_take_it_out_of_the_environment(given, tmp_path, monkeypatch):
    (tmp_path / "key").write_text(API_KEY + "\n")
    argv = {"flag": ["--api-key", API_KEY], "file": ["--api-key-file", str(tmp_path / "key")], "environment": []}
    monkeypatch.setenv(env.API_KEY, API_KEY if given == "environment" else "another-key")
    monkeypatch.delenv(env.ENGINE_TOKEN, raising=False)
    args = build_parser().parse_args(["router", "--engine", "127.0.0.1:1", *argv[given]])
    assert set_api_key(args) == API_KEY and env.API_KEY not in os.environ
    options = router_options(args, ("127.0.0.1:1",))
    assert options.api_key == API_KEY and options.engine_token is None
    assert API_KEY not in repr(options)
