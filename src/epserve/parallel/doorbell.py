"""How idle ranks sleep until there is work, without spinning (docs/architecture.md, "One step", 4).

When the step's all-reduce says that no rank has work, every rank of the EP group blocks reading its
connection to the bell, a small server on rank 0. A leader that receives a request (or a rank asked
to stop) rings the current epoch; the bell tells every rank, which wakes them at once; they step
again, and the epoch advances. Every rank sleeps and wakes at the same steps, so their epochs agree.

A ring and the epoch advance share a lock: a request pushed to the inbox before the advance is
seen by the step that follows the wake; one pushed after it rings the next epoch (at worst one
spurious wake, never a lost one). The bell tells each epoch once, in order, to every rank, so a
rank that reaches its wait after the ring finds the news already in its socket.

Only ranks of the world talk to the bell: each connection proves, both ways, that it holds the
world's key (from the engine token, and the secret a spawning parent handed its ranks), bound to the
connection and the address the rank dialled, and every frame after that carries a MAC; a frame that
fails it drops the connection and loses the world, acted on by nobody. So a local process can neither
wake the ranks nor keep them from waking, nor relay them through an address it wrote into the
rendezvous store, which tells a rank only the bell's port (``parallel/bell_wire.py`` has the
handshake and the frames, ``parallel/bell.py`` the bell).

The bell also keeps the world honest while it sleeps: it pings every rank each second (at most) and
each rank answers from a reader thread of its own, busy or not. A rank that goes away without saying
so (its process or host died) or misses the pings of the heartbeat timeout (it or its host hung) is
lost, and the bell tells every rank; a rank that hears nothing from the bell for as long loses the
world too. Either way a sleeping rank's :meth:`Doorbell.wait` raises :class:`PeerLost` and the step
loop fails, as a collective would have on the next request. Silence is counted in missed pings, not
wall time, so a whole world stopped and resumed together misjudges no one.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import threading

from epserve.parallel.bell import Bell, heartbeat, recv_exactly
from epserve.parallel.bell_wire import (
    ADDRESS_KEY,
    HELLO,
    MAC,
    NONCE,
    RANK,
    UNKNOWN,
    Channel,
    Handshake,
    Tampered,
    endpoint,
    secret_key,
)
from epserve.parallel.context import store_client
from epserve.parallel.spawned import world_secret

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """A rank of the world died or hung (its host went away, it stopped answering the heartbeat)."""


class Doorbell:
    """One rank's end of the bell (rank 0 also hosts it). ``host``/``port``: the rendezvous store, where
    rank 0 tells the bell's port (the bell listens on ``host``; the store's port names the world in the
    proofs); ``secret``: the engine token, which keys the world with the secret a spawning parent handed
    this rank, if any (``parallel/spawned.py``); ``heartbeat_timeout_s``: how long a silent peer (or
    bell) may stay silent before the world is lost (the step timeout: the same bound as for a step that
    makes no progress)."""

    def __init__(self, host: str, port: int, rank: int, secret: str | None, timeout_s: float = 600.0,
                 heartbeat_timeout_s: float = 60.0) -> None:
        key = secret_key(secret, world_secret())
        store = store_client(host, port, timeout_s)
        self._bell = None
        if rank == 0:
            self._bell = Bell(host, key, heartbeat_timeout_s, port)
            store.set(ADDRESS_KEY, self._bell.address.encode())
            bell_port = self._bell.port
        else:
            bell_port = _port(store.get(ADDRESS_KEY))  # (waits for rank 0)
        self._sock = socket.create_connection((host, bell_port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._channel = self._prove(key, rank, port, f"{host}:{bell_port}")
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the epoch
        self._news = threading.Condition()
        self._heard = -1  # the newest epoch the bell told of
        self.lost: str | None = None  # why the world is lost, once it is
        self._closing = False
        self.epoch = 0
        interval, self._max_missed = heartbeat(heartbeat_timeout_s)
        self._sock.settimeout(interval)
        self._reader = threading.Thread(target=self._listen, name="doorbell-rank", daemon=True)
        self._reader.start()

    def _prove(self, key: bytes, rank: int, world: int, address: str) -> Channel:
        """The handshake (``parallel/bell_wire.py``), bound to the address this rank dialled: a relay
        there that passes it through gets a proof for its own address, which the bell refuses."""
        hello = recv_exactly(self._sock, len(HELLO) + NONCE)
        if not hello.startswith(HELLO):
            raise RuntimeError(f"the doorbell at {address} is not an epserve doorbell (or of another version)")
        shake = Handshake(hello[len(HELLO):], os.urandom(NONCE), rank, endpoint(self._sock.getpeername()), world)
        self._sock.sendall(shake.rank_nonce + RANK.pack(rank) + shake.proof(key, b"rank"))
        try:
            proof = recv_exactly(self._sock, MAC)
        except ConnectionError:
            raise RuntimeError(f"the doorbell at {address} refused this rank's proof (another engine token, another "
                               "world, or a relay in between: the store's address was rewritten?)") from None
        if not hmac.compare_digest(proof, shake.proof(key, b"bell")):
            raise RuntimeError(f"the doorbell at {address} does not hold the world's secret: not ours")
        return shake.channel(key, b"rank")

    def _send(self, kind: bytes, number: int) -> None:
        with self._send_lock:  # (frames go out in the order sealed: each counts in its tag)
            try:
                self._sock.sendall(self._channel.seal(kind, number))
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
                if missed >= self._max_missed:
                    return self._lose("the doorbell's host rank (rank 0) stopped answering (it or its host hung)")
                continue
            except OSError:
                data = b""
            if not data:
                return self._lose("the doorbell's host rank (rank 0) went away (its process or host died)")
            missed = 0
            buf += data
            try:
                frames = self._channel.open(buf)
            except Tampered as e:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)  # nothing more of it is read or acted on
                return self._lose(f"the doorbell's connection carried a frame that failed its check ({e}: injected, "
                                  "modified or replayed on the way); dropped it")
            for kind, number in frames:
                if kind == b"P":
                    self._send(b"A", number)
                elif kind == b"W":
                    with self._news:
                        self._heard = max(self._heard, number)
                        self._news.notify_all()
                elif kind == b"X":
                    who = "a rank" if number == UNKNOWN else f"rank {number}"
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
            self._send(b"R", self.epoch)

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
        self._send(b"B", 0)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._reader.join(2.0)
        if self._bell is not None:
            self._bell.close()


def _port(told: bytes) -> int:
    """The bell's port from the store's ``host:port``: only the port is taken, and trusted no further than
    the handshake binds it (the host is this rank's own rendezvous host)."""
    port = told.decode(errors="replace").rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise RuntimeError(f"the rendezvous store tells no port for the doorbell ({told[:64]!r}): rewritten?")
    return int(port)


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
