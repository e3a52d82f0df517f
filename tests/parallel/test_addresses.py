"""Which address and interface a rank faces its peers with (parallel/addresses.py), and the gloo/NCCL
interface variables it sets (env.collectives_on): pure functions, given the host's interfaces and routes."""

from __future__ import annotations

import errno
import socket

import pytest

from epserve import env
from epserve.parallel.addresses import (
    RendezvousError,
    facing_peers,
    interface_of,
    local_interfaces,
    route_source,
    store_listens_everywhere,
    wait_reachable,
)
from epserve.parallel.launch import free_port

NICS = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.1.2.3", "fe80::1"], "veth1": ["10.77.0.2"]}


def _nics():
    return NICS


def _route(table: dict[str, str]):
    def route(host: str) -> str:
        if host not in table:
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        return table[host]
    return route


def test_the_interface_that_routes_to_the_master():
    peer = facing_peers("10.77.0.1", True, interfaces=_nics, route=_route({"10.77.0.1": "10.77.0.2"}))
    assert (peer.address, peer.interface) == ("10.77.0.2", "veth1")
    assert peer.reason == "route to 10.77.0.1"
    assert peer.describe() == "10.77.0.2, interface veth1"


def test_a_loopback_master_stays_on_loopback():
    for multi_host in (False, True):  # several "hosts" on one machine (tests) meet on lo too
        for master in ("127.0.0.1", "localhost", "127.0.1.1", "::1"):
            peer = facing_peers(master, multi_host, interfaces=_nics, route=_route({}))
            assert peer.interface == "lo", master


def test_node_ip_wins_over_the_route():
    peer = facing_peers("10.77.0.1", True, node_ip="10.1.2.3", interfaces=_nics,
                        route=_route({"10.77.0.1": "10.77.0.2"}))
    assert (peer.address, peer.interface, peer.reason) == ("10.1.2.3", "eth0", "--node-ip")
    with pytest.raises(RendezvousError, match="no interface of this host has the address 10.9.9.9"):
        facing_peers("10.77.0.1", True, node_ip="10.9.9.9", interfaces=_nics, route=_route({}))


def test_master_name_that_is_loopback_here_takes_the_default_route():
    """Host A of a Debian-style /etc/hosts (``hostA`` -> 127.0.1.1) with peers on other hosts."""
    table = {"hostA": "127.0.0.1", "192.0.2.1": "10.1.2.3"}
    peer = facing_peers("hostA", True, interfaces=_nics, route=_route(table))
    assert (peer.interface, peer.reason) == ("eth0", "default route")
    assert facing_peers("hostA", False, interfaces=_nics, route=_route(table)).interface == "lo"
    with pytest.raises(RendezvousError, match="give --node-ip"):
        facing_peers("hostA", True, interfaces=_nics, route=_route({"hostA": "127.0.0.1"}))


def test_no_route_is_one_line():
    with pytest.raises(RendezvousError, match=r"no route from this host to the master address 10\.5\.5\.5") as e:
        facing_peers("10.5.5.5", True, interfaces=_nics, route=_route({}))
    assert "\n" not in str(e.value)


def test_store_listens_everywhere_only_for_a_loopback_name_across_hosts():
    def resolve(host):
        return {"hostA": "127.0.1.1", "hostB": "10.0.0.2"}[host]
    assert store_listens_everywhere("hostA", True, resolve)
    assert not store_listens_everywhere("hostA", False, resolve)
    assert not store_listens_everywhere("hostB", True, resolve)
    assert not store_listens_everywhere("127.0.0.1", True, resolve)  # one machine: loopback only


def test_interface_of_and_this_hosts_interfaces():
    assert interface_of("10.77.0.2", NICS) == "veth1"
    assert interface_of("fe80::1", NICS) == "eth0"
    assert interface_of("10.0.0.9", NICS) is None
    here = local_interfaces()
    assert "127.0.0.1" in here.get("lo", [])
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of(route_source("127.0.0.1"), here) == "lo"


def test_the_variables_the_user_set_win(monkeypatch):
    # (a copy of the environment for the test: what collectives_on sets must not leak into later tests'
    # gloo groups, which would look for these interfaces)
    monkeypatch.setattr(env.os, "environ", {k: v for k, v in env.os.environ.items()
                                            if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")})
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert env.collectives_on("veth1") == {"GLOO_SOCKET_IFNAME": "veth1"}
    assert env.os.environ["GLOO_SOCKET_IFNAME"] == "veth1"
    assert env.os.environ["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # empty: not a choice
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert env.collectives_on_loopback() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_an_unreachable_rendezvous_fails_in_one_line_within_the_timeout():
    port = free_port()  # nobody listens there
    peer = facing_peers("127.0.0.1", False)
    with pytest.raises(RendezvousError) as e:
        wait_reachable("127.0.0.1", port, 0.5, peer)
    assert str(e.value) == (f"cannot reach the rendezvous at 127.0.0.1:{port} within 0.5 s "
                            "(from 127.0.0.1, interface lo): connection refused")

    def silent(address, timeout):
        raise TimeoutError("timed out")
    with pytest.raises(RendezvousError, match=r"at 10\.0\.0\.9:29500 within 0\.3 s: no answer"):
        wait_reachable("10.0.0.9", 29500, 0.3, connect=silent)


def test_a_rendezvous_that_comes_up_later_is_waited_for():
    calls = []

    def late(address, timeout):
        calls.append(address)
        if len(calls) < 3:
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
        return socket.socket()
    wait_reachable("10.0.0.1", 29500, 10.0, connect=late)
    assert calls == [("10.0.0.1", 29500)] * 3


def test_node_ip_and_rendezvous_timeout_options_reach_the_parallel_config(tiny_ckpt):
    from epserve.cli import build_parser
    from epserve.engine.args import engine_config

    args = build_parser().parse_args(["engine", str(tiny_ckpt), "--node-ip", "10.0.0.2", "--rendezvous-timeout", "5"])
    pc = engine_config(args).parallel
    assert (pc.node_ip, pc.rendezvous_timeout_s) == ("10.0.0.2", 5.0)
    pc = engine_config(build_parser().parse_args(["engine", str(tiny_ckpt)])).parallel
    assert (pc.node_ip, pc.rendezvous_timeout_s) == (None, 60.0)
