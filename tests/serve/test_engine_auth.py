"""Engines and routers know each other by the engine token, which never travels (rpc/security.py): a
real ``epserve engine --dp 2`` and a real ``epserve router`` that is also handed two impostors — a
plain TCP listener that records what it is sent, and a gRPC engine with a token of its own. The router
refuses both and sends them no call (neither the API key, nor the token, nor a prompt reaches them);
an engine refuses callers without the token; and anyone local writing the rendezvous store cannot
wake the idle ranks (parallel/doorbell.py)."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from epserve.parallel.context import store_client
from epserve.parallel.launch import free_port
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import engine_channel, listen
from tests.serve_harness import Proc, metric, named, wait_http_ok

pytestmark = pytest.mark.slow

TOKEN = "the-engine-token-0123"
API_KEY = "the-api-key-4567"
PROMPT = "Expert parallelism"


class Recorder:
    """A plain TCP listener that keeps every byte it is sent (what an impostor would learn)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                self.received += data


class Impostor(pb_grpc.EngineServicer):
    """A gRPC engine under a token of its own: it answers everything, and records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_EngineServicer_to_server(self, self.server)
        self.port = listen(self.server, "127.0.0.1:0", "not-the-token")
        self.server.start()

    def GetInfo(self, request, context):  # noqa: N802
        self.calls.append("GetInfo")
        return pb.GetInfoResponse(max_model_len=256, vocab_size=512, dp=1, tp=1, block_size=16, num_blocks=64)

    def GetLoad(self, request, context):  # noqa: N802
        self.calls.append("GetLoad")
        return pb.GetLoadResponse()

    def Generate(self, request, context):  # noqa: N802
        self.calls.append(f"Generate {list(request.prompt_token_ids)}")
        yield pb.GenerateResponse(token_ids=[7], finish_reason="length")


@pytest.fixture(scope="module")
def deployment(make_ckpt, tmp_path_factory):
    ckpt: Path = make_ckpt("tiny", dtype="float32")
    tmp = tmp_path_factory.mktemp("auth")
    engine_port, master, http = free_port(), free_port(), free_port()
    recorder, impostor = Recorder(), Impostor()
    engine = Proc(["engine", str(ckpt), "--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256",
                   "--dp", "2", "--engine-port", str(engine_port), "--master-port", str(master),
                   "--engine-token", TOKEN], tmp / "engine.log")
    router = None
    try:
        deadline = time.monotonic() + 180
        while f"listening on 127.0.0.1:{engine_port + 1}" not in engine.output():
            assert engine.proc.poll() is None and time.monotonic() < deadline, engine.output()[-3000:]
            time.sleep(0.1)
        router = Proc(["router", str(ckpt), "--port", str(http), "--engine-token", TOKEN, "--api-key", API_KEY,
                       "--policy", "round_robin",
                       "--engine", f"127.0.0.1:{recorder.port}", "--engine", f"127.0.0.1:{impostor.port}",
                       "--engine", f"127.0.0.1:{engine_port}", "--engine", f"127.0.0.1:{engine_port + 1}"],
                      tmp / "router.log")
        url = f"http://127.0.0.1:{http}"
        wait_http_ok(f"{url}/health", router)
        yield dict(url=url, engine=engine, router=router, recorder=recorder, impostor=impostor,
                   ports=(engine_port, engine_port + 1), master=master)
    finally:
        for proc in (router, engine):
            if proc is not None:
                proc.kill_all()
        impostor.server.stop(0)
        recorder.sock.close()


def test_the_router_refuses_impostors_and_tells_them_nothing(deployment):
    url, recorder, impostor = deployment["url"], deployment["recorder"], deployment["impostor"]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    texts = []
    for _ in range(4):  # round robin over the instances it uses: only the two real ones
        r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
            "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts)) == 1
    text = httpx.get(f"{url}/metrics", timeout=30).text
    assert [metric(text, "epserve:engine_healthy", engine=str(i)) for i in range(4)] == [0, 0, 1, 1]
    assert metric(text, "epserve:router_requests_total", engine="0") == 0
    assert metric(text, "epserve:router_requests_total", engine="1") == 0
    # The impostors: the plain listener got TLS handshakes only (records of type 22), and none of
    # the secrets or the prompt; the gRPC impostor under another token was never called.
    received = bytes(recorder.received)
    assert recorder.connections >= 1 and received and received[0] == 0x16
    for secret in (TOKEN, API_KEY, PROMPT):
        assert secret.encode() not in received
    assert b"PRI * HTTP/2.0" not in received  # no plaintext gRPC
    assert impostor.calls == []
    assert "TLS handshake failed" in deployment["router"].output()


def test_an_engine_refuses_callers_without_the_token(deployment):
    address = f"127.0.0.1:{deployment['ports'][0]}"
    for token in (None, "a-wrong-token"):
        with engine_channel(address, token) as channel:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.EngineStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with engine_channel(address, TOKEN) as channel:
        assert pb_grpc.EngineStub(channel).GetInfo(pb.GetInfoRequest(), timeout=5).vocab_size > 0


def test_writing_the_store_does_not_wake_idle_ranks(deployment):
    """Anyone local can write the rendezvous store. Keys shaped like any doorbell's (a flood of wake
    keys, a false bell address) keep nobody awake: idle ranks stay idle, and serving goes on."""
    ranks = [psutil.Process(p) for p in named(deployment["engine"].pid, ["epserve-rank0", "epserve-rank1"])]
    store = store_client("127.0.0.1", deployment["master"], 10)
    def cpu_seconds() -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in ranks]

    before, start = cpu_seconds(), time.monotonic()
    for epoch in range(2000):
        store.set(f"doorbell/wake/{epoch}", b"1")
        store.set("doorbell/address", b"127.0.0.1:1")
        store.add("doorbell/wake", 1)
    busy = [b - a for a, b in zip(before, cpu_seconds())]
    before = cpu_seconds()  # the same time left alone: what idle ranks spend anyway (pings, health)
    time.sleep(time.monotonic() - start)
    idle = [b - a for a, b in zip(before, cpu_seconds())]
    assert max(b - i for b, i in zip(busy, idle)) < 0.5, (busy, idle)  # CPU seconds: the writes woke nobody
    r = httpx.post(f"{deployment['url']}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=60, json={"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 200, r.text
