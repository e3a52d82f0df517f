"""Recovery from hung and dead ranks: time to detect, time to serve again.

Starts ``epserve serve --dp 2`` (built-in tiny model unless given a checkpoint), then for each fault —
SIGKILL and SIGSTOP, of rank 0 (it also hosts the rendezvous store) and of rank 1 — with a streamed
request in flight: the seconds until the stream ended (with its error event: the failure detected),
until ``/health`` first answered 503 (if the router looked before the group was back), and until a
completion succeeds again (the supervisor restarted the group). Then SIGTERM, which must exit 0.

    python benchmarks/recovery.py                       # --step-timeout 3, each fault twice
    python benchmarks/recovery.py --step-timeout 10 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from epserve.parallel.launch import free_port

ROOT = Path(__file__).resolve().parent.parent



def wait(predicate, timeout: float, what: str, step: float = 0.05) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(step)
    raise RuntimeError(f"{what} did not happen within {timeout} s")


def ranks(server: psutil.Process, dp: int) -> list[psutil.Process]:
    """The rank processes, by name (``epserve-rank{i}``), once all ``dp`` of them run."""
    found: list[psutil.Process] = []

    def all_up() -> bool:
        named = {p.name(): p for p in server.children(recursive=True)}
        found[:] = [named[f"epserve-rank{i}"] for i in range(dp) if f"epserve-rank{i}" in named]
        return len(found) == dp

    wait(all_up, 60, f"{dp} rank processes")
    return found


def stream_until_end(url: str, ended: threading.Event, started: threading.Event) -> None:
    body = {"prompt": "a long one", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 4:
                    started.set()
    finally:
        started.set()
        ended.set()


def one_fault(server: psutil.Process, url: str, sig: int, rank: int, dp: int) -> dict:
    """One fault with a stream in flight: seconds until the stream ended (its error event), until
    ``/health`` first answered 503 (None if not before the stream ended: the group may be back
    before the router's next look), and until a new completion succeeded."""
    victim = ranks(server, dp)[rank]
    ended, started = threading.Event(), threading.Event()
    threading.Thread(target=stream_until_end, args=(url, ended, started), daemon=True).start()
    started.wait(60)
    t0 = time.monotonic()
    victim.send_signal(sig)
    unhealthy = stream_ended = None
    while stream_ended is None and time.monotonic() - t0 < 4 * 60:
        if unhealthy is None and httpx.get(f"{url}/health", timeout=5).status_code == 503:
            unhealthy = time.monotonic() - t0
        if ended.is_set():
            stream_ended = time.monotonic() - t0
        time.sleep(0.05)
    wait(lambda: httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                            timeout=60).status_code == 200, 120, "a completion")
    served_again = time.monotonic() - t0
    if psutil.pid_exists(victim.pid) and sig == signal.SIGSTOP:
        victim.resume()
    return {"signal": signal.Signals(sig).name, "rank": rank, "stream_ended_s": stream_ended,
            "unhealthy_s": unhealthy, "served_again_s": served_again}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--step-timeout", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dp", type=int, default=2, help="engine instances (ranks); 1 on a single GPU")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    faults = [(sig, rank) for sig in (signal.SIGKILL, signal.SIGSTOP) for rank in reversed(range(args.dp))]
    faults *= args.repeats
    port = free_port()
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    cmd = [sys.executable, "-m", "epserve.cli", "serve", *([args.model] if args.model else []),
           "--dp", str(args.dp), "--device", args.device, "--port", str(port), "--dtype", dtype, "--num-blocks", "256",
           "--step-timeout", str(args.step_timeout), "--max-restarts", str(len(faults)), "--engine-wait-timeout", "120"]
    env = {**os.environ, "EPSERVE_THREADS_PER_RANK": "1", "EPSERVE_NO_PROGRESS": "1"}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "epserve-recovery.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        wait(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, 180, "the server")
        server = psutil.Process(proc.pid)
        for sig, rank in faults:
            rows.append(one_fault(server, url, sig, rank, args.dp))
            r = rows[-1]
            seen = "not seen" if r["unhealthy_s"] is None else f"{r['unhealthy_s']:.1f} s"
            print(f"{r['signal']:<8} rank {r['rank']}: stream ended after {r['stream_ended_s']:5.1f} s (/health 503: "
                  f"{seen}), served again after {r['served_again_s']:5.1f} s", flush=True)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
        log.close()
    print(f"SIGTERM: exit code {code}")
    for name in ("SIGKILL", "SIGSTOP"):
        sel = [r for r in rows if r["signal"] == name]
        print(f"{name}: stream ended median {statistics.median(r['stream_ended_s'] for r in sel):.1f} s, "
              f"served again median {statistics.median(r['served_again_s'] for r in sel):.1f} s "
              f"(max {max(r['served_again_s'] for r in sel):.1f} s) over {len(sel)} faults")
    if args.json:
        Path(args.json).write_text(json.dumps({"step_timeout_s": args.step_timeout, "faults": rows,
                                               "exit_code": code}, indent=2) + "\n")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
