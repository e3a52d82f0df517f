"""Start real ``epserve`` server processes for tests, freeze their ranks (SIGSTOP) where a test needs a
request held open whatever the machine's speed, and stop them, checking nothing is left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

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


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_used_in_quietest_window(pids, window_s: float = 1.0, windows: int = 3) -> dict[int, float]:
    """CPU seconds each of ``pids`` used in the quietest of up to ``windows`` consecutive windows (the
    first whose every process stayed under 0.05 s ends the search): an idle process that spins fails
    every window; one still finishing its last step on a loaded host passes the next."""
    best: dict[int, float] | None = None
    for _ in range(windows):
        before = {p: cpu_seconds(p) for p in pids}
        time.sleep(window_s)
        used = {p: cpu_seconds(p) - before[p] for p in pids}
        if best is None or max(used.values()) < max(best.values()):
            best = used
        if max(best.values()) < 0.05:
            break
    assert best is not None
    return best


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # (reaped between the open and the read: ESRCH)
        return False


def named(pid: int, names: list[str], timeout: float = 30.0) -> list[int]:
    """The live descendants of ``pid`` called ``names`` (``/proc/PID/comm``: ``epserve-rank0``), in that
    order, once all of them run."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for kid in descendants(pid):
            try:
                if alive(kid):  # (a rank of a group torn down may linger as a zombie)
                    found[Path(f"/proc/{kid}/comm").read_text().strip()] = kid
            except (FileNotFoundError, ProcessLookupError):
                continue
        if all(name in found for name in names):
            return [found[name] for name in names]
        assert time.monotonic() < deadline, f"no processes {names} under {pid}: {found}"
        time.sleep(0.05)


def _thread_states(pid: int) -> list[str]:
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return states


def freeze(pids: list[int], timeout: float = 10.0) -> None:
    """SIGSTOP each process and wait until every thread of each has stopped: from then on a frozen
    rank produces nothing (no token, no answer), whatever the machine's speed, until :func:`thaw`.
    Signals sent to it meanwhile (SIGTERM) stay pending and are delivered when it runs again."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while any(state != "T" for state in _thread_states(pid)):
            assert time.monotonic() < deadline, f"process {pid} did not stop: {_thread_states(pid)}"
            time.sleep(0.005)


def thaw(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def frozen(pids: list[int]) -> Iterator[None]:
    """:func:`freeze` the processes for the block, :func:`thaw` them after it (also on failure)."""
    freeze(pids)
    try:
        yield
    finally:
        thaw(pids)


@contextlib.contextmanager
def frozen_when(pids: list[int], ready: Callable[[], bool]) -> Iterator[None]:
    """For the block: a thread polls ``ready()`` and freezes ``pids`` once it holds; they are thawed
    when the block ends (a request held open while the block's client waits, say)."""
    done = threading.Event()

    def hold() -> None:
        while not done.is_set():
            if ready():
                with frozen(pids):
                    done.wait()
                return
            time.sleep(0.01)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        yield
    finally:
        done.set()
        holder.join(30)


def first_token(url: str) -> Callable[[], bool]:
    """A check that the router at ``url`` has had a request's first token (it counts one in
    ``epserve:time_to_first_token_seconds``) since this call: that request runs in an engine."""

    def first_tokens() -> float:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            return metric(r.read().decode(), "epserve:time_to_first_token_seconds_count")

    before = first_tokens()
    return lambda: first_tokens() > before


class HeldInstance:
    """The request in flight on one instance of an ``epserve serve --dp N`` (TP 1) held still by
    construction, however fast the machine: :meth:`start` freezes every rank, finds the request's
    instance by the router's own in-flight count (``epserve:engine_load``), and thaws that one alone.
    Its step then waits on the frozen peers in the lockstep all-reduce (no token comes) while its gRPC
    side answers: loads, a cancel. Leaving the block thaws every rank; with ``wait_cancel`` (and the
    block not failed) first waits until the router has cancelled a request, which it counts as
    ``finished_reason="abort"`` (a client gone mid-stream). A ``/metrics`` render meanwhile waits out
    the frozen ranks' 2 s ``GetLoad``."""

    def __init__(self, proc: Proc, url: str, count: int = 2, wait_cancel: bool = False) -> None:
        self.ranks, self.url, self.wait_cancel = proc.ranks(count), url, wait_cancel
        self.cancels = self._cancels()  # and fresh loads: an idle instance's stay 0 while it is frozen

    def _metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()

    def _cancels(self) -> float:
        return metric(self._metrics(), "epserve:request_success_total", finished_reason="abort")

    def start(self) -> None:
        freeze(self.ranks)
        text = self._metrics()
        loads = [metric(text, "epserve:engine_load", engine=str(i)) for i in range(len(self.ranks))]
        assert max(loads) >= 1, f"no request in flight on any instance: {loads}"
        thaw([self.ranks[loads.index(max(loads))]])

    def __enter__(self) -> HeldInstance:
        return self

    def __exit__(self, failed: type | None, *rest: object) -> None:
        try:
            deadline = time.monotonic() + 30
            while failed is None and self.wait_cancel and self._cancels() <= self.cancels:
                assert time.monotonic() < deadline, "the router never cancelled the held request"
                time.sleep(0.05)
        finally:
            thaw(self.ranks)


def wait_pending(pid: int, sig: int, timeout: float = 30.0) -> None:
    """Wait until ``sig`` is pending for (sent to, not yet handled by) a frozen process."""
    bit = 1 << (sig - 1)
    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/status") as f:
            masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
        if any(mask & bit for mask in masks):
            return
        assert time.monotonic() < deadline, f"signal {sig} never reached process {pid}"
        time.sleep(0.01)


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

    def ranks(self, count: int = 1, prefix: str = "epserve-rank") -> list[int]:
        """The pids of its rank processes ``{prefix}0`` .. ``{prefix}{count-1}``, once all of them run."""
        return named(self.pid, [f"{prefix}{i}" for i in range(count)])

    def signal_while_frozen(self, ranks: list[int], sig: int | None = None) -> None:
        """Send ``sig`` (default SIGTERM; to an ``epserve serve``) with ``ranks`` frozen, and thaw them only
        once the command has passed it on to each: no token is produced meanwhile, however long it takes."""
        sig = signal.SIGTERM if sig is None else sig
        with frozen(ranks):
            self.signal(sig)
            for rank in ranks:
                wait_pending(rank, sig)

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


class Stream:
    """A long streamed completion read in a thread: its events, and how it ended."""

    def __init__(self, url: str, max_tokens: int = 800) -> None:
        self.events: list[dict] = []
        self.done = False
        self.started = threading.Event()
        body = {"prompt": "a long one", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()
        assert self.started.wait(30), "the stream never started"

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                        if len(self.events) == 2:
                            self.started.set()
        except httpx.HTTPError:
            pass  # the server went away (the test asks how the stream ended)

    def end(self) -> dict:
        self.thread.join(60)
        assert not self.thread.is_alive() and self.done, self.events[-3:]
        return self.events[-1]


def wait_output(proc: Proc, text: str, timeout: float = 120.0) -> None:
    """Until ``text`` is in ``proc``'s output (it must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    while text not in proc.output():
        assert proc.proc.poll() is None, proc.output()[-3000:]
        assert time.monotonic() < deadline, proc.output()[-3000:]
        time.sleep(0.05)
