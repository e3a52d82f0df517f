"""Two hosts over a veth link (issue 26; docs/benchmarks.md): network namespaces joined by a veth pair
(tests/netns_harness.py; needs root). Measures

- start-up: ``epserve engine --dp 4`` over both hosts (``--nnodes 2``) against the same world on one
  host, from the commands' start to every instance's "listening" line;
- KV transfer over the link: 1000-token prompts prefilled on A (``--role prefill``) and decoded on B
  (``--role decode``), bytes over seconds from the router's ``epserve:kv_transfer_*``; the same pair on
  one host (loopback) for reference;
- the heartbeat's cost: CPU seconds per second of each process of the idle two-host world (psutil over
  ``--idle-seconds``), and a busy decode's step time (the mean gap between streamed tokens).

    sudo .venv/bin/python benchmarks/multihost.py [--rounds 3] [--idle-seconds 10]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from epserve.presets import make_checkpoint  # noqa: E402
from tests.netns_harness import Host, NsProc, inside, ns_proc, two_hosts  # noqa: E402
from tests.serve_harness import descendants, metric  # noqa: E402

TOKEN = "bench-token"
ARGS = ["--dtype", "float32", "--engine-token", TOKEN]
PORT = 50051


def wait_output(proc: NsProc, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output():
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(proc.output()[-3000:])
        time.sleep(0.02)


def wait_router(a: Host, url: str, engines: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with inside(a):
                if httpx.get(f"{url}/health", timeout=5).json().get("num_healthy_engines") == engines:
                    return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the router at {url} never saw {engines} engines")


def world(hosts: tuple[Host, ...], ckpt: Path, tmp: Path, tag: str, master_port: int) -> tuple[list[NsProc], float]:
    """A dp-4 world over ``hosts`` (one or two); its processes and its start-up seconds."""
    started = time.monotonic()
    n = len(hosts)
    nodes = [ns_proc(h, ["engine", str(ckpt), *ARGS, "--num-blocks", "64", "--max-model-len", "256", "--dp", "4",
                         "--nnodes", str(n), "--node-rank", str(i), "--master-addr", hosts[0].address,
                         "--master-port", str(master_port), "--engine-host", h.address, "--engine-port", str(PORT)],
                     tmp / f"{tag}-{i}.log") for i, h in enumerate(hosts)]
    per_host = 4 // n
    for i in range(4):
        wait_output(nodes[i // per_host], f"engine instance {i} listening on {hosts[i // per_host].address}:{PORT + i}")
    return nodes, time.monotonic() - started


def stop(procs: list[NsProc]) -> None:
    for proc in procs:
        proc.kill_all()


def startup(hosts: tuple[Host, Host], ckpt: Path, tmp: Path, rounds: int) -> None:
    times: dict[str, list[float]] = {"two hosts": [], "one host": []}
    for r in range(rounds):
        for label, hs in (("two hosts", hosts), ("one host", hosts[:1])):
            nodes, took = world(hs, ckpt, tmp, f"start{r}{len(hs)}", 29600 + 2 * r + len(hs))
            times[label].append(took)
            stop(nodes)
    for label, ts in times.items():
        print(f"start-up, dp-4 world on {label}: " + ", ".join(f"{t:.2f}" for t in ts)
              + f" s (mean {sum(ts) / len(ts):.2f})")


def kv_transfer(hosts: tuple[Host, Host], ckpt: Path, tmp: Path, rounds: int, link: bool) -> None:
    a, b = hosts
    decode_host = b if link else a
    ports = (50251, 50252) if link else (50261, 50262)
    http = 8011 if link else 8012
    blocks = ["--num-blocks", "512", "--max-model-len", "2048"]
    procs = [ns_proc(a, ["engine", str(ckpt), *ARGS, *blocks, "--role", "prefill", "--engine-host", a.address,
                         "--engine-port", str(ports[0])], tmp / f"prefill{link}.log"),
             ns_proc(decode_host, ["engine", str(ckpt), *ARGS, *blocks, "--role", "decode", "--engine-host",
                                   decode_host.address, "--engine-port", str(ports[1])], tmp / f"decode{link}.log")]
    try:
        procs.append(ns_proc(a, ["router", str(ckpt), "--port", str(http), "--engine-token", TOKEN, "--prefill",
                                 f"{a.address}:{ports[0]}", "--decode", f"{decode_host.address}:{ports[1]}"],
                             tmp / f"kvrouter{link}.log"))
        url = f"http://127.0.0.1:{http}"
        wait_router(a, url, 2)
        rng = random.Random(0)
        with inside(a):
            for r in range(rounds + 1):  # the first warms up
                if r == 1:
                    before = httpx.get(f"{url}/metrics", timeout=30).text
                prompt = [rng.randrange(10, 250) for _ in range(1000)]  # fresh ids: no prefix held on decode
                resp = httpx.post(f"{url}/v1/completions", timeout=120, json={
                    "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
                assert resp.status_code == 200, resp.text
            after = httpx.get(f"{url}/metrics", timeout=30).text
        moved = (metric(after, "epserve:kv_transfer_bytes_total", direction="received")
                 - metric(before, "epserve:kv_transfer_bytes_total", direction="received"))
        seconds = (metric(after, "epserve:kv_transfer_seconds_sum", role="decode")
                   - metric(before, "epserve:kv_transfer_seconds_sum", role="decode"))
        where = "over the veth link (prefill A, decode B)" if link else "on one host (loopback)"
        print(f"KV transfer {where}: {rounds} x 1000-token prompts, {moved / 1e6:.1f} MB in {seconds:.3f} s: "
              f"{moved / 1e6 / seconds:.0f} MB/s ({moved / rounds / 1e6:.2f} MB, {seconds / rounds * 1e3:.0f} ms each)")
    finally:
        stop(procs)


def heartbeat(hosts: tuple[Host, Host], ckpt: Path, tmp: Path, idle_seconds: float) -> None:
    a, _ = hosts
    nodes, _ = world(hosts, ckpt, tmp, "idle", 29700)
    router = ns_proc(a, ["router", str(ckpt), "--port", "8013", "--engine-token", TOKEN, *[
        x for i in range(4) for x in ["--engine", f"{hosts[i // 2].address}:{PORT + i}"]]], tmp / "idle-router.log")
    try:
        url = "http://127.0.0.1:8013"
        wait_router(a, url, 4)
        time.sleep(2.0)  # the world goes to sleep after its last step
        pids = [p for node in nodes for p in [node.pid, *descendants(node.pid)]]
        procs = {p: psutil.Process(p) for p in pids}
        start = {p: sum(proc.cpu_times()[:2]) for p, proc in procs.items()}
        time.sleep(idle_seconds)
        for p, proc in procs.items():
            cpu = sum(proc.cpu_times()[:2]) - start[p]
            print(f"idle {proc.name():16s} {cpu / idle_seconds * 1e3:7.2f} ms CPU per idle second")
        with inside(a), httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}) as s:
            stamps = [time.monotonic() for line in s.iter_lines() if line.startswith("data: {")]
        # (an event may carry more than one token: the step is the stream's span over its 199 later tokens)
        print(f"busy decode (dp-4 world over two hosts, one 200-token stream): {len(stamps)} events in "
              f"{stamps[-1] - stamps[0]:.2f} s, {(stamps[-1] - stamps[0]) / 199 * 1e3:.1f} ms a step")
    finally:
        stop([router, *nodes])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-seconds", type=float, default=10.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d, two_hosts() as hosts:
        tmp = Path(d)
        ckpt = make_checkpoint(tmp / "ckpt", preset="tiny", dtype="float32")
        startup(hosts, ckpt, tmp, args.rounds)
        for link in (True, False):
            kv_transfer(hosts, ckpt, tmp, args.rounds, link)
        heartbeat(hosts, ckpt, tmp, args.idle_seconds)


if __name__ == "__main__":
    main()
