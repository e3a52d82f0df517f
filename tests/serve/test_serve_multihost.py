"""Serving across two "hosts" (network namespaces joined by a veth pair, tests/netns_harness.py): a dp-4
world of two ranks a host behind a router on host A serves the offline text on every instance; a
prefill instance on A sends its KV over the link to a decode instance on B; a rank of B killed while
the world sleeps, or all of B's ranks frozen, or a rank killed mid-stream: both hosts' ``epserve
engine`` exit non-zero within the step timeout and a few seconds, the router answers 503 meanwhile
and serves again once both hosts are started again; every process listens on its host's own veth
address or loopback, never on a wildcard; the same world under torchrun serves the same text."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from epserve import LLM, SamplingParams
from tests.netns_harness import Host, NsProc, counter, inside, listening, ns_proc, two_hosts
from tests.serve_harness import alive, descendants, freeze, metric, named, thaw, wait_output

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKEN = "multihost-token"
ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256", "--engine-token", TOKEN]
STEP_TIMEOUT = 3.0
EXIT_SLACK = 7.0  # seconds past the step timeout a host may take to notice, tear down and exit
PORT, TORCHRUN_PORT, PREFILL_PORT, DECODE_PORT = 50051, 50151, 50251, 50252
ROUTER, DISAGG_ROUTER, TORCHRUN_ROUTER = 8000, 8001, 8002
PROMPT = "Expert parallelism over a link"
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)




def get(host: Host, url: str, timeout: float = 30.0) -> httpx.Response:
    with inside(host):
        return httpx.get(url, timeout=timeout)


def complete(host: Host, url: str, prompt: str | list[int] = PROMPT, timeout: float = 60.0) -> httpx.Response:
    with inside(host):
        return httpx.post(f"{url}/v1/completions", timeout=timeout, json={
            "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})


def wait_healthy(host: Host, url: str, engines: int, router: NsProc, timeout: float = 60.0) -> None:
    """Until the router at ``url`` (in ``host``) counts ``engines`` healthy instances."""
    deadline = time.monotonic() + timeout
    while True:
        assert router.proc.poll() is None, router.output()[-3000:]
        try:
            if get(host, f"{url}/health", 5).json().get("num_healthy_engines") == engines:
                return
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, router.output()[-3000:]
        time.sleep(0.1)


class World:
    """``epserve engine CKPT --dp 4 --nnodes 2`` on each host (ranks 0, 1 on A; 2, 3 on B), started
    again by :meth:`ensure` when a test has brought it down (a fresh rendezvous port each time)."""

    def __init__(self, hosts: tuple[Host, Host], ckpt: Path, tmp: Path) -> None:
        self.hosts, self.ckpt, self.tmp = hosts, ckpt, tmp
        self.nodes: list[NsProc] = []
        self.generation = 0
        self.startup_s = 0.0

    def start(self) -> None:
        self.generation += 1
        a = self.hosts[0]
        started = time.monotonic()
        self.nodes = [ns_proc(h, ["engine", str(self.ckpt), *ENGINE_ARGS, "--dp", "4", "--nnodes", "2", "--node-rank",
                                  str(i), "--master-addr", a.address, "--master-port", str(29500 + self.generation),
                                  "--engine-host", h.address, "--engine-port", str(PORT), "--step-timeout",
                                  str(STEP_TIMEOUT)], self.tmp / f"node{i}-{self.generation}.log")
                      for i, h in enumerate(self.hosts)]
        try:
            for i in range(4):
                host = self.hosts[i // 2]
                wait_output(self.nodes[i // 2], f"engine instance {i} listening on {host.address}:{PORT + i}")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        print(f"dp-4 world over two hosts started in {self.startup_s:.1f} s")

    def up(self) -> bool:
        return bool(self.nodes) and all(node.proc.poll() is None for node in self.nodes)

    def ensure(self) -> None:
        if not self.up():
            self.stop()
            self.start()

    def ranks(self, node: int) -> list[int]:
        """The pids of the rank processes of host ``node`` (global ranks 2 node, 2 node + 1)."""
        names = [Path(f"/proc/{pid}/comm").read_text().strip() for pid in descendants(self.nodes[node].pid)]
        prefix = next(n for n in names if "rank" in n).rsplit("rank", 1)[0] + "rank"
        return named(self.nodes[node].pid, [f"{prefix}{2 * node}", f"{prefix}{2 * node + 1}"])

    def exits(self, since: float) -> list[float]:
        """Seconds from ``since`` to each host's exit; each must exit non-zero, in time."""
        took: list[float | None] = [None, None]
        deadline = since + STEP_TIMEOUT + EXIT_SLACK
        while None in took:
            for i, node in enumerate(self.nodes):
                if took[i] is None and node.proc.poll() is not None:
                    took[i] = time.monotonic() - since
            assert time.monotonic() < deadline, f"exits so far {took}:\n" + "\n".join(
                n.output()[-2000:] for n in self.nodes)
            time.sleep(0.02)
        codes = [node.wait(5) for node in self.nodes]
        assert all(code != 0 for code in codes), codes
        return [t for t in took if t is not None]

    def stop(self) -> None:
        for node in self.nodes:
            node.kill_all()


@pytest.fixture(scope="module")
def hosts():
    with two_hosts() as pair:
        yield pair


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")


@pytest.fixture(scope="module")
def offline(ckpt) -> LLM:
    return LLM(ckpt, dtype="float32", num_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def world(hosts, ckpt, tmp_path_factory):
    w = World(hosts, ckpt, tmp_path_factory.mktemp("world"))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def router(hosts, ckpt, world, tmp_path_factory):
    """A router on A over the world's four instances (never restarted by a test); its URL."""
    a, b = hosts
    world.ensure()
    proc = ns_proc(a, ["router", str(ckpt), "--port", str(ROUTER), "--policy", "round_robin", "--engine-token", TOKEN,
                       "--engine-wait-timeout", "2", *[x for i in range(4) for x in
                                                       ["--engine", f"{hosts[i // 2].address}:{PORT + i}"]]],
                   tmp_path_factory.mktemp("router") / "router.log")
    url = f"http://127.0.0.1:{ROUTER}"
    try:
        wait_healthy(a, url, 4, proc)
        yield url, proc
    finally:
        proc.kill_all()


def serves_the_offline_text_on_every_instance(a: Host, url: str, want: str) -> None:
    before = get(a, f"{url}/metrics").text
    texts = []
    for _ in range(4):  # round robin: once on each instance, two on each host
        r = complete(a, url)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    after = get(a, f"{url}/metrics").text
    assert texts == [want] * 4
    served = [metric(after, "epserve:router_requests_total", engine=str(i))
              - metric(before, "epserve:router_requests_total", engine=str(i)) for i in range(4)]
    assert all(n >= 1 for n in served), served


def test_a_dp4_world_over_two_hosts_serves_the_offline_text(hosts, world, router, offline):
    world.ensure()
    wait_healthy(hosts[0], router[0], 4, router[1])
    serves_the_offline_text_on_every_instance(hosts[0], router[0], offline.generate([PROMPT], GREEDY)[0].text)


def test_every_process_listens_on_its_hosts_own_address(hosts, world, router):
    """gRPC leaders, the rendezvous store, gloo and the bell on the host's veth address; the router's HTTP
    on loopback (its default ``--host``); nothing on 0.0.0.0 or ::."""
    world.ensure()
    wait_healthy(hosts[0], router[0], 4, router[1])
    for host in hosts:
        found = listening(host)
        print(host.namespace, sorted((x.address, x.port, x.pids) for x in found))
        assert found, host
        wild = [x for x in found if x.address in ("0.0.0.0", "::", "*")]
        assert not wild, wild
        assert {x.address for x in found} <= {host.address, "127.0.0.1"}, found
        own = {x.port for x in found if x.address == host.address}
        assert {PORT + 2 * (host is hosts[1]), PORT + 1 + 2 * (host is hosts[1])} <= own, found
    loopback = {x.port for x in listening(hosts[0]) if x.address == "127.0.0.1"}
    assert loopback == {ROUTER}, listening(hosts[0])


def test_a_rank_killed_while_idle_stops_both_hosts_and_the_router_serves_after_a_restart(
        hosts, world, router, offline):
    a, _ = hosts
    url, router_proc = router
    world.ensure()
    wait_healthy(a, url, 4, router_proc)
    killed = time.monotonic()
    os.kill(world.ranks(1)[1], signal.SIGKILL)
    took = world.exits(killed)
    print(f"idle death: host A exited {took[0]:.2f} s, host B {took[1]:.2f} s after the kill")
    assert "epserve: error:" in world.nodes[0].output() or "lost" in world.nodes[0].output().lower()
    waited = time.monotonic()
    r = complete(a, url, timeout=30)  # no instance left: after --engine-wait-timeout, a 503, not a hang
    assert r.status_code == 503, r.text
    print(f"the router answered {r.status_code} in {time.monotonic() - waited:.2f} s")
    world.start()
    wait_healthy(a, url, 4, router_proc)
    serves_the_offline_text_on_every_instance(a, url, offline.generate([PROMPT], GREEDY)[0].text)


def test_host_b_frozen_while_idle_stops_both_hosts(hosts, world, router):
    world.ensure()
    wait_healthy(hosts[0], router[0], 4, router[1])
    ranks = world.ranks(1)
    freeze(ranks)
    frozen_at = time.monotonic()
    try:
        took = world.exits(frozen_at)
    finally:
        thaw(ranks)
    print(f"idle hang: host A exited {took[0]:.2f} s, host B {took[1]:.2f} s after B's ranks froze")
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks):  # B's supervisor does not leave its hung ranks behind
        assert time.monotonic() < deadline, [pid for pid in ranks if alive(pid)]
        time.sleep(0.05)


def test_a_rank_killed_mid_stream_ends_the_stream_with_an_error_and_stops_both_hosts(hosts, world, router):
    a, _ = hosts
    url, router_proc = router
    world.ensure()
    wait_healthy(a, url, 4, router_proc)
    everyone = world.ranks(0) + world.ranks(1)
    events: list[dict] = []
    held = threading.Event()

    def read() -> None:
        with inside(a), httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:  # every rank stopped: the request stays in flight, however fast
                        freeze(everyone)
                        held.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert held.wait(60), events
        assert "finish_reason" not in json.dumps(events[-1]) or events[-1]["choices"][0]["finish_reason"] is None
        killed = time.monotonic()
        os.kill(everyone[3], signal.SIGKILL)
    finally:
        thaw(everyone)
    took = world.exits(killed)
    print(f"busy death: host A exited {took[0]:.2f} s, host B {took[1]:.2f} s after the kill")
    reader.join(30)
    assert not reader.is_alive()
    assert "error" in events[-1], events[-3:]


def test_kv_crosses_the_link_prefill_on_a_decode_on_b(hosts, ckpt, offline, tmp_path):
    a, b = hosts
    procs = [ns_proc(a, ["engine", str(ckpt), *ENGINE_ARGS, "--role", "prefill", "--engine-host", a.address,
                         "--engine-port", str(PREFILL_PORT)], tmp_path / "prefill.log"),
             ns_proc(b, ["engine", str(ckpt), *ENGINE_ARGS, "--role", "decode", "--engine-host", b.address,
                         "--engine-port", str(DECODE_PORT)], tmp_path / "decode.log")]
    try:
        procs.append(ns_proc(a, ["router", str(ckpt), "--port", str(DISAGG_ROUTER), "--engine-token", TOKEN,
                                 "--prefill", f"{a.address}:{PREFILL_PORT}", "--decode", f"{b.address}:{DECODE_PORT}"],
                             tmp_path / "router.log"))
        url = f"http://127.0.0.1:{DISAGG_ROUTER}"
        wait_healthy(a, url, 2, procs[2], timeout=90)
        prompt = list(range(5, 85))  # 80 tokens: 5 blocks of KV
        before, rx = get(a, f"{url}/metrics").text, counter(b, "rx_bytes")
        r = complete(a, url, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == offline.generate([prompt], GREEDY)[0].text
        after, received_on_b = get(a, f"{url}/metrics").text, counter(b, "rx_bytes") - rx
        moved = {d: metric(after, "epserve:kv_transfer_bytes_total", direction=d)
                 - metric(before, "epserve:kv_transfer_bytes_total", direction=d) for d in ("sent", "received")}
        assert moved["sent"] == moved["received"] > 0, moved
        assert received_on_b >= moved["received"], (received_on_b, moved)  # it came in through B's veth
        assert metric(after, "epserve:kv_transfer_seconds_count", role="decode") >= 1
    finally:
        for proc in procs:
            proc.kill_all()


def test_the_world_under_torchrun_serves_the_offline_text(hosts, ckpt, offline, tmp_path):
    a, b = hosts
    nodes = [ns_proc(h, ["-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node",
                         "2", "--master-addr", a.address, "--master-port", "29400", "-m", "epserve.cli", "engine",
                         str(ckpt), *ENGINE_ARGS, "--dp", "4", "--engine-host", h.address, "--engine-port",
                         str(TORCHRUN_PORT)], tmp_path / f"torchrun{i}.log", module=False)
             for i, h in enumerate(hosts)]
    procs = list(nodes)
    try:
        for i in range(4):
            host = hosts[i // 2]
            wait_output(nodes[i // 2], f"engine instance {i} serving gRPC on {host.address}:{TORCHRUN_PORT + i}")
        procs.append(ns_proc(a, ["router", str(ckpt), "--port", str(TORCHRUN_ROUTER), "--policy", "round_robin",
                                 "--engine-token", TOKEN,
                                 *[x for i in range(4)
                                   for x in ["--engine", f"{hosts[i // 2].address}:{TORCHRUN_PORT + i}"]]],
                             tmp_path / "router.log"))
        url = f"http://127.0.0.1:{TORCHRUN_ROUTER}"
        wait_healthy(a, url, 4, procs[2])
        serves_the_offline_text_on_every_instance(a, url, offline.generate([PROMPT], GREEDY)[0].text)
    finally:
        for proc in procs:
            proc.kill_all()
