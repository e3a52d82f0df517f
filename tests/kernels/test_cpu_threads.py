"""How the CPU kernels share the cores (``kernels/cpu_threads.py``, ``cpu_threads.c``): the load read from
``/proc`` readings, the waits' decision with its hysteresis, brief waits that leave an idle thread asleep,
the monitor switching them beside a busy process, and recorded steps that take the thread count at replay
with the same bits."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from epserve.kernels import cpu, cpu_ops, cpu_threads
from epserve.kernels.cpu_graph import record

STAT = """cpu  9 9 9 9 9 9 9 9 0 0
cpu0 {u0} 0 {s0} {i0} 10 0 0 0 0 0
cpu1 {u1} 0 {s1} {i1} 0 0 0 0 0 0
cpu2 500 0 500 0 0 0 0 0 0 0
intr 123 4 5
"""
SELF = "4321 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 {ut} {st} 0 0 20 0 9 0 100"


def _reading(u0: int, u1: int, idle0: int, idle1: int, own: int) -> cpu_threads.CoreSample:
    stat = STAT.format(u0=u0, s0=5, i0=idle0, u1=u1, s1=5, i1=idle1)
    return cpu_threads.read_sample({0, 1}, stat, SELF.format(ut=own, st=3))


def test_a_reading_counts_this_processs_cores_and_its_own_jiffies():
    s = _reading(100, 40, 800, 800, 17)
    assert s == cpu_threads.CoreSample(busy=100 + 5 + 40 + 5, total=100 + 5 + 800 + 10 + 40 + 5 + 800, own=20, cores=2)
    assert cpu_threads.read_sample({2}, STAT.format(u0=0, s0=0, i0=0, u1=0, s1=0, i1=0), SELF.format(ut=0, st=0)).busy \
        == 1000  # cpu2 alone; the "cpu" total line is never a core
    real = cpu_threads.read_sample()  # this host's /proc
    assert real.cores == len(os.sched_getaffinity(0)) and 0 <= real.busy <= real.total and real.own > 0


def test_other_work_is_the_cores_busy_time_less_this_processs_own():
    before = _reading(100, 100, 1000, 1000, 50)
    # 15 jiffies a core pass: core 0 busy all of them, core 1 ten of them; this process ran 10 of the 25
    after = _reading(115, 110, 1000, 1005, 60)
    assert cpu_threads.others_busy(before, after) == pytest.approx((25 - 10) / 15)
    quiet = _reading(103, 100, 1012, 1015, 53)  # only this process's own 3 jiffies
    assert cpu_threads.others_busy(before, quiet) == 0.0
    assert cpu_threads.others_busy(before, before) == 0.0  # no time passed


def test_the_waits_turn_brief_from_half_a_core_of_other_work_and_spin_again_under_a_quarter():
    assert not cpu_threads.decide(0.4, brief=False)
    assert cpu_threads.decide(0.5, brief=False)
    assert cpu_threads.decide(0.3, brief=True)  # between the two: as they are
    assert not cpu_threads.decide(0.2, brief=True)


needs_ops = pytest.mark.skipif(not (cpu.available(cpu.OPS) and cpu.available(torch.float32)),
                               reason="the CPU kernels need AVX2 and a C compiler")


def _idle_cpu_ms(kernel) -> float:  # noqa: ANN001
    """This process's CPU time (ms) over 50 ms of sleep just after ``kernel()`` ran a parallel region."""
    kernel()
    start = time.process_time()
    time.sleep(0.05)
    return 1e3 * (time.process_time() - start)


@needs_ops
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: no team to wait")
def test_brief_waits_leave_the_kernels_idle_threads_asleep(monkeypatch):
    """libgomp's threads spin for milliseconds after a parallel region; with the waits brief they sleep at
    once (the whole process burns well under a millisecond over 50 ms of idle), and the holder's threads go
    again when the waits spin."""
    monkeypatch.setenv("EPSERVE_CPU_ADAPT", "0")
    cpu_threads.stop()
    lib = cpu._library(cpu.OPS)
    x, w = torch.randn(2, 256), torch.randn(4096, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    tasks = len(os.listdir("/proc/self/task"))
    try:
        assert lib.epserve_brief_waits(1) == os.cpu_count() + 1
        assert len(os.listdir("/proc/self/task")) > tasks
        burnt = [_idle_cpu_ms(lambda: cpu.linear(x, w)) for _ in range(5)]
        assert statistics.median(burnt) < 1.0, burnt  # spinning: 3.5 ms each on a 2-core EPYC
    finally:
        assert lib.epserve_brief_waits(0) == 0
        torch.set_num_threads(threads)
    assert len(os.listdir("/proc/self/task")) <= tasks + 1  # (+1: the team of 2 the kernel call left)


@needs_ops
def test_the_monitor_makes_the_waits_brief_beside_a_busy_process(monkeypatch):
    monkeypatch.setenv("EPSERVE_CPU_ADAPT", "1")
    cpu_threads.stop()
    cpu_threads.threads()  # the monitor starts (the library is loaded)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 5
        while not cpu_threads.state()[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        brief, others = cpu_threads.state()
        assert brief and others >= cpu_threads.SPIN_BELOW
    finally:
        busy.kill()
        busy.wait()
        cpu_threads.stop()
    assert cpu_threads.state() == (False, 0.0)


def _step(x, counts, w, w13, w2, q, cache, tables, lens, wh):  # noqa: ANN001, ANN202
    """Every kernel that takes a thread count: a linear, the experts on device counts, MLA decode, a per-head
    projection."""
    y = cpu.linear(x, w)
    experts = cpu.moe_swiglu_counts(y, counts, w13, w2)
    o = cpu_ops.mla_decode(q, cache, tables, lens, 0.1, 64)
    return experts, cpu_ops.head_matmul(o, wh)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_recorded_step_replays_on_any_thread_count_with_the_same_bits(dtype):
    if not cpu.available(dtype):
        pytest.skip(f"no {dtype} kernels here")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g).to(dtype)
    w = (torch.randn(64, 64, generator=g) * 0.1).to(dtype)
    counts = torch.tensor([2, 0, 3, 1])
    w13 = (torch.randn(4, 64, 64, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(4, 64, 32, generator=g) * 0.1).to(dtype)
    q = torch.randn(2, 4, 72, generator=g)
    cache = torch.randn(40, 16, 72, generator=g).to(dtype)
    tables = torch.arange(40).view(2, 20)
    lens = torch.tensor([300, 270])  # enough work for every thread (the kernel's threshold)
    wh = torch.randn(4, 64, 64, generator=g) * 0.1
    args = (x, counts, w, w13, w2, q, cache, tables, lens, wh)
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            graph, out = record(lambda: _step(*args), [x, counts, q, cache, lens])
            assert graph.threads == threads and {c.threads for c in graph.calls} == {6, 9, 14, 13}
            x.copy_(torch.randn(6, 64, generator=g).to(dtype))  # new inputs, as engine/graphs.py writes them
            q.copy_(torch.randn(2, 4, 72, generator=g))
            want = [t.clone() for t in _step(*args)]  # eager, on this process's threads
            for n in (1, 2):
                torch.set_num_threads(n)
                graph.replay()  # the thread count is the one torch has now
                assert graph.threads == n
                assert all(c.args[c.threads] == n for c in graph.calls if c.threads is not None)
                assert all(torch.equal(o, e) for o, e in zip(out, want)), n
    finally:
        torch.set_num_threads(threads)
