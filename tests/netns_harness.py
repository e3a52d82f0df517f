"""Two "hosts" on one machine: network namespaces joined by a veth pair (root and ``ip netns``), and
``epserve`` processes started inside one. Nothing of their addresses is in ``/etc/hosts`` (the
namespaces share the machine's, whose hostname maps to loopback or nothing), as on containers.

    with two_hosts() as hosts:           # skips the test when namespaces cannot be made
        a = ns_proc(hosts[0], ["engine", ...], log)
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.serve_harness import ROOT, Proc


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # its veth's address, 10.77.<n>.<1|2>
    interface: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def _remove(namespaces: list[str]) -> None:
    for ns in namespaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts(subnet: int | None = None) -> Iterator[tuple[Host, Host]]:
    """Namespaces ``eps-a-<pid>`` (10.77.<n>.1/24) and ``eps-b-<pid>`` (.2), ``lo`` up in each, joined
    by a veth pair; always removed (on exit of the block, and at interpreter exit should that be
    skipped). Skips the calling test when not root or ``ip netns`` fails."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    pid = os.getpid()
    n = subnet if subnet is not None else pid % 250 + 1
    hosts = (Host(f"eps-a-{pid}", f"10.77.{n}.1", f"eps-va{pid}"[:15]),
             Host(f"eps-b-{pid}", f"10.77.{n}.2", f"eps-vb{pid}"[:15]))
    names = [h.namespace for h in hosts]
    atexit.register(_remove, names)
    try:
        try:
            for h in hosts:
                _ip("netns", "add", h.namespace)
            _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
            for h in hosts:
                _ip("link", "set", h.interface, "netns", h.namespace)
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface)
                _ip("-n", h.namespace, "link", "set", h.interface, "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or e
            pytest.skip(f"cannot make network namespaces with `ip netns`: {str(detail).strip()}")
        yield hosts
    finally:
        _remove(names)
        # (ip link add may have left the pair in the root namespace if moving it failed)
        subprocess.run(["ip", "link", "del", hosts[0].interface], capture_output=True, timeout=10)


class NsProc(Proc):
    """:class:`tests.serve_harness.Proc`, run inside a namespace: ``ip netns exec NS python ...``
    (``ip`` execs the command: ``pid`` is the python process)."""

    def __init__(self, namespace: str, args: list[str], log: Path, env: dict[str, str] | None = None,
                 module: bool = True) -> None:
        self.args = args
        self.log = log
        full_env = {**os.environ, "EPSERVE_THREADS_PER_RANK": "1", "EPSERVE_NO_PROGRESS": "1", **(env or {})}
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in wait()
        python = [sys.executable, "-m", "epserve.cli"] if module else [sys.executable]
        self.proc = subprocess.Popen(["ip", "netns", "exec", namespace, *python, *args], stdout=self._log_file,
                                     stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
        self.pids_seen: set[int] = set()


def ns_proc(host: Host, args: list[str], log: Path, env: dict[str, str] | None = None,
            module: bool = True) -> NsProc:
    """An ``epserve`` command (or, ``module=False``, any python command line) on ``host``."""
    return NsProc(host.namespace, args, log, env, module)


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextlib.contextmanager
def inside(host: Host) -> Iterator[None]:
    """The calling thread in ``host``'s network namespace for the block (``setns``, which moves one
    thread): sockets it opens meanwhile (an ``httpx`` request to ``127.0.0.1`` there) belong to that
    namespace, and keep working once the thread is back in its own."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{host.namespace}", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


@dataclass(frozen=True)
class Listener:
    proto: str  # tcp, udp
    address: str  # as ss prints it, brackets and ::ffff: removed: 10.77.3.1, 127.0.0.1, 0.0.0.0, ::, *
    port: int
    pids: tuple[int, ...]


def listening(host: Host) -> list[Listener]:
    """Every listening TCP socket and bound UDP socket in ``host``'s namespace (``ss -Hltunp``)."""
    out = subprocess.run(["ip", "netns", "exec", host.namespace, "ss", "-Hltunp"], check=True,
                         capture_output=True, text=True, timeout=10).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        local = fields[4]
        address, _, port = local.rpartition(":")
        address = address.strip("[]").split("%")[0].removeprefix("::ffff:")  # (an IPv4 one on a v6 socket)
        pids = tuple(int(p) for p in re.findall(r"pid=(\d+)", line))
        found.append(Listener(fields[0], address, int(port), pids))
    return found


def counter(host: Host, name: str) -> int:
    """A statistic of ``host``'s veth interface (``rx_bytes``, ``tx_bytes``)."""
    out = subprocess.run(["ip", "netns", "exec", host.namespace, "cat",
                          f"/sys/class/net/{host.interface}/statistics/{name}"], check=True,
                         capture_output=True, text=True, timeout=10).stdout
    return int(out)
