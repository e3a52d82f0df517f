"""How idle ranks sleep until there is work, without spinning (docs/architecture.md, "One step", 4).

When the step's all-reduce says that no rank has work, every rank of the EP group blocks reading its
connection to the bell, a small server on rank 0. A leader that receives a request (or a rank asked
to stop) rings the current epoch; the bell tells every rank, which wakes them at once; they step
again, and the epoch advances. Every rank sleeps and wakes at the same steps, so their epochs agree.

A ring and the epoch advance share a lock: a request pushed to the inbox before the advance is
seen by the step that follows the wake; one pushed after it rings the next epoch (at worst one
spurious wake, never a lost one). The bell tells each epoch once, in order, to every rank, so a
rank that reaches its wait after the ring finds the news already in its socket.

Only ranks of the world talk to the bell: a connection first proves, both ways, that it holds the
world's secret (the engine token; an HMAC over nonces of both sides, so the secret never travels),
and the bell drops any connection that does not within a few seconds. A local process can neither
wake the ranks nor keep them from waking (the rendezvous store, open to anyone local, only tells
where the bell listens: a false address fails the proof and the world's start). Without a token the
proof is keyed by nothing and stops nobody; serving worlds always have one.

The bell also keeps the world honest while it sleeps: it pings every rank each second (at most) and
each rank answers from a reader thread of its own, busy or not. A rank that goes away without saying
so (its process or host died) or misses the pings of the heartbeat timeout (it or its host hung) is
lost, and the bell tells every rank; a rank that hears nothing from the bell for as long loses the
world too. Either way a sleeping rank's :meth:`Doorbell.wait` raises :class:`PeerLost` and the step
loop fails, as a collective would have on the next request. Silence is counted in missed pings, not
wall time, so a whole world stopped and resumed together misjudges no one.
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

from epserve.parallel.context import store_client

logger = logging.getLogger(__name__)

_HELLO = b"EPB1"
_NONCE = 16
_MAC = 32
# Frames (kind, number): rank -> bell: b"I" rank (who it is, once), b"R" epoch (ring), b"A" seq (a ping's
# answer), b"B" (leaving); bell -> ranks: b"W" epoch (wake), b"P" seq (ping), b"X" rank (the world is lost).
_FRAME = struct.Struct(">cQ")
_PROOF_TIMEOUT_S = 5.0
_MAX_UNPROVEN = 64  # connections still owing their proof; more are closed at once
_ADDRESS_KEY = "doorbell/address"
_UNKNOWN = (1 << 64) - 1


class PeerLost(RuntimeError):
    """A rank of the world died or hung (its host went away, it stopped answering the heartbeat)."""


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def _key(secret: str | None) -> bytes:
    return hashlib.sha256(b"epserve doorbell\0" + (secret or "").encode()).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the doorbell's connection closed (its host rank is gone)")
        data += part
    return data


def _heartbeat(timeout_s: float) -> tuple[float, int]:
    """(seconds between pings, pings a side may miss before the other is lost) for ``timeout_s``."""
    interval = min(1.0, timeout_s / 4)
    return interval, max(2, math.ceil(timeout_s / interval))


@dataclass
class _Peer:
    buf: bytearray
    rank: int = _UNKNOWN
    missed: int = 0  # pings since its last frame


class _Bell:
    """Rank 0's bell: proves each connection, relays the first ring of each epoch to every proven
    connection, and pings them: a rank that leaves without saying so, or misses the pings of
    ``timeout_s`` (counted in pings the bell sent, so a bell that was itself stopped misjudges no one),
    is lost, and every rank is told. One thread, one selector."""

    def __init__(self, host: str, key: bytes, timeout_s: float) -> None:
        self.key = key
        self.interval, self.max_missed = _heartbeat(timeout_s)
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.unproven: dict[socket.socket, tuple[bytes, float, bytearray]] = {}  # nonce, deadline, bytes so far
        self.proven: dict[socket.socket, _Peer] = {}
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
            self._send(conn, _FRAME.pack(b"P", self._seq))

    def _lose(self, rank: int, why: str) -> None:
        if self.lost is not None or self.closed:
            return
        self.lost = rank
        logger.error("doorbell: rank %s %s; telling every rank", "?" if rank == _UNKNOWN else rank, why)
        for conn in list(self.proven):
            self._send(conn, _FRAME.pack(b"X", rank))

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if len(self.unproven) >= _MAX_UNPROVEN:
            conn.close()
            self._count_refusal()
            return
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(_NONCE)
        try:
            conn.send(_HELLO + nonce)
        except OSError:
            conn.close()
            return
        self.unproven[conn] = (nonce, time.monotonic() + _PROOF_TIMEOUT_S, bytearray())
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
            if len(got) < _NONCE + _MAC:
                return
            theirs, proof, rest = bytes(got[:_NONCE]), bytes(got[_NONCE:_NONCE + _MAC]), got[_NONCE + _MAC:]
            if not hmac.compare_digest(proof, _mac(self.key, b"rank", nonce, theirs)):
                self._refuse(conn)
                return
            del self.unproven[conn]
            self.proven[conn] = _Peer(bytearray(rest))
            self._send(conn, _mac(self.key, b"bell", theirs, nonce)
                       + (_FRAME.pack(b"W", self.rung) if self.rung >= 0 else b"")
                       + (_FRAME.pack(b"X", self.lost) if self.lost is not None else b""))
            data = b""
        peer = self.proven.get(conn)
        if peer is None:
            return
        peer.buf += data
        peer.missed = 0
        while len(peer.buf) >= _FRAME.size:
            kind, number = _FRAME.unpack_from(peer.buf)
            del peer.buf[:_FRAME.size]
            if kind == b"I":
                peer.rank = number
            elif kind == b"B":  # leaving on purpose (the world is stopping)
                self._drop(conn)
                return
            elif kind == b"R" and number > self.rung:
                self.rung = number
                for other in list(self.proven):
                    self._send(other, _FRAME.pack(b"W", number))

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


class Doorbell:
    """One rank's end of the bell (rank 0 also hosts it). ``host``/``port``: the rendezvous store,
    where rank 0 tells the bell's address; ``secret``: the world's shared secret (the engine token);
    ``heartbeat_timeout_s``: how long a silent peer (or bell) may stay silent before the world is lost
    (the step timeout: the same bound as for a step that makes no progress)."""

    def __init__(self, host: str, port: int, rank: int, secret: str | None, timeout_s: float = 600.0,
                 heartbeat_timeout_s: float = 60.0) -> None:
        key = _key(secret)
        store = store_client(host, port, timeout_s)
        self._bell = None
        if rank == 0:
            self._bell = _Bell(host, key, heartbeat_timeout_s)
            store.set(_ADDRESS_KEY, self._bell.address.encode())
        address = store.get(_ADDRESS_KEY).decode()  # waits for rank 0
        bell_host, _, bell_port = address.rpartition(":")
        self._sock = socket.create_connection((bell_host, int(bell_port)), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._prove(key, address)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the epoch
        self._news = threading.Condition()
        self._heard = -1  # the newest epoch the bell told of
        self.lost: str | None = None  # why the world is lost, once it is
        self._closing = False
        self.epoch = 0
        self._send(_FRAME.pack(b"I", rank))
        interval, self._max_missed = _heartbeat(heartbeat_timeout_s)
        self._sock.settimeout(interval)
        self._reader = threading.Thread(target=self._listen, name="doorbell-rank", daemon=True)
        self._reader.start()

    def _prove(self, key: bytes, address: str) -> None:
        hello = _recv_exactly(self._sock, len(_HELLO) + _NONCE)
        if not hello.startswith(_HELLO):
            raise RuntimeError(f"the doorbell at {address} is not an epserve doorbell")
        theirs, mine = hello[len(_HELLO):], os.urandom(_NONCE)
        self._sock.sendall(mine + _mac(key, b"rank", theirs, mine))
        try:
            proof = _recv_exactly(self._sock, _MAC)
        except ConnectionError:
            raise RuntimeError(f"the doorbell at {address} refused this rank's proof (another engine token?)") from None
        if not hmac.compare_digest(proof, _mac(key, b"bell", mine, theirs)):
            raise RuntimeError(f"the doorbell at {address} does not hold the world's secret: not ours")

    def _send(self, frame: bytes) -> None:
        with self._send_lock:
            try:
                self._sock.sendall(frame)
            except OSError:  # the bell's host rank is gone: the reader says so
                pass

    def _listen(self) -> None:
        """The reader thread: wakes, pings (answered at once) and the bell's verdicts; a bell silent for
        the heartbeat timeout (counted in this thread's own waits) or gone loses the world."""
        buf, missed = bytearray(), 0
        while True:
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                missed += 1
                if missed > self._max_missed:
                    return self._lose("the doorbell's host rank (rank 0) stopped answering (it or its host hung)")
                continue
            except OSError:
                data = b""
            if not data:
                return self._lose("the doorbell's host rank (rank 0) went away (its process or host died)")
            missed = 0
            buf += data
            while len(buf) >= _FRAME.size:
                kind, number = _FRAME.unpack_from(buf)
                del buf[:_FRAME.size]
                if kind == b"P":
                    self._send(_FRAME.pack(b"A", number))
                elif kind == b"W":
                    with self._news:
                        self._heard = max(self._heard, number)
                        self._news.notify_all()
                elif kind == b"X":
                    who = "a rank" if number == _UNKNOWN else f"rank {number}"
                    return self._lose(f"{who} of the world died or stopped answering (its host died or hung)")

    def _lose(self, why: str) -> None:
        with self._news:
            if self._closing:
                return
            self.lost = why
            self._news.notify_all()
        logger.error("doorbell: %s", why)

    def ring(self) -> None:
        """Wake every rank sleeping in (or about to enter) the current epoch's :meth:`wait`.
        Thread-safe; call it after queueing the work it announces."""
        with self._lock:
            self._send(_FRAME.pack(b"R", self.epoch))

    def wait(self) -> None:
        """Block until some rank rings this epoch, then move to the next one. Every rank calls it
        at the same step. Raises :class:`PeerLost` once a rank of the world died or hung."""
        with self._news:
            while self._heard < self.epoch and self.lost is None:
                self._news.wait()
            if self.lost is not None:
                raise PeerLost(self.lost)
        with self._lock:
            self.epoch += 1

    def close(self) -> None:
        """Leave (saying so: the bell does not count it as lost)."""
        with self._news:
            self._closing = True
        self._send(_FRAME.pack(b"B", 0))
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(2.0)
        if self._bell is not None:
            self._bell.close()


class LocalDoorbell:
    """The same contract for a one-rank world in one process (no store)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()

    def ring(self) -> None:
        with self._lock:
            self._event.set()

    def wait(self) -> None:
        self._event.wait()
        with self._lock:
            self._event.clear()

    def close(self) -> None:
        pass
