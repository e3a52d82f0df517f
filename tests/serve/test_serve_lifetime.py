"""A real ``epserve serve`` and the lifetimes of its processes (issue 25):

- the engines' addresses reach the supervisor over the ranks' pipes, never through the rendezvous
  store (where any local process could write a fake one first);
- a restart whose old gRPC port was taken meanwhile listens on a fresh one and the router follows;
- a hung (SIGSTOPped) router is replaced on the same HTTP port; past ``--max-restarts`` a dead
  router ends the command with one line naming it;
- a rank that dies after listening but before the router is healthy is restarted like any other;
  past the limit the final error names the rank that died, not the peer whose collective failed;
- SIGKILLing the supervisor leaves no process of its tree and nothing listening.

Each fault is held by construction: the supervisor, router or forkserver frozen (SIGSTOP) while the
test sets things up, never a race against the machine's speed."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch.distributed as dist

from epserve.parallel.launch import free_port
from tests.serve_harness import Proc, Stream, alive, descendants, freeze, frozen, named, thaw, wait_http_ok

pytestmark = pytest.mark.slow

STEP_TIMEOUT = 3.0
ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")


def _serve(ckpt: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(["serve", str(ckpt), "--port", str(port), "--step-timeout", str(STEP_TIMEOUT),
                 "--engine-wait-timeout", "60", *ENGINE_ARGS, *args], log, env)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    proc, url = _serve(ckpt, tmp_path_factory.mktemp("lifetime") / "serve.log", "--dp", "2", "--max-restarts", "2")
    try:
        wait_http_ok(f"{url}/health", proc)
        yield proc, url
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


def complete(url: str, prompt: str, timeout: float = 90) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=timeout)


def wait_output(proc: Proc, pattern: str, timeout: float = 60.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while (match := re.search(pattern, proc.output())) is None:
        assert time.monotonic() < deadline, f"no {pattern!r} in:\n{proc.output()[-3000:]}"
        time.sleep(0.05)
    return match


def wait_healthy(url: str, proc: Proc, timeout: float = 60.0, engines: int = 1) -> None:
    """Until the router's /health is 200 with at least ``engines`` healthy engine instances."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200 and r.json()["num_healthy_engines"] >= engines:
                return
        except httpx.HTTPError:
            pass
        assert proc.proc.poll() is None, proc.output()[-3000:]
        assert time.monotonic() < deadline, f"/health not 200 within {timeout} s:\n{proc.output()[-3000:]}"
        time.sleep(0.1)


def grpc_port(proc: Proc, dp_rank: int) -> int:
    """Where instance ``dp_rank`` last said it listens."""
    found = re.findall(rf"engine instance {dp_rank} serving gRPC on 127\.0\.0\.1:(\d+)", proc.output())
    assert found, proc.output()[-3000:]
    return int(found[-1])


def take_port(port: int, timeout: float = 10.0) -> socket.socket:
    """A plain socket listening on ``port`` (SO_REUSEADDR, as servers bind), once the connections of the
    process that died there have closed enough to let it (FIN-WAIT-1 holds the port a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_server(("127.0.0.1", port))
        except OSError:
            assert time.monotonic() < deadline, f"port {port} stayed busy"
            time.sleep(0.01)


def forkserver(proc: Proc) -> int:
    """The forkserver the supervisor started (its ranks, forked from it, show the same command line)."""
    [pid] = [p for p in descendants(proc.pid) if alive(p) and psutil.Process(p).ppid() == proc.pid
             and "multiprocessing.forkserver" in " ".join(psutil.Process(p).cmdline())]
    return pid


def listening_ports(pids: list[int]) -> set[int]:
    ports = set()
    for pid in pids:
        try:
            ports |= {c.laddr.port for c in psutil.Process(pid).net_connections("inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            continue
    return ports


def no_traceback(proc: Proc) -> None:
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


def exits_with_one_line(proc: Proc, pids: list[int]) -> str:
    """The command exits 1 with no traceback, leaving none of ``pids``; its last line (the error)."""
    assert proc.wait(60) == 1, proc.output()[-3000:]
    no_traceback(proc)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]
    return proc.output().strip().splitlines()[-1]


# ---- one server: a restart off a taken port, a hung router, then SIGTERM -------------------------
def test_a_restart_whose_port_was_taken_moves_and_the_router_follows(server):
    """Rank 1 is SIGKILLed and its gRPC port taken by a plain listening socket while the supervisor is
    frozen (so the port is taken before any restart, by construction): the restarted instance 1
    listens elsewhere, the router is told, and the next request succeeds (once it crashed the
    server: rank 0, the store host, died on the bind failure and the supervisor's store read raised)."""
    proc, url = server
    old_port = grpc_port(proc, 1)
    [rank1] = proc.ranks(2)[1:]
    with frozen([proc.pid]):
        killed = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        while alive(rank1):
            time.sleep(0.005)
        squatter = take_port(old_port)
    try:
        r = complete(url, "after the move")  # waits for the restarted group if it must
        served = time.monotonic() - killed
        assert r.status_code == 200, r.text
        wait_healthy(url, proc, 30, engines=2)  # instance 1 where it moved
        print(f"served again {served:.1f} s after SIGKILL, its old port taken")
        moved = wait_output(proc, r"engine instance 1 moved from 127\.0\.0\.1:(\d+) to 127\.0\.0\.1:(\d+)")
        assert int(moved[1]) == old_port and int(moved[2]) != old_port
        assert grpc_port(proc, 1) == int(moved[2])
        assert "engine 1 moved from" in proc.output()  # the router's side
        assert "restarting it (1 of 2)" in proc.output()
        no_traceback(proc)
    finally:
        squatter.close()


def test_a_hung_router_is_replaced_on_the_same_port(server):
    """The router is SIGSTOPped: the supervisor gets no /health answer for the step timeout, kills it
    and starts another on the same HTTP port with the engines' current addresses (one had moved)."""
    proc, url = server
    [router] = named(proc.pid, ["epserve-router"])
    freeze([router])
    stopped = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while alive(router):  # the supervisor kills it (SIGKILL ends a stopped process)
            assert time.monotonic() < deadline, proc.output()[-3000:]
            time.sleep(0.05)
        replaced = time.monotonic() - stopped
    finally:
        thaw([router])
    wait_healthy(url, proc, 60, engines=2)  # instance 1 where it moved
    assert complete(url, "through the new router").status_code == 200
    [new_router] = named(proc.pid, ["epserve-router"])
    assert new_router != router
    print(f"hung router replaced after {replaced:.1f} s")
    assert replaced < STEP_TIMEOUT + 20  # (silence counts from its last answer, up to a second before the freeze)
    assert re.search(r"the router has not answered \S+/health for \d+ s \(hung\); restarting it \(1 of 2\)",
                     proc.output()), proc.output()[-3000:]
    no_traceback(proc)


def test_sigterm_after_the_restarts_exits_0_and_leaves_no_process(server):
    proc, url = server
    assert complete(url, "one more").status_code == 200
    pids = descendants(proc.pid)
    proc.signal(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()[-3000:]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


# ---- start-up: a rank dies after listening, before the router is healthy; then past the limit ---
def test_a_rank_dying_before_the_router_is_healthy_is_restarted_and_the_last_death_is_named(ckpt, tmp_path):
    """The router is frozen as soon as it exists (the supervisor starts it once every leader has said
    it listens), before it can have started its app, so it cannot become healthy; rank 1 is SIGKILLed.
    The supervisor restarts the group like any later failure while the router waits (it used to wait
    120 s for the router, then exit 1), and once thawed the router serves. Then, with no restart left,
    rank 1 is killed again during a stream while the forkserver (which reports rank 1's exit) is frozen,
    so rank 0's failed collective reaches the supervisor first: the final error still names rank 1."""
    proc, url = _serve(ckpt, tmp_path / "serve.log", "--dp", "2", "--max-restarts", "1")
    try:
        [rank1, router] = named(proc.pid, ["epserve-rank1", "epserve-router"], timeout=120)
        with frozen([router]):
            assert "Application startup complete" not in proc.output(), "the router started before it was frozen"
            os.kill(rank1, signal.SIGKILL)
            wait_output(proc, r"engine group serving again after")
        wait_healthy(url, proc, 60)
        assert "restarting it (1 of 1)" in proc.output(), proc.output()[-3000:]
        assert re.search(r"engine group failed: rank 1 died with exit code -9 \(SIGKILL\)", proc.output())
        assert complete(url, "after a start-up failure").status_code == 200
        assert "did not become healthy" not in proc.output()
        no_traceback(proc)

        pids = descendants(proc.pid)
        rank1 = proc.ranks(2)[1]
        Stream(url, max_tokens=400)  # both ranks step in lockstep: rank 0 is in a collective with rank 1
        server = forkserver(proc)
        freeze([server])
        try:
            os.kill(rank1, signal.SIGKILL)
            wait_output(proc, r"stopping the other ranks")
        finally:
            thaw([server])
        last = exits_with_one_line(proc, pids)
        assert last.startswith("epserve: error: rank 1 died"), last
        assert "(restarts: 1 of --max-restarts 1)" in last, last
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()


# ---- the supervisor SIGKILLed -------------------------------------------------------------------
def test_killing_the_supervisor_leaves_no_process_and_nothing_listening(ckpt, tmp_path):
    """The ranks are forked by the forkserver (not children of the supervisor): they used to keep
    serving, with the forkserver and the resource tracker, long after the supervisor died."""
    proc, url = _serve(ckpt, tmp_path / "serve.log", "--dp", "2")
    pids: list[int] = []
    try:
        wait_http_ok(f"{url}/health", proc)
        named(proc.pid, ["epserve-rank0", "epserve-rank1", "epserve-router"])
        pids = descendants(proc.pid)
        assert len(pids) >= 5  # two ranks, the router, the forkserver, the resource tracker
        ports = listening_ports(pids)
        assert len(ports) >= 4  # HTTP, two gRPC ports, the store (and gloo's)
        proc.proc.kill()
        killed = time.monotonic()
        proc.wait(10)
        while [p for p in pids if alive(p)] and time.monotonic() - killed < 15:
            time.sleep(0.1)
        left = [(p, psutil.Process(p).name()) for p in pids if alive(p)]
        assert not left, left
        print(f"every process gone {time.monotonic() - killed:.1f} s after SIGKILL")
        still = {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN} & ports
        assert not still, still
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()
        for pid in pids:  # (orphans, were the test to fail)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- addresses over the pipes; a dead router past the limit -------------------------------------
def test_addresses_come_over_the_pipes_not_the_store_and_a_dead_router_past_the_limit_ends_it(ckpt, tmp_path):
    """This test hosts the rendezvous store (the ranks only connect to it) and writes a fake
    ``engines/0`` there before the server starts, pointing at a socket it listens on: the supervisor
    and the router must use the address the leader sent over its pipe, and nobody connects to the
    fake one (the store key is not even overwritten: nothing writes it any more). Then the router is
    SIGKILLed with --max-restarts 0: the command exits 1 with one line naming the router."""
    master = free_port()
    store = dist.TCPStore("127.0.0.1", master, is_master=True, wait_for_workers=False)
    keys = dist.PrefixStore("epserve/0", store)
    fake = socket.create_server(("127.0.0.1", 0))
    fake_address = f"127.0.0.1:{fake.getsockname()[1]}"
    keys.set("engines/0", fake_address)
    proc, url = _serve(ckpt, tmp_path / "serve.log", "--dp", "1", "--max-restarts", "0", "--master-port",
                       str(master), env={"TORCHELASTIC_USE_AGENT_STORE": "true"})
    try:
        wait_healthy(url, proc, 120)
        assert complete(url, "over the pipe").status_code == 200
        real = wait_output(proc, r"serving .* on http://\S+ \(engines: (\S+)\)")[1]
        assert real != fake_address and real == f"127.0.0.1:{grpc_port(proc, 0)}"
        assert keys.get("engines/0").decode() == fake_address
        assert not select.select([fake], [], [], 0)[0], "something connected to the fake address"

        pids = descendants(proc.pid)
        [router] = named(proc.pid, ["epserve-router"])
        os.kill(router, signal.SIGKILL)
        last = exits_with_one_line(proc, pids)
        assert last == "epserve: error: the router exited with code -9 (restarts: 0 of --max-restarts 0)", last
    finally:
        if proc.proc.poll() is None:
            proc.kill_all()
        fake.close()
        del keys, store
