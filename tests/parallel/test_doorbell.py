"""The doorbell idle ranks sleep on: a ring wakes every rank and is never lost; only ranks that hold
the world's secret can ring it or be told, and a false bell is found out. Ranks here are threads of
one process (the bell is plain sockets), with the rendezvous store they would meet through."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist

from epserve.parallel.bell import MAX_UNPROVEN
from epserve.parallel.bell_wire import ADDRESS_KEY, FRAME, HELLO, MAC, NONCE, RANK, Handshake, endpoint, secret_key
from epserve.parallel.context import store_client
from epserve.parallel.doorbell import Doorbell, LocalDoorbell, PeerLost
from tests.dist_harness import free_port

SECRET = "world-secret"


@pytest.fixture
def store():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=datetime.timedelta(seconds=30),
                           wait_for_workers=False)
    yield port
    del master


def two_ranks(port: int, secrets: tuple[str, str] = (SECRET, SECRET), heartbeat_timeout_s: float = 60.0,
              ) -> list[Doorbell]:
    bells: list[Doorbell | None] = [None, None]
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            bells[rank] = Doorbell("127.0.0.1", port, rank, secrets[rank], timeout_s=10,
                                   heartbeat_timeout_s=heartbeat_timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    threads = [threading.Thread(target=make, args=(r,)) for r in (1, 0)]  # rank 1 first: it waits for rank 0
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return bells  # type: ignore[return-value]


def sleeper(bell: Doorbell) -> threading.Thread:
    t = threading.Thread(target=bell.wait, daemon=True)
    t.start()
    return t


def test_ring_wakes_every_rank_and_is_never_lost(store):
    bells = two_ranks(store)
    sleeping = [sleeper(b) for b in bells]
    time.sleep(0.2)
    assert all(t.is_alive() for t in sleeping)  # nobody rang: both sleep
    bells[1].ring()  # any rank may ring
    for t in sleeping:
        t.join(10)
        assert not t.is_alive()
    bells[0].ring()  # rung before anybody waits (epoch 1): the waits return at once
    for b in bells:
        sleeper(b).join(10)
        assert b.epoch == 2
    sleeping = [sleeper(b) for b in bells]  # epoch 2: the old rings do not wake it
    time.sleep(0.2)
    assert all(t.is_alive() for t in sleeping)
    bells[0].ring()
    for t in sleeping:
        t.join(10)
        assert not t.is_alive()
    for b in bells:
        b.close()


def test_an_impostor_can_neither_ring_nor_crowd_the_bell(store):
    bells = two_ranks(store)
    host, _, port = store_client("127.0.0.1", store).get(ADDRESS_KEY).decode().rpartition(":")
    sleeping = [sleeper(b) for b in bells]
    # A forged proof followed by a ring: the bell closes the connection and nothing is rung.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        hello = s.recv(64)
        assert hello.startswith(HELLO)
        s.sendall(os.urandom(NONCE) + RANK.pack(1) + os.urandom(MAC) + FRAME.pack(b"R", 0))
        assert s.recv(64) == b""  # closed: no proof of the secret
    bell = bells[0]._bell
    assert bell is not None and bell.rung == -1 and bell.refused >= 1
    assert all(t.is_alive() for t in sleeping)
    # Silent connections: past the cap of those still owing their proof, closed at once.
    crowd = [socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_UNPROVEN + 5)]
    try:
        for s in crowd:
            s.recv(64)  # the hello (or the close, past the cap)
        closed = sum(s.recv(64) == b"" for s in crowd[MAX_UNPROVEN:])
        assert closed == 5
    finally:
        for s in crowd:
            s.close()
    bells[1].ring()  # the world's own ring still works
    for t in sleeping:
        t.join(10)
        assert not t.is_alive()
    for b in bells:
        b.close()


def test_a_rank_already_proven_is_refused_a_second_connection(store):
    bells = two_ranks(store)
    port = int(store_client("127.0.0.1", store).get(ADDRESS_KEY).decode().rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        hello = s.recv(len(HELLO) + NONCE)
        shake = Handshake(hello[len(HELLO):], os.urandom(NONCE), 1, endpoint(s.getpeername()), store)
        s.sendall(shake.rank_nonce + RANK.pack(1) + shake.proof(secret_key(SECRET), b"rank"))
        assert s.recv(MAC) == b""  # a true proof, but rank 1 is there already
    bells[0].ring()
    for b in bells:
        b.wait()  # the world's own ranks are untouched
    for b in bells:
        b.close()


def test_a_rank_with_another_secret_is_refused(store):
    with pytest.raises(RuntimeError, match="refused this rank's proof"):
        two_ranks(store, (SECRET, "another"))


def test_a_false_bell_is_found_out(store):
    """Anyone local can write the store: a bell address pointing elsewhere fails the rank's check."""
    fake = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        conn, _ = fake.accept()
        conn.sendall(HELLO + os.urandom(16))
        conn.recv(64)
        conn.sendall(os.urandom(MAC))  # a proof it cannot make
        time.sleep(1)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    store_client("127.0.0.1", store).set(ADDRESS_KEY, f"127.0.0.1:{fake.getsockname()[1]}".encode())
    with pytest.raises(RuntimeError, match="does not hold the world's secret"):
        Doorbell("127.0.0.1", store, 1, SECRET, timeout_s=10)
    fake.close()


def test_a_rank_that_goes_away_wakes_the_others_with_the_news(store):
    """A rank whose process dies (its connection closes without a goodbye) while the world sleeps:
    every other rank's wait raises at once, naming it; a rank that leaves on purpose is not lost."""
    bells = two_ranks(store)
    errors: list[BaseException] = []

    def sleep_on(bell: Doorbell) -> None:
        try:
            bell.wait()
        except PeerLost as e:
            errors.append(e)

    sleeping = threading.Thread(target=sleep_on, args=(bells[0],), daemon=True)
    sleeping.start()
    bells[1]._sock.close()  # as a killed process's socket: no goodbye
    sleeping.join(10)
    assert not sleeping.is_alive() and len(errors) == 1
    assert "rank 1" in str(errors[0]) and "died" in str(errors[0])
    bells[0].close()

    store_client("127.0.0.1", store).delete_key(ADDRESS_KEY)  # (a new world would have a new store)
    bells = two_ranks(store)
    bells[1].close()  # leaving with a goodbye
    bells[0].ring()
    bells[0].wait()  # still a world: its own ring wakes it
    assert bells[0].lost is None
    bells[0].close()


def test_a_rank_that_stops_answering_is_lost_within_the_heartbeat_timeout(store):
    """A rank that holds the secret but answers no ping (as a SIGSTOPped process): the sleeping ranks
    learn within the heartbeat timeout (counted in missed pings)."""
    bells: list[Doorbell] = []
    rank0 = threading.Thread(target=lambda: bells.append(
        Doorbell("127.0.0.1", store, 0, SECRET, timeout_s=10, heartbeat_timeout_s=0.8)), daemon=True)
    rank0.start()
    rank0.join(10)
    port = int(store_client("127.0.0.1", store).get(ADDRESS_KEY).decode().rpartition(":")[2])
    hung = socket.create_connection(("127.0.0.1", port), timeout=10)  # proves as rank 1, then is silent
    hello = hung.recv(len(HELLO) + NONCE)
    shake = Handshake(hello[len(HELLO):], os.urandom(NONCE), 1, endpoint(hung.getpeername()), store)
    hung.sendall(shake.rank_nonce + RANK.pack(1) + shake.proof(secret_key(SECRET), b"rank"))
    assert hung.recv(MAC) == shake.proof(secret_key(SECRET), b"bell")
    start = time.monotonic()
    with pytest.raises(PeerLost, match="rank 1 .*stopped answering"):
        bells[0].wait()
    assert time.monotonic() - start < 5.0
    hung.close()
    bells[0].close()


def test_local_doorbell():
    bell = LocalDoorbell()
    bell.ring()
    start = time.monotonic()
    bell.wait()  # rung before: no wait
    assert time.monotonic() - start < 0.1
    threading.Timer(0.2, bell.ring).start()
    start = time.monotonic()
    bell.wait()
    assert time.monotonic() - start >= 0.15
