"""Deployments across processes: engine instances started per "host" (loopback) with ``epserve engine``
and a separate ``epserve router``; an engine going down is routed around; none left gives 503."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from tests.serve_harness import Proc, alive, descendants, metric, named, wait_http_ok, wait_output

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")




def _stop(procs: list[Proc], timeout: float = 60.0) -> list[int]:
    pids = {p for proc in procs for p in [proc.pid, *descendants(proc.pid)]}
    for proc in procs:
        proc.signal(signal.SIGTERM)
    codes = [proc.wait(timeout) for proc in procs]
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "processes left behind"
    return codes


def _complete(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})


def test_engines_on_two_hosts_behind_a_router(ckpt, tmp_path):
    """`epserve engine --nnodes 2` on each "host" (one EP world of 2 ranks = 2 instances), then
    `epserve router --engine ... --engine ...`, all with one engine token: same greedy text as one
    process. Then one host hangs (its rank SIGSTOPped) while a request runs on the other: both hosts'
    `epserve engine` exit non-zero within the step timeout (for their own supervisors to restart them),
    leaving nothing running, and the router still stops cleanly."""
    master, engine_port, http_port = free_port(), free_port(), free_port()
    common = ["engine", str(ckpt), *ENGINE_ARGS, "--dp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master), "--engine-port", str(engine_port), "--step-timeout", "3",
              "--engine-token", "t0ken"]
    nodes = [Proc([*common, "--node-rank", str(i)], tmp_path / f"node{i}.log") for i in range(2)]
    procs = list(nodes)
    try:
        for i, node in enumerate(nodes):
            wait_output(node, f"engine instance {i} listening on 127.0.0.1:{engine_port + i}")
        router = Proc(["router", str(ckpt), "--port", str(http_port), "--policy", "round_robin",
                       "--engine-wait-timeout", "2", "--engine-token", "t0ken",
                       "--engine", f"127.0.0.1:{engine_port}", "--engine", f"127.0.0.1:{engine_port + 1}"],
                      tmp_path / "router.log")
        procs.append(router)
        url = f"http://127.0.0.1:{http_port}"
        wait_http_ok(f"{url}/health", router)
        want = LLM(ckpt, dtype="float32", num_blocks=64).generate(
            ["Expert parallelism"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
        for _ in range(2):  # round robin: once on each instance
            r = _complete(url, "Expert parallelism")
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
        m = httpx.get(f"{url}/metrics").text
        assert metric(m, "epserve:router_requests_total", engine="0") >= 1
        assert metric(m, "epserve:router_requests_total", engine="1") >= 1
        pids = {p for node in nodes for p in [node.pid, *descendants(node.pid)]}
        [rank1] = named(nodes[1].pid, ["epserve-rank1"])
        os.kill(rank1, signal.SIGSTOP)  # host 1's rank hangs
        hung = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            late = pool.submit(_complete, url, "x", 50)  # its step waits on the hung host, then fails
            codes = [node.wait(30) for node in nodes]
            exited = time.monotonic() - hung
            assert late.result().status_code == 503, late.result().text  # after --engine-wait-timeout
        assert all(code != 0 for code in codes), codes
        assert exited < 15, exited  # step timeout 3 s; generous for a loaded 2-core machine
        assert "--max-restarts 0" in nodes[1].output() or "stalled" in nodes[1].output(), nodes[1].output()[-2000:]
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if alive(p)]
        assert _stop([router]) == [0]
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.kill_all()


def test_router_routes_around_a_dead_engine_and_503_when_none(ckpt, tmp_path):
    """Two independent one-rank engines; kill one: every request still succeeds on the other and the
    router reports it unhealthy; kill both: 503 with an OpenAI error body, not a hang."""
    ports = [free_port(), free_port()]
    engines = [
        Proc(["engine", str(ckpt), *ENGINE_ARGS, "--engine-port", str(p), "--master-port", str(free_port())],
             tmp_path / f"engine{i}.log")
        for i, p in enumerate(ports)
    ]
    procs = list(engines)
    try:
        for e in engines:
            wait_output(e, "listening on")
        http_port = free_port()
        router = Proc(["router", str(ckpt), "--port", str(http_port), "--policy", "round_robin",
                       "--engine-wait-timeout", "2",  # none healthy: a request waits this long, then 503
                       *[a for p in ports for a in ("--engine", f"127.0.0.1:{p}")]], tmp_path / "router.log")
        procs.append(router)
        url = f"http://127.0.0.1:{http_port}"
        wait_http_ok(f"{url}/health", router)
        assert _complete(url, "warm up").status_code == 200
        engines[1].kill_all()
        for i in range(4):  # the first may still be sent to the dead one: it is retried on the live one
            r = _complete(url, f"prompt {i}")
            assert r.status_code == 200, r.text
        m = httpx.get(f"{url}/metrics").text
        assert metric(m, "epserve:engine_healthy", engine="0") == 1
        assert metric(m, "epserve:engine_healthy", engine="1") == 0
        health = httpx.get(f"{url}/health").json()
        assert (health["num_engines"], health["num_healthy_engines"]) == (2, 1)
        assert str(ports[0]) not in json.dumps(health)  # no internal addresses
        engines[0].kill_all()
        start = time.monotonic()
        r = _complete(url, "nobody home")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
        assert time.monotonic() - start < 10
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", timeout=30, json={"prompt": "x", "stream": True})
        assert r.status_code == 503
        assert _stop([router]) == [0]
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.kill_all()


def test_engine_under_torchrun(ckpt, tmp_path):
    """`torchrun -m epserve.cli engine --dp 2`: each torchrun worker is a rank; leaders serve gRPC."""
    engine_port, http_port = free_port(), free_port()
    node = Proc(["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--master-addr",
                 "127.0.0.1", "--master-port", str(free_port()), "-m", "epserve.cli", "engine", str(ckpt),
                 *ENGINE_ARGS, "--dp", "2", "--engine-port", str(engine_port)], tmp_path / "torchrun.log",
                module=False)
    procs = [node]
    try:
        for i in range(2):
            wait_output(node, f"engine instance {i} serving gRPC on 127.0.0.1:{engine_port + i}")
        router = Proc(["router", str(ckpt), "--port", str(http_port), "--engine", f"127.0.0.1:{engine_port}",
                       "--engine", f"127.0.0.1:{engine_port + 1}"], tmp_path / "router.log")
        procs.append(router)
        url = f"http://127.0.0.1:{http_port}"
        wait_http_ok(f"{url}/health", router)
        assert httpx.get(f"{url}/health").json()["num_healthy_engines"] == 2
        r = _complete(url, "torchrun")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        _stop([router])
        node.signal(signal.SIGTERM)  # torchrun passes it to the ranks, which drain and stop
        node.wait(60)
        assert "rank 0 stopped serving" in node.output() and "rank 1 stopped serving" in node.output()
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.kill_all()


def test_tensor_parallel_instance_serves_the_same_tokens(ckpt, tmp_path):
    """`epserve serve --tp 2`: one instance whose leader broadcasts each step to its TP peer."""
    http_port = free_port()
    server = Proc(["serve", str(ckpt), *ENGINE_ARGS, "--tp", "2", "--port", str(http_port)], tmp_path / "tp.log")
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_http_ok(f"{url}/health", server)
        want = LLM(ckpt, dtype="float32", num_blocks=64).generate(
            ["Tensor parallel heads"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
        r = _complete(url, "Tensor parallel heads")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert _stop([server]) == [0]
    finally:
        if server.proc.poll() is None:
            server.kill_all()
