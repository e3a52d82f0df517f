"""Which of this host's addresses and interfaces a rank uses to meet its peers (torch-free).

gloo and NCCL bind their pair sockets to the address of the host's name unless told an interface
(``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``); in containers and on Debian-style ``/etc/hosts`` the
host's name resolves to loopback, so a rank on host A would advertise 127.0.0.1 to host B. Instead a
rank uses the interface that routes to the master address, found without sending a packet (a UDP
socket's ``connect`` only picks the route and source address), or the interface of ``--node-ip``.
A world whose master address is a loopback literal stays on ``lo`` (one host; or several "hosts" on
one machine, as tests do). Variables the user set always win (``env.collectives_on``).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

LOOPBACK_INTERFACE = "lo"
_SIOCGIFADDR = 0x8915
_DEFAULT_ROUTE_PROBE = "192.0.2.1"  # TEST-NET-1: only asks the kernel which route it would take


class RendezvousError(RuntimeError):
    """A rank could not reach (or pick an address for) the rendezvous; the message is one line."""


@dataclass(frozen=True)
class PeerAddress:
    """This host's address the peers reach, its interface, and why it was chosen."""

    address: str
    interface: str
    reason: str  # "route to 10.0.0.1", "--node-ip", "loopback world"

    def describe(self) -> str:
        return f"{self.address}, interface {self.interface}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` literally names loopback (``localhost``, ``127.x``, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve(host: str) -> str:
    """``host``'s first address (IPv4 first, as gloo's resolution does)."""
    infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_DGRAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


def route_source(host: str, port: int = 9) -> str:
    """The local address this host would send from to reach ``host`` (no packet leaves: ``connect``
    on a UDP socket only chooses the route). OSError when no route leads there."""
    address = resolve(host)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, port))
        return s.getsockname()[0]


def local_interfaces() -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 by ``SIOCGIFADDR``, IPv6 from ``/proc/net/if_inet6``)."""
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            out[name] = []
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                out[name].append(socket.inet_ntoa(raw[20:24]))
            except OSError:
                pass  # no IPv4 address
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    packed = bytes.fromhex(fields[0])
                    out.setdefault(fields[5], []).append(socket.inet_ntop(socket.AF_INET6, packed))
    except OSError:
        pass
    return out


def interface_of(address: str, interfaces: Mapping[str, list[str]]) -> str | None:
    """The interface that holds ``address``; None if none does."""
    want = ipaddress.ip_address(address.split("%")[0])
    for name, addresses in interfaces.items():
        if any(ipaddress.ip_address(a.split("%")[0]) == want for a in addresses):
            return name
    return None


def facing_peers(
    master_addr: str,
    multi_host: bool,
    node_ip: str | None = None,
    interfaces: Callable[[], Mapping[str, list[str]]] = local_interfaces,
    route: Callable[[str], str] = route_source,
) -> PeerAddress:
    """The address and interface this host's ranks use towards their peers.

    ``node_ip`` (``--node-ip``) wins; a loopback literal master stays on ``lo``; else the interface
    that routes to the master. A master name that resolves to loopback here while the world spans
    hosts (this is the master's host, its name in ``/etc/hosts`` as 127.0.1.1) takes the interface of
    the default route. RendezvousError (one line) when none can be found."""
    nics = interfaces()
    if node_ip:
        try:
            address = resolve(node_ip)
        except OSError as e:
            raise RendezvousError(f"--node-ip {node_ip}: cannot resolve it ({e.strerror or e})") from None
        nic = interface_of(address, nics)
        if nic is None:
            raise RendezvousError(f"--node-ip {node_ip}: no interface of this host has the address {address}")
        return PeerAddress(address, nic, "--node-ip")
    if is_loopback(master_addr):
        return PeerAddress("127.0.0.1" if ":" not in master_addr else "::1", LOOPBACK_INTERFACE, "loopback world")
    try:
        source, reason = route(master_addr), f"route to {master_addr}"
    except OSError as e:
        raise RendezvousError(f"no route from this host to the master address {master_addr} "
                              f"({e.strerror or e}); give --node-ip") from None
    if ipaddress.ip_address(source.split("%")[0]).is_loopback and multi_host:
        try:  # the master's own name, resolving to loopback here: the default route's interface
            source, reason = route(_DEFAULT_ROUTE_PROBE), "default route"
        except OSError:
            raise RendezvousError(f"the master address {master_addr} is loopback on this host but the world spans "
                                  "hosts, and there is no default route: give --node-ip") from None
    nic = interface_of(source, nics)
    if nic is None:
        raise RendezvousError(f"no interface of this host has the address {source} (the {reason}): give --node-ip")
    return PeerAddress(source, nic, reason)


def store_listens_everywhere(master_addr: str, multi_host: bool, resolve: Callable[[str], str] = resolve) -> bool:
    """Whether the rank-0 store must listen on every interface rather than on the master address: the
    master's name resolves to loopback on its own host (``/etc/hosts``) while peers on other hosts
    reach it by that name through their resolver."""
    if not multi_host or is_loopback(master_addr):
        return False
    try:
        return ipaddress.ip_address(resolve(master_addr).split("%")[0]).is_loopback
    except (OSError, ValueError):
        return False


def wait_reachable(host: str, port: int, timeout_s: float, peer: PeerAddress | None = None,
                   connect: Callable[[tuple[str, int], float], socket.socket] = socket.create_connection) -> None:
    """Wait (at most ``timeout_s``) until something accepts TCP connections on ``host:port`` (the
    rank-0 store may start later than this rank); RendezvousError in one line when nothing does."""
    deadline = time.monotonic() + timeout_s
    last = "nobody answered"
    while True:
        left = deadline - time.monotonic()
        try:
            connect((host, port), max(0.1, min(left, 5.0))).close()
            return
        except OSError as e:
            if e.errno == errno.ECONNREFUSED:
                last = "connection refused"
            elif isinstance(e, socket.gaierror):
                last = f"cannot resolve {host}"
            elif isinstance(e, TimeoutError | socket.timeout):
                last = "no answer"
            else:
                last = e.strerror or str(e)
        if time.monotonic() + 0.2 >= deadline:
            where = f" (from {peer.describe()})" if peer is not None else ""
            raise RendezvousError(f"cannot reach the rendezvous at {host}:{port} within {timeout_s:g} s{where}: "
                                  f"{last}")
        time.sleep(0.2)
