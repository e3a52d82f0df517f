"""The router's memory while clients without the API key flood it: N connections, each sending a request
head without the key and a large body, all open and sending at once.

    .venv/bin/python benchmarks/router_abuse.py [--connections 1000] [--body-mib 4] [--max-connections N]
        [--src OTHER/src] [--json out.json]
    .venv/bin/python benchmarks/router_abuse.py --url http://127.0.0.1:8000 --pid ROUTER_PID

Without ``--url`` it starts ``epserve serve --dp 1`` on the built-in tiny model with an API key (from
``--src``'s tree if given, to measure another version) and measures its router process
(``epserve-router``). The flood, held open by construction rather than by timing:

1. every connection is opened (the server may refuse some at once: over ``--max-connections``);
2. every connection sends its head (``Authorization: Bearer wrong``) and all of its body but the last
   byte; once every send has finished (or the server closed that connection), the router's RSS is read:
   a server that buffers bodies holds all N of them now;
3. the last bytes are sent and every reply read (each within ``--reply-timeout``, never a hang).

Reported: the router's RSS idle, its peak during the flood (``VmHWM``, reset just before the flood
through ``/proc/PID/clear_refs``; else the highest of samples taken every 10 ms), at step 2, and after
the clients closed; and what the clients got: a 401 or 503 OpenAI error body, a closed connection
without a reply, anything else, or no answer in time. Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-router-abuse"


# ---- the router process --------------------------------------------------------------------------
def rss_kib(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def reset_peak(pid: int) -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS; False where the kernel does not allow it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler:
    """The highest VmRSS seen every 10 ms while running (where VmHWM cannot be reset)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._done = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.peak = max(self.peak, rss_kib(self.pid))
            self._done.wait(0.01)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _children(pid: int) -> list[int]:
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError):
            continue
    return out


def find_router(pid: int, timeout_s: float = 60.0) -> int:
    """The ``epserve-router`` process under ``pid`` (an ``epserve serve``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        todo = [pid]
        while todo:
            kid = todo.pop()
            with contextlib.suppress(OSError):
                if Path(f"/proc/{kid}/comm").read_text().strip() == "epserve-router":
                    return kid
            todo += _children(kid)
        time.sleep(0.1)
    raise RuntimeError(f"no epserve-router process under {pid}")


@contextlib.contextmanager
def serve(src: Path | None, log: Path, *args: str) -> Iterator[tuple[str, int]]:
    """``epserve serve --dp 1 *args`` with an API key on the tiny model (from ``src``, another tree's
    ``src/``, if given): yields (url, router pid)."""
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "key"
        key.write_text(API_KEY)
        with serving(["--dp", "1", "--api-key-file", str(key), "--dtype", "float32", *args], log, src=src,
                     environ={"EPSERVE_THREADS_PER_RANK": "1"}) as (proc, url):
            yield url, find_router(proc.pid)


# ---- the flood -----------------------------------------------------------------------------------
def classify(reply: bytes) -> str:
    """``401``/``503`` (an OpenAI error body with that status), ``closed`` (nothing) or ``other``."""
    if not reply:
        return "closed"
    head, _, body = reply.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1:2]
    try:
        error = json.loads(body)["error"]
        shaped = isinstance(error["message"], str) and {"type", "code"} <= error.keys()
    except (ValueError, KeyError, TypeError):
        shaped = False
    if shaped and status in ([b"401"], [b"503"]):
        return status[0].decode()
    return "other"


async def _read_reply(sock: socket.socket, timeout_s: float) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    with contextlib.suppress(OSError):  # a reset after the reply still leaves the reply readable
        async with asyncio.timeout(timeout_s):
            while chunk := await loop.sock_recv(sock, 65536):
                data += chunk
    return data


async def flood(host: str, port: int, connections: int, body_bytes: int, reply_timeout_s: float,
                at_held: callable) -> dict[str, int]:
    """The three steps of the module docstring; ``at_held()`` runs at step 2. Returns the outcome counts."""
    loop = asyncio.get_running_loop()
    body = b"x" * body_bytes
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer wrong\r\n"
            f"Content-Type: application/json\r\nContent-Length: {body_bytes}\r\n\r\n").encode()
    socks = []
    for _ in range(connections):  # 1. all open
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        socks.append(sock)
    counts = {"401": 0, "503": 0, "closed": 0, "other": 0, "no answer": 0, "send cut off": 0}

    async def send(sock: socket.socket, data: bytes | memoryview) -> bool:
        try:
            async with asyncio.timeout(reply_timeout_s):
                await loop.sock_sendall(sock, data)
            return True
        except (OSError, TimeoutError):  # the server closed it (or stopped reading: it holds nothing then)
            return False

    view = memoryview(body)
    sent = await asyncio.gather(*(send(s, head + body[:1]) for s in socks))  # 2. heads first, then bodies
    sent = await asyncio.gather(*(send(s, view[1:-1]) if ok else _false() for s, ok in zip(socks, sent)))
    at_held()
    counts["send cut off"] = sent.count(False)

    async def finish(sock: socket.socket, ok: bool) -> str:  # 3.
        if ok:
            await send(sock, view[-1:])
        try:
            reply = await _read_reply(sock, reply_timeout_s)
        except TimeoutError:
            return "no answer"
        return classify(reply)

    for outcome in await asyncio.gather(*(finish(s, ok) for s, ok in zip(socks, sent))):
        counts[outcome] += 1
    for sock in socks:
        sock.close()
    return counts


async def _false() -> bool:
    return False


def authorized_request(url: str, api_key: str) -> int:
    """A small authorized completion: the router still serves (its status)."""
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({"prompt": "hi", "max_tokens": 2}).encode(),
                                 headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def measure(url: str, pid: int, connections: int, body_bytes: int, api_key: str,
            reply_timeout_s: float = 60.0) -> dict:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    asyncio.run(flood(host, port, min(connections, 20), 64 << 10, reply_timeout_s, lambda: None))  # warm up
    authorized_request(url, api_key)
    idle = rss_kib(pid)
    held: dict[str, int] = {}
    peak_from_hwm = reset_peak(pid)
    start = time.monotonic()
    with Sampler(pid) as sampler:
        counts = asyncio.run(flood(host, port, connections, body_bytes, reply_timeout_s,
                                   lambda: held.update(rss=rss_kib(pid))))
    seconds = time.monotonic() - start
    peak = rss_kib(pid, "VmHWM") if peak_from_hwm else sampler.peak
    status = authorized_request(url, api_key)  # (also: the router has handled every close by now)
    after = rss_kib(pid)
    return {"connections": connections, "body_bytes": body_bytes, "seconds": round(seconds, 2),
            "idle_mib": idle / 1024, "peak_mib": peak / 1024, "held_mib": held["rss"] / 1024, "after_mib": after / 1024,
            "peak_over_idle_mib": (peak - idle) / 1024, "peak_from": "VmHWM" if peak_from_hwm else "sampled",
            "outcomes": counts, "authorized_after": status}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--body-mib", type=float, default=4.0)
    p.add_argument("--url", help="a running router (with --pid: its process) instead of starting epserve serve")
    p.add_argument("--pid", type=int, help="the router process of --url")
    p.add_argument("--api-key", default=API_KEY, help="the key of --url's router (for its authorized requests)")
    p.add_argument("--max-connections", type=int, default=None, help="passed to the epserve serve it starts")
    p.add_argument("--src", type=Path, help="another tree's src/ directory to run the server from")
    p.add_argument("--reply-timeout", type=float, default=60.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    body_bytes = int(args.body_mib * (1 << 20))
    if args.url is not None:
        if args.pid is None:
            p.error("--url needs --pid (the router process, to read its RSS)")
        result = measure(args.url, args.pid, args.connections, body_bytes, args.api_key, args.reply_timeout)
    else:
        with tempfile.TemporaryDirectory() as tmp, serve(args.src, Path(tmp) / "serve.log", "--num-blocks", "64",
                                                         "--max-model-len", "128",
                   *(["--max-connections", str(args.max_connections)] if args.max_connections is not None else [])) \
                as (url, pid):
            result = measure(url, pid, args.connections, body_bytes, API_KEY, args.reply_timeout)
    o = result["outcomes"]
    print(f"{result['connections']} connections x {result['body_bytes'] / (1 << 20):g} MiB without the API key, "
          f"{result['seconds']} s")
    print(f"{'router RSS':<28} {'MiB':>8}")
    for label, key in [("idle", "idle_mib"), (f"peak ({result['peak_from']})", "peak_mib"),
                       ("all open and sending", "held_mib"), ("after they closed", "after_mib")]:
        print(f"{label:<28} {result[key]:>8.1f}")
    print(f"{'peak over idle':<28} {result['peak_over_idle_mib']:>8.1f}")
    print("clients: " + ", ".join(f"{k} {v}" for k, v in o.items())
          + f"; an authorized request after: {result['authorized_after']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
