"""Rank 0's bell, the small server that ranks sleeping in ``parallel/doorbell.py`` connect to: it proves
each connection, relays rings as wakes, and keeps the heartbeat (``parallel/bell_wire.py`` has the
handshake and the frames).

Only ranks of the world talk to the bell: a connection first proves, both ways, that it holds the
world's key, bound to this connection (both nonces, the rank, the bell's endpoint, the world), and the
bell drops any connection that does not within a few seconds. Every frame after the proof carries a
MAC under a key of the connection and its count: one that fails it (injected, modified, replayed)
drops the connection, and the rank behind it is lost. A local process can neither wake the ranks nor
keep them from waking, nor relay a rank's connection: the rendezvous store, open to anyone local,
only tells which port the bell listens on, and a rank that dials a relay instead proves itself for
the relay's address, which the bell refuses.

The bell relays the first ring of each epoch to every proven connection, and pings each of them every
second (at most): a rank that goes away without saying so (its process or host died) or misses the
pings of the heartbeat timeout (it or its host hung) is lost, and the bell tells every rank. Silence
is counted in pings the bell sent, not wall time, so a bell that was itself stopped misjudges no one.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from epserve.parallel.bell_wire import (
    HELLO,
    NONCE,
    PROOF,
    RANK,
    UNKNOWN,
    Channel,
    Handshake,
    Tampered,
    endpoint,
)

logger = logging.getLogger(__name__)

PROOF_TIMEOUT_S = 5.0
MAX_UNPROVEN = 64  # connections still owing their proof; more are closed at once


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the doorbell's connection closed (its host rank is gone)")
        data += part
    return data


def heartbeat(timeout_s: float) -> tuple[float, int]:
    """(seconds between pings, the missed pings that lose the other side) for ``timeout_s``: silent for
    ``timeout_s``, not one ping more (as the step timeout promises)."""
    interval = min(1.0, timeout_s / 4)
    return interval, max(2, math.ceil(timeout_s / interval))


@dataclass
class Unproven:
    """A connection still owing its proof: the nonce the bell sent, by when, and its bytes so far."""

    nonce: bytes
    deadline: float
    endpoint: str  # the bell's address on this connection, as the rank dialled it
    got: bytearray


@dataclass
class BellPeer:
    channel: Channel
    rank: int
    buf: bytearray
    missed: int = 0  # pings since its last frame


class Bell:
    """Rank 0's bell: proves each connection, relays the first ring of each epoch to every proven
    connection, and pings them: a rank that leaves without saying so, or misses the pings of
    ``timeout_s`` (counted in pings the bell sent, so a bell that was itself stopped misjudges no one),
    or whose connection carries a frame that fails its check, is lost, and every rank is told. A
    second connection proving a rank already proven is refused.
    ``world``: the rendezvous store's port, which the proofs are bound to. One thread, one selector."""

    def __init__(self, host: str, key: bytes, timeout_s: float, world: int) -> None:
        self.key = key
        self.world = world
        self.interval, self.max_missed = heartbeat(timeout_s)
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.port: int = self.listener.getsockname()[1]
        self.address = f"{host}:{self.port}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.unproven: dict[socket.socket, Unproven] = {}
        self.proven: dict[socket.socket, BellPeer] = {}
        self.rung = -1
        self.refused = 0
        self.lost: int | None = None  # the rank the world lost
        self.closed = False
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="doorbell", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_ping = time.monotonic() + self.interval
        while not self.closed:
            try:
                events = self.selector.select(timeout=max(0.0, next_ping - time.monotonic()))
            except (OSError, ValueError):  # closed under us
                return
            for key, _ in events:
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn in [c for c, owed in self.unproven.items() if owed.deadline < now]:
                self._refuse(conn)
            if now >= next_ping:
                next_ping = now + self.interval
                self._ping()

    def _ping(self) -> None:
        if self.lost is not None:
            return
        self._seq += 1
        for conn, peer in list(self.proven.items()):
            peer.missed += 1
            if peer.missed >= self.max_missed:
                self._lose(peer.rank, "stopped answering the doorbell's heartbeat (it or its host hung)")
                return
            self._send(conn, b"P", self._seq)

    def _lose(self, rank: int, why: str) -> None:
        if self.lost is not None or self.closed:
            return
        self.lost = rank
        logger.error("doorbell: rank %s %s; telling every rank", "?" if rank == UNKNOWN else rank, why)
        for conn in list(self.proven):
            self._send(conn, b"X", rank)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if len(self.unproven) >= MAX_UNPROVEN:
            conn.close()
            self._count_refusal()
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(NONCE)
        try:
            where = endpoint(conn.getsockname())
            conn.send(HELLO + nonce)
        except OSError:
            conn.close()
            return
        self.unproven[conn] = Unproven(nonce, time.monotonic() + PROOF_TIMEOUT_S, where, bytearray())
        self.selector.register(conn, selectors.EVENT_READ, None)

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            peer = self.proven.get(conn)
            self._drop(conn)
            if peer is not None:
                self._lose(peer.rank, "went away (its process or host died)")
            return
        if conn in self.unproven:
            data = self._prove(conn, data)
        peer = self.proven.get(conn)
        if peer is None:
            return
        peer.buf += data
        peer.missed = 0
        try:
            frames = peer.channel.open(peer.buf)
        except Tampered as e:
            self._drop(conn)
            self._lose(peer.rank, f"is cut off: its doorbell connection carried a frame that failed its check ({e}: "
                       "injected, modified or replayed on the way); the bell dropped it")
            return
        for kind, number in frames:
            if kind == b"B":  # leaving on purpose (the world is stopping)
                self._drop(conn)
                return
            if kind == b"R" and number > self.rung:
                self.rung = number
                for other in list(self.proven):
                    self._send(other, b"W", number)

    def _prove(self, conn: socket.socket, data: bytes) -> bytes:
        """Take ``data`` towards the connection's proof; once whole, prove it (or refuse the connection).
        What follows the proof is returned (frames)."""
        owed = self.unproven[conn]
        owed.got += data
        if len(owed.got) < PROOF:
            return b""
        theirs, rest = bytes(owed.got[:PROOF]), bytes(owed.got[PROOF:])
        (rank,) = RANK.unpack_from(theirs, NONCE)
        shake = Handshake(owed.nonce, theirs[:NONCE], rank, owed.endpoint, self.world)
        proven = hmac.compare_digest(theirs[NONCE + RANK.size:], shake.proof(self.key, b"rank"))
        if not proven or any(peer.rank == rank for peer in self.proven.values()):
            self._refuse(conn)
            return b""
        del self.unproven[conn]
        peer = self.proven[conn] = BellPeer(shake.channel(self.key, b"bell"), rank, bytearray())
        with_news = [(b"W", self.rung)] if self.rung >= 0 else []
        with_news += [(b"X", self.lost)] if self.lost is not None else []
        self._send_raw(conn, shake.proof(self.key, b"bell") + b"".join(peer.channel.seal(*n) for n in with_news))
        return rest

    def _send(self, conn: socket.socket, kind: bytes, number: int) -> None:
        peer = self.proven.get(conn)
        if peer is not None:
            self._send_raw(conn, peer.channel.seal(kind, number))

    def _send_raw(self, conn: socket.socket, data: bytes) -> None:
        try:
            conn.setblocking(True)
            conn.sendall(data)
            conn.setblocking(False)
        except OSError:
            self._drop(conn)

    def _refuse(self, conn: socket.socket) -> None:
        self._count_refusal()
        self._drop(conn)

    def _count_refusal(self) -> None:
        self.refused += 1
        if self.refused in (1, 10, 100, 1000, 10000):  # calm under a flood
            logger.warning("doorbell: %d connections refused (no proof of the world's key for them)", self.refused)

    def close(self) -> None:
        self.closed = True
        self._thread.join(2.0)
        for conn in [*self.unproven, *self.proven]:
            self._drop(conn)
        self.selector.close()
        self.listener.close()

    def _drop(self, conn: socket.socket) -> None:
        self.unproven.pop(conn, None)
        self.proven.pop(conn, None)
        try:
            self.selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
