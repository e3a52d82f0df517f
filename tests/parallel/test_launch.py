"""Rank-failure reports: the root cause first, identical failures grouped, tracebacks cut to a line."""

from __future__ import annotations

from epserve.parallel.launch import _failure_message, _last_line


def test_failure_message_puts_deaths_first_and_groups_ranks():
    msg = _failure_message({0: "failed: RuntimeError: Connection closed by peer", 3: "died with exit code -9 (SIGKILL)",
                            2: "failed: RuntimeError: Connection closed by peer"})
    assert msg == ("rank 3 died with exit code -9 (SIGKILL); "
                   "ranks 0, 2 failed: RuntimeError: Connection closed by peer")


def test_last_line_of_a_traceback():
    trace = ('Traceback (most recent call last):\n  File "x.py", line 1\n'
             "epserve.engine.memory.OutOfMemoryError: weights need 5 MiB\n")
    assert _last_line(trace) == "failed: OutOfMemoryError: weights need 5 MiB"
    gloo = "RuntimeError: [pair.cc:553] Connection closed by peer. This is typically caused by a remote worker"
    assert _last_line(gloo) == "failed: RuntimeError: [pair.cc:553] Connection closed by peer"
