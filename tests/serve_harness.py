"""Start real ``epserve`` server processes for tests and stop them, checking nothing is left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def children(pid: int) -> list[int]:
    kids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return kids


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for kid in children(todo.pop()):
            out.append(kid)
            todo.append(kid)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Proc:
    """An ``epserve`` command (or, with ``module=False``, any ``python`` command line) in the background,
    its output in a log file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None, module: bool = True) -> None:
        self.args = args
        self.log = log
        full_env = {**os.environ, "EPSERVE_THREADS_PER_RANK": "1", "EPSERVE_NO_PROGRESS": "1", **(env or {})}
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in wait()
        command = [sys.executable, "-m", "epserve.cli", *args] if module else [sys.executable, *args]
        self.proc = subprocess.Popen(command, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
        self.pids_seen: set[int] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text()

    def remember_descendants(self) -> None:
        self.pids_seen.update(descendants(self.pid))

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.remember_descendants()
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log_file.close()

    def kill_all(self) -> None:
        for pid in [*descendants(self.pid), self.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._log_file.close()


def wait_http_ok(url: str, proc: Proc, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            raise AssertionError(f"{proc.args} exited with {proc.proc.returncode}:\n{proc.output()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not healthy after {timeout} s:\n{proc.output()[-3000:]}")


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text format -> (sample name, labels, value) rows."""
    rows = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        rows.append((name, labels, float(value)))
    return rows


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in parse_metrics(text) if n == name and labels.items() <= lab.items())
