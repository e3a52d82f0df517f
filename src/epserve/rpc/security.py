"""Engines, routers and supervisors know each other by the engine token without ever sending it.

Every holder of the token derives the same certificate authority from it (an ECDSA P-256 key from
``scrypt(token)``, so guessing a token offline costs a memory-hard hash per guess) and gives itself a
leaf certificate of its own, signed by that authority. Every engine call then runs over mutual TLS:
the engine accepts only callers whose certificate the authority signed, and the caller talks only to
an engine whose certificate it signed. An impostor without the token fails the handshake before one
byte of a call is sent, so it learns neither the prompts nor the token, and it cannot answer. The
channel is encrypted besides, so nothing on the wire tells the token either.

Without a token (a single-host world nobody else can reach) engines listen in plaintext, as before.
No torch here: the router uses it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from epserve.rpc.convert import GRPC_OPTIONS

__all__ = ["EngineCredentials", "engine_channel", "handshake_refused", "listen"]

PEER_NAME = "epserve-engine"  # the name every leaf certificate carries and every caller checks
_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "epserve engine token authority")])
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
# scrypt's cost: 16 MiB and ~50 ms per derivation (once per process and token).
_SCRYPT = dict(n=1 << 14, r=8, p=1, maxmem=64 << 20, dklen=48)


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class EngineCredentials:
    """This process's TLS identity under one engine token: the authority's certificate (the only
    root it trusts), a fresh leaf key and the leaf's certificate."""

    authority_pem: bytes
    key_pem: bytes
    certificate_pem: bytes

    @staticmethod
    @functools.lru_cache(maxsize=4)
    def of(token: str) -> EngineCredentials:
        if not token:
            raise ValueError("the engine token is empty")
        seed = hashlib.scrypt(token.encode(), salt=b"epserve engine token authority v1", **_SCRYPT)
        authority = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
        ever = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
        ca = (x509.CertificateBuilder().subject_name(_CA_NAME).issuer_name(_CA_NAME)
              .public_key(authority.public_key()).serial_number(1)
              .not_valid_before(ever).not_valid_after(ever.replace(year=2200))
              .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                           data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                           crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
              .add_extension(x509.SubjectKeyIdentifier.from_public_key(authority.public_key()), critical=False)
              .sign(authority, hashes.SHA256()))
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        leaf = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, PEER_NAME)]))
                .issuer_name(_CA_NAME).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=2))  # hosts' clocks differ
                .not_valid_after(now + datetime.timedelta(days=3650))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName(PEER_NAME)]), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.public_key()),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(authority, hashes.SHA256()))
        key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        return EngineCredentials(_pem(ca), key_pem, _pem(leaf))

    def server(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.certificate_pem)],
                                           root_certificates=self.authority_pem, require_client_auth=True)

    def channel(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.authority_pem, self.key_pem, self.certificate_pem)


def engine_channel(address: str, token: str | None, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A channel to the engine at ``address``: mutual TLS under ``token``, plaintext without one."""
    if not token:
        return (grpc.aio.insecure_channel if aio else grpc.insecure_channel)(address, options=GRPC_OPTIONS)
    options = [*GRPC_OPTIONS, ("grpc.ssl_target_name_override", PEER_NAME)]
    secure = grpc.aio.secure_channel if aio else grpc.secure_channel
    return secure(address, EngineCredentials.of(token).channel(), options=options)


def listen(server: grpc.Server | grpc.aio.Server, address: str, token: str | None) -> int:
    """Have ``server`` listen on ``address`` (mutual TLS under ``token``, plaintext without one); the
    port bound. RuntimeError when it cannot."""
    if not token:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, EngineCredentials.of(token).server())


def handshake_refused(details: str | None) -> bool:
    """Whether a failed call's details say the TLS handshake failed: the peer does not hold our
    engine token (or speaks plaintext), so it is not one of ours."""
    text = (details or "").lower()
    return "handshake" in text or "ssl" in text or "certificate" in text
