"""The router's memory while clients that may send bodies (no API key set, the default, or key holders)
send many large ones at once: N connections, each a request head and a body of ``--body-mib``, all
open and sending together.

    .venv/bin/python benchmarks/router_bodies.py [--connections 400] [--body-mib 4] [--clients 1]
        [--api-key KEY] [--src OTHER/src] [--json out.json]
    .venv/bin/python benchmarks/router_bodies.py --url http://127.0.0.1:8000 --pid ROUTER_PID

Without ``--url`` it starts ``epserve serve --dp 1`` on the built-in tiny model (with ``--api-key`` if
given; from ``--src``'s tree if given, to measure another version) and measures its router process
(``epserve-router``). Each body is a valid completion request (``"prompt": "hi"``, one token) padded
with JSON whitespace to its size: what the router buffers, not what it generates, is measured. The
connections come from ``--clients`` loopback addresses (127.0.0.1, 127.0.0.2, ...: the router's
per-client budget sees that many clients). Held open by construction rather than by timing:

1. every connection is opened;
2. every connection sends its head and all of its body but the last byte (or until the router stops
   reading it); once every send has finished, the router's RSS is read: a router that buffers every
   body holds all N of them now;
3. the last bytes are sent and every reply read (each within ``--reply-timeout``, never a hang).

Reported: the router's RSS idle, its peak during the flood (``VmHWM``, reset just before it), at step
2, and after the clients closed; and what the clients got, by HTTP status (an OpenAI error body for
every error), a closed connection without a reply, or no answer in time. Figures go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serving  # noqa: E402
from router_abuse import Sampler, authorized_request, find_router, reset_peak, rss_kib  # noqa: E402

REQUEST = b'{"prompt": "hi", "max_tokens": 1}'


def request_bytes(host: str, body_bytes: int, api_key: str | None) -> bytes:
    """A whole HTTP request: a one-token completion whose body is padded with whitespace to ``body_bytes``."""
    body = REQUEST + b" " * max(0, body_bytes - len(REQUEST))
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def classify(reply: bytes) -> str:
    """The reply's status (``"200"``, ``"429"``, ...; an error's body must be OpenAI's, else ``other``),
    or ``closed`` (nothing)."""
    if not reply:
        return "closed"
    head, _, body = reply.partition(b"\r\n\r\n")
    status = (head.split(b" ", 2)[1:2] or [b"?"])[0].decode(errors="replace")
    if status.startswith("2"):
        return status
    try:
        error = json.loads(body)["error"]
        shaped = isinstance(error["message"], str) and {"type", "code"} <= error.keys()
    except (ValueError, KeyError, TypeError):
        shaped = False
    return status if shaped else "other"


async def _read_reply(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sends until it closes, or until one whole response with a Content-Length is in."""
    loop = asyncio.get_running_loop()
    data = b""
    with contextlib.suppress(OSError):  # a reset after the reply still leaves the reply readable
        async with asyncio.timeout(timeout_s):
            while chunk := await loop.sock_recv(sock, 65536):
                data += chunk
                head, sep, body = data.partition(b"\r\n\r\n")
                length = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:")]
                if sep and length and len(body) >= int(length[0]):
                    break
    return data


async def flood(host: str, port: int, connections: int, clients: int, body_bytes: int, api_key: str | None,
                reply_timeout_s: float, at_held) -> dict[str, int]:
    """The three steps of the module docstring; ``at_held()`` runs at step 2. Returns the outcome counts."""
    loop = asyncio.get_running_loop()
    request = memoryview(request_bytes(host, body_bytes, api_key))
    socks = []
    for i in range(connections):  # 1. all open, from `clients` loopback addresses
        sock = socket.socket()
        sock.setblocking(False)
        if clients > 1:
            n = i % clients + 1
            sock.bind((f"127.0.{n >> 8}.{n & 255}", 0))
        await loop.sock_connect(sock, (host, port))
        socks.append(sock)
    counts: dict[str, int] = {}

    async def send(sock: socket.socket, data: memoryview, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await loop.sock_sendall(sock, data)
            return True
        except (OSError, TimeoutError):  # the server closed it, or stopped reading (it holds no more of it)
            return False

    # 2. heads and bodies but their last byte; a send the router stopped reading gives up after 2 s
    sent = await asyncio.gather(*(send(s, request[:-1], 2.0 + connections / 100) for s in socks))
    at_held()
    counts["send cut off"] = sent.count(False)

    async def finish(sock: socket.socket, ok: bool) -> str:  # 3.
        if ok:
            await send(sock, request[-1:], reply_timeout_s)
        try:
            reply = await _read_reply(sock, reply_timeout_s)
        except TimeoutError:
            return "no answer"
        return classify(reply)

    for outcome in await asyncio.gather(*(finish(s, ok) for s, ok in zip(socks, sent))):
        counts[outcome] = counts.get(outcome, 0) + 1
    for sock in socks:
        sock.close()
    return counts


def measure(url: str, pid: int, connections: int, clients: int, body_bytes: int, api_key: str | None,
            reply_timeout_s: float = 120.0) -> dict:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    asyncio.run(flood(host, port, min(connections, 8), 1, 256 << 10, api_key, reply_timeout_s, lambda: None))  # warm
    authorized_request(url, api_key or "")
    idle = rss_kib(pid)
    held: dict[str, int] = {}
    peak_from_hwm = reset_peak(pid)
    start = time.monotonic()
    with Sampler(pid) as sampler:
        counts = asyncio.run(flood(host, port, connections, clients, body_bytes, api_key, reply_timeout_s,
                                   lambda: held.update(rss=rss_kib(pid))))
    seconds = time.monotonic() - start
    peak = rss_kib(pid, "VmHWM") if peak_from_hwm else sampler.peak
    status = authorized_request(url, api_key or "")  # (also: the router has handled every close by now)
    after = rss_kib(pid)
    return {"connections": connections, "clients": clients, "body_bytes": body_bytes, "seconds": round(seconds, 2),
            "idle_mib": idle / 1024, "peak_mib": peak / 1024, "held_mib": held["rss"] / 1024, "after_mib": after / 1024,
            "peak_over_idle_mib": (peak - idle) / 1024, "after_over_idle_mib": (after - idle) / 1024,
            "peak_from": "VmHWM" if peak_from_hwm else "sampled", "outcomes": counts, "request_after": status}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--connections", type=int, default=400)
    p.add_argument("--clients", type=int, default=1, help="loopback source addresses the connections come from")
    p.add_argument("--body-mib", type=float, default=4.0)
    p.add_argument("--api-key", default=None, help="serve with this key and send it (default: no key, as served "
                   "by default)")
    p.add_argument("--url", help="a running router (with --pid: its process) instead of starting epserve serve")
    p.add_argument("--pid", type=int, help="the router process of --url")
    p.add_argument("--src", type=Path, help="another tree's src/ directory to run the server from")
    p.add_argument("--serve-arg", action="append", default=[], help="more epserve serve flags (repeatable)")
    p.add_argument("--reply-timeout", type=float, default=120.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    body_bytes = int(args.body_mib * (1 << 20)) - 64  # the whole request under the default 4 MiB limit
    if not 1 <= args.clients <= 65000:
        p.error("--clients must be in [1, 65000]")
    if args.url is not None:
        if args.pid is None:
            p.error("--url needs --pid (the router process, to read its RSS)")
        result = measure(args.url, args.pid, args.connections, args.clients, body_bytes, args.api_key,
                         args.reply_timeout)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            key = []
            if args.api_key:
                (Path(tmp) / "key").write_text(args.api_key)
                key = ["--api-key-file", str(Path(tmp) / "key")]
            with serving(["--dp", "1", "--dtype", "float32", "--num-blocks", "64", "--max-model-len", "128", *key,
                          *[a for arg in args.serve_arg for a in arg.split()]], Path(tmp) / "serve.log",
                         src=args.src, environ={"EPSERVE_THREADS_PER_RANK": "1"}) as (proc, url):
                result = measure(url, find_router(proc.pid), args.connections, args.clients, body_bytes,
                                 args.api_key, args.reply_timeout)
    o = result["outcomes"]
    print(f"{result['connections']} connections from {result['clients']} client address(es) x "
          f"{result['body_bytes'] / (1 << 20):.2f} MiB bodies, {result['seconds']} s")
    print(f"{'router RSS':<28} {'MiB':>8}")
    for label, k in [("idle", "idle_mib"), (f"peak ({result['peak_from']})", "peak_mib"),
                     ("all open and sending", "held_mib"), ("after they closed", "after_mib")]:
        print(f"{label:<28} {result[k]:>8.1f}")
    print(f"{'peak over idle':<28} {result['peak_over_idle_mib']:>8.1f}")
    print(f"{'after over idle':<28} {result['after_over_idle_mib']:>8.1f}")
    print("clients got: " + ", ".join(f"{k} {v}" for k, v in sorted(o.items()))
          + f"; a request after: {result['request_after']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
