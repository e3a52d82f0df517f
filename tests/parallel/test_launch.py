"""Rank processes: failure reports (the root cause first, even when a peer's failure arrives before it;
identical failures grouped, tracebacks cut to a line) and notices a rank sends while a call runs."""

from __future__ import annotations

import logging
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from epserve.parallel.launch import RankFailure, RankProcesses
from epserve.parallel.process import failure_message, last_line, process_state
from epserve.parallel.spawned import RankInfo, notify_parent
from tests.serve_harness import alive, freeze, thaw


def test_failure_message_puts_deaths_first_and_groups_ranks():
    msg = failure_message({0: "failed: RuntimeError: Connection closed by peer", 3: "died with exit code -9 (SIGKILL)",
                            2: "failed: RuntimeError: Connection closed by peer"})
    assert msg == ("rank 3 died with exit code -9 (SIGKILL); "
                   "ranks 0, 2 failed: RuntimeError: Connection closed by peer")


def test_last_line_of_a_traceback():
    trace = ('Traceback (most recent call last):\n  File "x.py", line 1\n'
             "epserve.engine.memory.OutOfMemoryError: weights need 5 MiB\n")
    assert last_line(trace) == "failed: OutOfMemoryError: weights need 5 MiB"
    gloo = "RuntimeError: [pair.cc:553] Connection closed by peer. This is typically caused by a remote worker"
    assert last_line(gloo) == "failed: RuntimeError: [pair.cc:553] Connection closed by peer"


# ---- rank processes: notices, and the report of a rank that died ----------------------------------
@dataclass(frozen=True)
class Announce:
    """Each rank notifies its rank number, then waits (up to 30 s) until the parent has seen every
    notice (the ``seen`` event the ranks were started with): the call cannot return before, so a
    notice must reach ``on_notice`` while it runs."""


@dataclass(frozen=True)
class DieOrFail:
    """The rank with pid ``victim`` SIGKILLs itself (``stop``: SIGSTOPs itself); the others wait until
    it is dead (a zombie, while its reaper is frozen) or stopped, then fail as gloo does."""

    victim: int
    stop: bool = False


class Toy:
    def __init__(self, info: RankInfo, seen: Any) -> None:
        self.rank = info.rank
        self.seen = seen

    def handle(self, command: object) -> object:
        if isinstance(command, Announce):
            notify_parent(self.rank)
            if not self.seen.wait(30):
                raise RuntimeError("the parent never saw the notices")
            return "done"
        if isinstance(command, DieOrFail):
            if os.getpid() == command.victim:
                os.kill(os.getpid(), signal.SIGSTOP if command.stop else signal.SIGKILL)
            deadline = time.monotonic() + 30
            while alive(command.victim) and process_state(command.victim) != "T":
                assert time.monotonic() < deadline, "the victim did not die"
                time.sleep(0.01)
            if command.stop:
                raise RuntimeError("[unbound_buffer.cc:129] Timed out waiting 3000ms for send operation to complete")
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
        raise TypeError(command)

    def close(self) -> None:
        pass


def toy_rank(info: RankInfo, seen: Any = None) -> Toy:
    return Toy(info, seen)


def _infos(world: int) -> list[RankInfo]:
    return [RankInfo(r, r, world, "127.0.0.1", 0) for r in range(world)]


def test_notices_reach_the_caller_while_the_call_runs():
    seen = mp.get_context("forkserver").Event()
    ranks = RankProcesses(toy_rank, _infos(2), (seen,), start_method="forkserver")
    try:
        notices: list[int] = []

        def on_notice(value: int) -> None:
            notices.append(value)
            if len(notices) == 2:
                seen.set()

        assert ranks.call(Announce(), on_notice=on_notice) == "done"
        assert sorted(notices) == [0, 1]
        assert notify_parent("x") is False  # this process has no RankProcesses parent
    finally:
        ranks.close()


def test_a_killed_rank_is_named_even_when_its_peer_fails_first(caplog):
    """Rank 1 is SIGKILLed; rank 0 fails after it (as its gloo collective would) and says so first,
    while the forkserver, which reaps rank 1 and reports its exit code, is frozen: the report still
    puts rank 1's death first (it used to name only rank 0's failure)."""
    ranks = RankProcesses(toy_rank, _infos(2), start_method="forkserver")
    forkserver = mp_forkserver._forkserver._forkserver_pid
    failure: list[BaseException] = []

    def call() -> None:
        try:
            ranks.call(DieOrFail(ranks.pids[1]))
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=call, daemon=True)
    caplog.set_level(logging.ERROR, logger="epserve.parallel.launch")
    freeze([forkserver])
    try:
        thread.start()
        deadline = time.monotonic() + 30
        while not any("stopping the other ranks" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no failure reported"
            time.sleep(0.05)
    finally:
        thaw([forkserver])
    thread.join(30)
    assert failure and isinstance(failure[0], RankFailure), failure
    message = str(failure[0])
    assert message.startswith("rank 1 died"), message
    assert "rank 0 failed: RuntimeError: [pair.cc:553] Connection closed by peer" in message
    assert not any(alive(pid) for pid in ranks.pids)


def test_a_stopped_rank_is_named_before_the_peer_whose_collective_timed_out():
    """Rank 1 SIGSTOPs itself; rank 0's collective times out: the report names rank 1 first."""
    ranks = RankProcesses(toy_rank, _infos(2), start_method="forkserver")
    try:
        ranks.call(DieOrFail(ranks.pids[1], stop=True))
    except RankFailure as e:
        message = str(e)
    else:
        raise AssertionError("no failure")
    assert message.startswith("rank 1 was stopped (SIGSTOP); rank 0 failed: RuntimeError: "), message
    assert not any(alive(pid) for pid in ranks.pids)  # killed, not left stopped


def test_free_port_is_below_the_ephemeral_range():
    """A client's retried connect can be given an ephemeral source port equal to the server's port and
    connect to itself; ports chosen below that range cannot be."""
    import socket

    from epserve.parallel import launch

    low = launch._ephemeral_low()
    ports = {launch.free_port() for _ in range(20)}
    if low - launch._LISTEN_PORTS_FROM >= 1024:
        assert all(launch._LISTEN_PORTS_FROM <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
