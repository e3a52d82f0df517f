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
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import threading
import time

from epserve.parallel.context import store_client

logger = logging.getLogger(__name__)

_HELLO = b"EPB1"
_NONCE = 16
_MAC = 32
_FRAME = struct.Struct(">cQ")  # b"R" (rank -> bell: ring) or b"W" (bell -> ranks: wake), epoch
_PROOF_TIMEOUT_S = 5.0
_MAX_UNPROVEN = 64  # connections still owing their proof; more are closed at once
_ADDRESS_KEY = "doorbell/address"


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


class _Bell:
    """Rank 0's bell: proves each connection, then relays the first ring of each epoch to every
    proven connection. One thread, one selector."""

    def __init__(self, host: str, key: bytes) -> None:
        self.key = key
        self.listener = socket.create_server((host, 0))
        self.listener.setblocking(False)
        self.address = f"{host}:{self.listener.getsockname()[1]}"
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.unproven: dict[socket.socket, tuple[bytes, float, bytearray]] = {}  # nonce, deadline, bytes so far
        self.proven: dict[socket.socket, bytearray] = {}
        self.rung = -1
        self.refused = 0
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="doorbell", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self.closed:
            try:
                events = self.selector.select(timeout=0.5)
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
            self._drop(conn)
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
            self.proven[conn] = bytearray(rest)
            conn.setblocking(True)
            conn.sendall(_mac(self.key, b"bell", theirs, nonce) + _FRAME.pack(b"W", self.rung)
                         if self.rung >= 0 else _mac(self.key, b"bell", theirs, nonce))
            conn.setblocking(False)
            data = b""
        buf = self.proven[conn]
        buf += data
        while len(buf) >= _FRAME.size:
            kind, epoch = _FRAME.unpack_from(buf)
            del buf[:_FRAME.size]
            if kind == b"R" and epoch > self.rung:
                self.rung = epoch
                self._broadcast(_FRAME.pack(b"W", epoch))

    def _broadcast(self, frame: bytes) -> None:
        for conn in list(self.proven):
            try:
                conn.setblocking(True)
                conn.sendall(frame)
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
    where rank 0 tells the bell's address; ``secret``: the world's shared secret (the engine token)."""

    def __init__(self, host: str, port: int, rank: int, secret: str | None, timeout_s: float = 600.0) -> None:
        key = _key(secret)
        store = store_client(host, port, timeout_s)
        self._bell = None
        if rank == 0:
            self._bell = _Bell(host, key)
            store.set(_ADDRESS_KEY, self._bell.address.encode())
        address = store.get(_ADDRESS_KEY).decode()  # waits for rank 0
        bell_host, _, bell_port = address.rpartition(":")
        self._sock = socket.create_connection((bell_host, int(bell_port)), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._prove(key, address)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self._heard = -1  # the newest epoch the bell told of
        self._pending = b""
        self.epoch = 0

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

    def ring(self) -> None:
        """Wake every rank sleeping in (or about to enter) the current epoch's :meth:`wait`.
        Thread-safe; call it after queueing the work it announces."""
        with self._lock:
            try:
                self._sock.sendall(_FRAME.pack(b"R", self.epoch))
            except OSError:  # the bell's host rank is gone: the sleeping ranks' waits say so
                pass

    def wait(self) -> None:
        """Block until some rank rings this epoch, then move to the next one. Every rank calls it
        at the same step. Raises ConnectionError when the bell's host rank is gone."""
        while self._heard < self.epoch:
            kind, epoch = _FRAME.unpack(_recv_exactly(self._sock, _FRAME.size))
            if kind == b"W":
                self._heard = max(self._heard, epoch)
        with self._lock:
            self.epoch += 1

    def close(self) -> None:
        self._sock.close()
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
