"""The doorbell's wire protocol and its bell, the small server on rank 0 that ranks sleeping in
``parallel/doorbell.py`` connect to: framing, the proof of the world's secret, and the heartbeat.

Only ranks of the world talk to the bell: a connection first proves, both ways, that it holds the
world's secret (the engine token; an HMAC over nonces of both sides, so the secret never travels),
and the bell drops any connection that does not within a few seconds. A local process can neither
wake the ranks nor keep them from waking (the rendezvous store, open to anyone local, only tells
where the bell listens: a false address fails the proof and the world's start). Without a token the
proof is keyed by nothing and stops nobody; serving worlds always have one.

The bell relays the first ring of each epoch to every proven connection, and pings each of them every
second (at most): a rank that goes away without saying so (its process or host died) or misses the
pings of the heartbeat timeout (it or its host hung) is lost, and the bell tells every rank. Silence
is counted in pings the bell sent, not wall time, so a bell that was itself stopped misjudges no one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

HELLO = b"EPB1"
NONCE = 16
MAC = 32
# Frames (kind, number): rank -> bell: b"I" rank (who it is, once), b"R" epoch (ring), b"A" seq (a ping's
# answer), b"B" (leaving); bell -> ranks: b"W" epoch (wake), b"P" seq (ping), b"X" rank (the world is lost).
FRAME = struct.Struct(">cQ")
PROOF_TIMEOUT_S = 5.0
MAX_UNPROVEN = 64  # connections still owing their proof; more are closed at once
ADDRESS_KEY = "doorbell/address"
UNKNOWN = (1 << 64) - 1


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def secret_key(secret: str | None) -> bytes:
    return hashlib.sha256(b"epserve doorbell\0" + (secret or "").encode()).digest()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the doorbell's connection closed (its host rank is gone)")
        data += part
    return data


def heartbeat(timeout_s: float) -> tuple[float, int]:
    """(seconds between pings, pings a side may miss before the other is lost) for ``timeout_s``."""
    interval = min(1.0, timeout_s / 4)
    return interval, max(2, math.ceil(timeout_s / interval))


@dataclass
class BellPeer:
    buf: bytearray
    rank: int = UNKNOWN
    missed: int = 0  # pings since its last frame


class Bell:
    """Rank 0's bell: proves each connection, relays the first ring of each epoch to every proven
    connection, and pings them: a rank that leaves without saying so, or misses the pings of
    ``timeout_s`` (counted in pings the bell sent, so a bell that was itself stopped misjudges no one),
    is lost, and every rank is told. One thread, one selector."""

    def __init__(self, host: str, key: bytes, timeout_s: float) -> None:
        self.key = key
        self.interval, self.max_missed = heartbeat(timeout_s)
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.unproven: dict[socket.socket, tuple[bytes, float, bytearray]] = {}  # nonce, deadline, bytes so far
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
            for conn in [c for c, (_, deadline, _) in self.unproven.items() if deadline < now]:
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
            if peer.missed > self.max_missed:
                self._lose(peer.rank, "stopped answering the doorbell's heartbeat (it or its host hung)")
                return
            self._send(conn, FRAME.pack(b"P", self._seq))

    def _lose(self, rank: int, why: str) -> None:
        if self.lost is not None or self.closed:
            return
        self.lost = rank
        logger.error("doorbell: rank %s %s; telling every rank", "?" if rank == UNKNOWN else rank, why)
        for conn in list(self.proven):
            self._send(conn, FRAME.pack(b"X", rank))

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
            conn.send(HELLO + nonce)
        except OSError:
            conn.close()
            return
        self.unproven[conn] = (nonce, time.monotonic() + PROOF_TIMEOUT_S, bytearray())
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
            nonce, deadline, got = self.unproven[conn]
            got += data
            if len(got) < NONCE + MAC:
                return
            theirs, proof, rest = bytes(got[:NONCE]), bytes(got[NONCE:NONCE + MAC]), got[NONCE + MAC:]
            if not hmac.compare_digest(proof, mac(self.key, b"rank", nonce, theirs)):
                self._refuse(conn)
                return
            del self.unproven[conn]
            self.proven[conn] = BellPeer(bytearray(rest))
            self._send(conn, mac(self.key, b"bell", theirs, nonce)
                       + (FRAME.pack(b"W", self.rung) if self.rung >= 0 else b"")
                       + (FRAME.pack(b"X", self.lost) if self.lost is not None else b""))
            data = b""
        peer = self.proven.get(conn)
        if peer is None:
            return
        peer.buf += data
        peer.missed = 0
        while len(peer.buf) >= FRAME.size:
            kind, number = FRAME.unpack_from(peer.buf)
            del peer.buf[:FRAME.size]
            if kind == b"I":
                peer.rank = number
            elif kind == b"B":  # leaving on purpose (the world is stopping)
                self._drop(conn)
                return
            elif kind == b"R" and number > self.rung:
                self.rung = number
                for other in list(self.proven):
                    self._send(other, FRAME.pack(b"W", number))

    def _send(self, conn: socket.socket, data: bytes) -> None:
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
            logger.warning("doorbell: %d connections refused (no proof of the world's secret)", self.refused)

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
