"""The doorbell's wire (``parallel/bell.py`` serves it, ``parallel/doorbell.py`` dials it): the handshake
by which each end proves that it holds the world's key, and the frames after it, each under a MAC.

Nothing read from the rendezvous store is trusted: anyone who reaches it may write it, and it only
tells a rank which port the bell listens on. The handshake binds each proof to what both ends see
for themselves (:class:`Handshake`):

- a nonce from each side, fresh for the connection (an old handshake does not replay);
- the rank that dials and which side speaks (the bell's proof is not the rank's, reflected);
- the bell's endpoint as the connection shows it: the address the rank dialled, the address the bell
  accepted on. A relay the store points to, passing the handshake through, hands the bell the
  rank's proof for the relay's own address, which the bell refuses before it proves anything;
- the world: its rendezvous store's port (each world has its own store), and its key.

The key (:func:`secret_key`) comes from the engine token and, for a world whose ranks one parent
spawned, from a random secret that parent handed them over their pipes (``parallel/spawned.py``);
neither enters the store or the wire. Without either, the key is public and the proof stops nobody.

After the handshake each direction has its own key, derived from the handshake, and counts its
frames: a frame is ``kind, number, tag`` with ``tag = HMAC(direction key, count, kind, number)``. A
frame injected, modified, replayed or reordered fails its tag (:class:`Tampered`): the receiver drops
the connection at once and acts on nothing of it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import struct
import threading
from dataclasses import dataclass

HELLO = b"EPB2"  # the bell's first bytes, then its nonce
NONCE = 16
MAC = 32  # a proof
TAG = 16  # a frame's MAC (HMAC-SHA256, truncated)
RANK = struct.Struct(">Q")
# Frames (kind, number): rank -> bell: b"R" epoch (ring), b"A" seq (a ping's answer), b"B" (leaving);
# bell -> ranks: b"W" epoch (wake), b"P" seq (ping), b"X" rank (the world is lost).
FRAME = struct.Struct(">cQ")
SEALED = FRAME.size + TAG  # a frame on the wire
PROOF = NONCE + RANK.size + MAC  # the rank's answer to the hello: its nonce, its rank, its proof
UNKNOWN = (1 << 64) - 1
ADDRESS_KEY = "doorbell/address"  # the store key under which rank 0 tells where the bell listens


class Tampered(ValueError):
    """A frame failed its tag: injected, modified, replayed or reordered on the way."""


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def secret_key(secret: str | None, world_secret: bytes | None = None) -> bytes:
    """The world's key: from the engine token (``secret``) and the secret a spawning parent handed its
    ranks (``world_secret``); public (stopping nobody) when both are None."""
    token = (secret or "").encode()
    return hashlib.sha256(b"epserve doorbell\0" + RANK.pack(len(token)) + token + (world_secret or b"")).digest()


def endpoint(sockaddr: tuple) -> str:
    """``host:port`` of a socket address as both ends of a connection write it (an IPv4-mapped IPv6
    address as IPv4, no IPv6 zone: each host names its own interfaces)."""
    host, port = str(sockaddr[0]).split("%")[0], int(sockaddr[1])
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return f"{host}:{port}"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return f"{address}:{port}"


@dataclass(frozen=True)
class Handshake:
    """What one connection's proofs are bound to, as each end sees it for itself."""

    bell_nonce: bytes
    rank_nonce: bytes
    rank: int
    bell_endpoint: str  # the bell's address on this connection (``endpoint``)
    world: int  # the rendezvous store's port

    def _transcript(self) -> bytes:
        where = self.bell_endpoint.encode()
        return (self.bell_nonce + self.rank_nonce + RANK.pack(self.rank) + RANK.pack(self.world)
                + RANK.pack(len(where)) + where)

    def proof(self, key: bytes, side: bytes) -> bytes:
        """``side`` (b"rank" or b"bell") proves that it holds ``key``, for this connection only."""
        return mac(key, b"proof:" + side, self._transcript())

    def channel(self, key: bytes, side: bytes) -> Channel:
        """``side``'s end of the proven connection."""
        other = b"bell" if side == b"rank" else b"rank"
        transcript = self._transcript()
        return Channel(mac(key, b"frames from " + side, transcript), mac(key, b"frames from " + other, transcript))


class Channel:
    """One end's frames on a proven connection: :meth:`seal` what it sends, :meth:`open` what it receives,
    each direction counted from 0. Sealing is thread-safe, but frames must go out in the order sealed:
    seal under the lock that orders the sends."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0
        self._lock = threading.Lock()

    def seal(self, kind: bytes, number: int) -> bytes:
        frame = FRAME.pack(kind, number)
        with self._lock:
            count, self._sent = self._sent, self._sent + 1
        return frame + _tag(self._send_key, count, frame)

    def open(self, buf: bytearray) -> list[tuple[bytes, int]]:
        """Every whole frame at the start of ``buf`` (taken out of it), in order; :class:`Tampered` at the
        first that fails its tag (then drop the connection: nothing of this call is to be acted on)."""
        frames = []
        while len(buf) >= SEALED:
            frame, tag = bytes(buf[:FRAME.size]), bytes(buf[FRAME.size:SEALED])
            if not hmac.compare_digest(tag, _tag(self._recv_key, self._received, frame)):
                raise Tampered(f"frame {self._received} failed its check")
            del buf[:SEALED]
            self._received += 1
            frames.append(FRAME.unpack(frame))
        return frames


def _tag(key: bytes, count: int, frame: bytes) -> bytes:
    return hmac.new(key, RANK.pack(count) + frame, hashlib.sha256).digest()[:TAG]
