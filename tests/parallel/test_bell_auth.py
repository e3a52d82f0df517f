"""The doorbell trusts nothing it reads from the rendezvous store (parallel/bell_wire.py): a relay that
the store's address points to, passing the handshake through, is refused; a frame injected, modified
or replayed on a proven connection drops it and is acted on by nobody; and no idle rank spins. The
ranks live in a real process (each a Doorbell in a thread of it, its CPU time read by psutil); the
test plays the relay, the bell or a rank, holding the world's secret where the part needs it."""

from __future__ import annotations

import datetime
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from epserve.parallel.bell_wire import (
    ADDRESS_KEY,
    FRAME,
    HELLO,
    MAC,
    NONCE,
    PROOF,
    RANK,
    SEALED,
    TAG,
    Channel,
    Handshake,
    Tampered,
    endpoint,
    secret_key,
)
from epserve.parallel.launch import RankProcesses
from epserve.parallel.spawned import RankInfo, world_secret
from tests.dist_harness import free_port

SECRET = "world-secret"
KEY = secret_key(SECRET)
ROOT = Path(__file__).resolve().parents[2]

# The ranks' process: "join NAME PORT RANK" starts a Doorbell in a thread that waits (sleeps) in a loop,
# counting its wakes; it says "joined NAME", "error NAME why" (it could not join) or "lost NAME why".
WORLD = """
import json, sys, threading
from epserve.parallel.doorbell import Doorbell, PeerLost
wakes, lock = {}, threading.Lock()
def say(*words):
    with lock:
        print(*words, flush=True)
def rank(name, port, rank, secret):
    try:
        bell = Doorbell("127.0.0.1", port, rank, secret, timeout_s=10)
    except Exception as e:
        return say("error", name, str(e).replace("\\n", " "))
    wakes[name] = 0
    say("joined", name)
    try:
        while True:
            bell.wait()
            wakes[name] += 1
    except PeerLost as e:
        say("lost", name, e)
    bell.close()
for line in sys.stdin:
    command, *args = line.split()
    if command == "join":
        threading.Thread(target=rank, args=(args[0], int(args[1]), int(args[2]), args[3]), daemon=True).start()
    elif command == "wakes":
        say("wakes", json.dumps(wakes))
"""


class World:
    """The ranks' process, driven over its stdin; what it says is read by a thread into a queue."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORLD], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []  # what it logged (stderr)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()  # type: ignore[arg-type]
        self.cpu = psutil.Process(self.proc.pid)

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.put(line.rstrip("\n"))

    def logged(self, text: str, since: int, timeout: float = 5.0) -> bool:
        """Whether a line of its log after the first ``since`` says ``text`` (within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.log[since:]) and time.monotonic() < deadline:
            time.sleep(0.02)
        return any(text in line for line in self.log[since:])

    def tell(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def expect(self, kind: str, timeout: float = 20.0) -> str:
        """The next line of ``kind`` (lines of other kinds before it are an error)."""
        line = self.lines.get(timeout=timeout)
        assert line.startswith(kind + " "), line
        return line[len(kind) + 1:]

    def join(self, name: str, store_port: int, rank: int, secret: str = SECRET) -> None:
        self.tell(f"join {name} {store_port} {rank} {secret}")

    def wakes(self) -> dict[str, int]:
        self.tell("wakes")
        return json.loads(self.expect("wakes"))

    def woken(self, name: str, times: int, timeout: float = 10.0) -> bool:
        """Whether rank ``name`` has woken ``times`` times (within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.wakes()[name] != times and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.wakes()[name] == times

    def cpu_seconds(self, window: float) -> float:
        """CPU seconds the process spends over ``window`` seconds of wall time."""
        before = sum(self.cpu.cpu_times()[:2])
        time.sleep(window)
        return sum(self.cpu.cpu_times()[:2]) - before

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    yield port, master
    del master


@pytest.fixture(scope="module")
def world():
    w = World()
    yield w
    w.close()


def bell_port(master: dist.Store) -> int:
    return int(master.get("epserve/0/" + ADDRESS_KEY).decode().rpartition(":")[2])


def set_bell_port(master: dist.Store, port: int) -> None:
    master.set("epserve/0/" + ADDRESS_KEY, f"127.0.0.1:{port}".encode())


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        assert part, f"closed after {len(data)} of {n} bytes"
        data += part
    return data


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the other end closes ``sock`` within ``timeout`` (whatever it sends first is read)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


class Relay:
    """Listens where the rewritten store points, dials the real bell for each rank that connects and
    passes every byte through; once the bell has answered past its hello and proof, it injects a wake
    and a ring of a far epoch (what made idle ranks spin)."""

    def __init__(self, bell_port: int) -> None:
        self.bell_port = bell_port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.injected = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            rank, _ = self.server.accept()
        except OSError:
            return
        bell = socket.create_connection(("127.0.0.1", self.bell_port), timeout=10)
        threading.Thread(target=self._pump, args=(rank, bell, False), daemon=True).start()
        self._pump(bell, rank, True)

    def _pump(self, src: socket.socket, dst: socket.socket, from_bell: bool) -> None:
        passed = 0
        try:
            while data := src.recv(4096):
                dst.sendall(data)
                passed += len(data)
                if from_bell and passed >= len(HELLO) + NONCE + MAC and not self.injected.is_set():
                    self.injected.set()
                    dst.sendall(FRAME.pack(b"W", 1 << 62) * 4)  # to the rank
                    src.sendall(FRAME.pack(b"R", 1 << 62) * 4)  # to the bell
        except OSError:
            pass
        for s in (src, dst):  # (shut down first: the other pump's thread may be blocked reading it)
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.server.close()


def test_a_relay_the_store_points_to_is_refused_and_no_idle_rank_spins(store, world):
    """Anyone local can rewrite the bell's address in the store to a relay of its own. The rank that
    dials it proves itself for the relay's address, which the bell refuses: the rank does not join,
    nothing the relay sends is acted on, and the idle rank 0 stays asleep (no CPU spent)."""
    port, master = store
    world.join("relay0", port, 0)
    assert world.expect("joined") == "relay0"
    relay = Relay(bell_port(master))
    set_bell_port(master, relay.port)
    world.join("relay1", port, 1)
    line = world.lines.get(timeout=20)
    assert line.startswith("error relay1") and "refused this rank's proof" in line, line
    assert not relay.injected.is_set()  # the bell gave no proof through it
    assert world.cpu_seconds(1.0) < 0.2
    assert world.wakes()["relay0"] == 0
    relay.close()


def prove_as_rank(port: int, store_port: int, rank: int = 1) -> tuple[socket.socket, Channel]:
    """Dial the bell at ``port`` as ``rank`` of the world (the test holds the secret)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    hello = recv_exactly(sock, len(HELLO) + NONCE)
    assert hello.startswith(HELLO)
    shake = Handshake(hello[len(HELLO):], os.urandom(NONCE), rank, endpoint(sock.getpeername()), store_port)
    sock.sendall(shake.rank_nonce + RANK.pack(rank) + shake.proof(KEY, b"rank"))
    assert recv_exactly(sock, MAC) == shake.proof(KEY, b"bell")
    return sock, shake.channel(KEY, b"rank")


def next_frame(sock: socket.socket, channel: Channel, kind: bytes) -> int:
    """The number of the next frame of ``kind`` the peer sends (pings before it skipped)."""
    buf = bytearray()
    while True:
        buf += recv_exactly(sock, SEALED)
        for got, number in channel.open(buf):
            if got == kind:
                return number


def tampered(case: str, channel: Channel, kind: bytes, earlier: bytes) -> bytes:
    """A frame of ``kind`` that would move the world if it were acted on, ``case``'s way."""
    if case == "injected":
        return FRAME.pack(kind, 1 << 62) + os.urandom(TAG)
    if case == "modified":
        frame = channel.seal(kind, 1)
        return frame[:1] + RANK.pack(1 << 62) + frame[FRAME.size:]
    return earlier  # replayed: a frame the peer took before


CASES = ["injected", "modified", "replayed"]


@pytest.mark.parametrize("case", CASES)
def test_a_tampered_frame_to_the_bell_drops_the_connection_and_is_never_acted_on(store, world, case):
    port, master = store
    name, since = f"bell-{case}", len(world.log)
    world.join(name, port, 0)
    assert world.expect("joined") == name
    sock, channel = prove_as_rank(bell_port(master), port)
    ring = channel.seal(b"R", 0)
    sock.sendall(ring)  # a proven rank's ring wakes rank 0 once
    assert next_frame(sock, channel, b"W") == 0
    assert world.woken(name, 1)
    sock.sendall(tampered(case, channel, b"R", ring))
    assert closed_by_peer(sock)
    lost = world.expect("lost")
    assert lost.startswith(name) and "rank 1" in lost, lost  # told by the bell
    assert world.logged("rank 1 is cut off: its doorbell connection carried a frame that failed its check (frame 1 ",
                        since)
    assert world.wakes()[name] == 1  # the ring; nothing after it
    sock.close()


@pytest.mark.parametrize("case", CASES)
def test_a_tampered_frame_to_a_rank_drops_the_connection_and_is_never_acted_on(store, world, case):
    """The test is the bell (holding the secret): after one true wake, a tampered one."""
    port, master = store
    name = f"rank-{case}"
    server = socket.create_server(("127.0.0.1", 0))
    set_bell_port(master, server.getsockname()[1])
    world.join(name, port, 1)
    server.settimeout(20)
    sock, _ = server.accept()
    sock.settimeout(10)
    nonce = os.urandom(NONCE)
    sock.sendall(HELLO + nonce)
    answer = recv_exactly(sock, PROOF)
    rank_nonce, (rank,), proof = answer[:NONCE], RANK.unpack(answer[NONCE:NONCE + RANK.size]), answer[-MAC:]
    shake = Handshake(nonce, rank_nonce, rank, endpoint(sock.getsockname()), port)
    assert rank == 1 and proof == shake.proof(KEY, b"rank")
    channel = shake.channel(KEY, b"bell")
    wake = channel.seal(b"W", 0)
    sock.sendall(shake.proof(KEY, b"bell") + wake)
    assert world.expect("joined") == name
    assert world.woken(name, 1)
    sock.sendall(tampered(case, channel, b"W", wake))
    assert closed_by_peer(sock)
    lost = world.expect("lost")
    assert lost.startswith(name) and "failed its check" in lost, lost
    assert world.wakes()[name] == 1
    assert world.cpu_seconds(0.3) < 0.1
    sock.close()
    server.close()


def test_frames_open_only_in_order_under_their_own_direction_key():
    shake = Handshake(os.urandom(NONCE), os.urandom(NONCE), 3, "127.0.0.1:5000", 29500)
    rank, bell = shake.channel(KEY, b"rank"), shake.channel(KEY, b"bell")
    first, second = rank.seal(b"R", 7), rank.seal(b"A", 1)
    assert bell.open(bytearray(first + second[:5])) == [(b"R", 7)]
    with pytest.raises(Tampered):  # a frame of the rank's, sent back to it (reflected)
        Handshake(shake.bell_nonce, shake.rank_nonce, 3, "127.0.0.1:5000", 29500).channel(
            KEY, b"rank").open(bytearray(first))
    with pytest.raises(Tampered):  # the first frame again (replayed)
        bell.open(bytearray(first))
    other = Handshake(shake.bell_nonce, shake.rank_nonce, 3, "127.0.0.1:5001", 29500)  # a relay's address
    assert other.proof(KEY, b"rank") != shake.proof(KEY, b"rank")
    assert Handshake(shake.bell_nonce, shake.rank_nonce, 3, "127.0.0.1:5000", 29501).proof(KEY, b"rank") \
        != shake.proof(KEY, b"rank")  # another world's store
    assert shake.proof(KEY, b"bell") != shake.proof(KEY, b"rank")
    assert shake.proof(secret_key(SECRET, b"another world"), b"rank") != shake.proof(KEY, b"rank")
    assert endpoint(("::ffff:10.0.0.1", 80, 0, 0)) == "10.0.0.1:80" and endpoint(("fe80::1%eth0", 9)) == "fe80::1:9"


class SecretKeeper:
    """A rank that answers any command with the world secret its parent handed it."""

    def handle(self, command: object) -> object:
        secret = world_secret()
        return secret, secret is not None and any(secret.hex() in value for value in os.environ.values())

    def close(self) -> None:
        pass


def secret_keeper(info: RankInfo) -> SecretKeeper:
    return SecretKeeper()


def test_a_parent_that_spawns_the_whole_world_hands_its_ranks_a_secret_of_their_own():
    """A fresh one for each world, in the ranks' start arguments (which a spawned or forkserver rank
    reads from a pipe; forked here, which is quicker), never in the environment; none for a part of a
    world (its other ranks are on other hosts)."""
    infos = [RankInfo(0, 0, 1, "127.0.0.1", 0)]
    secrets = []
    for whole in (True, True, False):
        ranks = RankProcesses(secret_keeper, infos, start_method="fork", whole_world=whole)
        try:
            secret, in_environment = ranks.call("secret")
        finally:
            ranks.close()
        assert not in_environment
        secrets.append(secret)
    assert len(secrets[0]) == 32 and len(secrets[1]) == 32 and secrets[0] != secrets[1] and secrets[2] is None
