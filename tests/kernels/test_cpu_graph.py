"""The CPU's captured decode at the kernel level (``kernels/cpu_graph.py``): a recorded sequence of C kernel
calls replays on new input data with the results the eager calls give, and a recording refuses any torch op
on the step's data (it would be frozen into the recording)."""

from __future__ import annotations

import threading

import pytest
import torch

from epserve.kernels import add, cast, cpu, gather_rows, linear, rms_norm, silu_mul
from epserve.kernels.cpu_graph import CaptureError, record

pytestmark = pytest.mark.skipif(not (cpu.available(cpu.OPS) and cpu.available(torch.bfloat16)),
                                reason="the CPU kernels need AVX512-BF16, AVX2 and a C compiler")


def _step(table, ids, norm_w, w13, w2):
    """A miniature decode step: embedding, norm, a residual add, a SwiGLU MLP (linear, activation, linear)."""
    x = gather_rows(table, ids)
    h = rms_norm(x, norm_w, 1e-6)
    y = linear(silu_mul(linear(h, w13)), w2)
    return add(x, y)


def _weights(g):
    table = torch.randn(50, 64, generator=g).to(torch.bfloat16)
    norm_w = torch.rand(64, generator=g).to(torch.bfloat16) + 0.5
    w13 = (torch.randn(96, 64, generator=g) * 0.1).to(torch.bfloat16)
    w2 = (torch.randn(64, 48, generator=g) * 0.1).to(torch.bfloat16)
    return table, norm_w, w13, w2


def test_a_replay_computes_what_eager_calls_compute_on_new_inputs():
    g = torch.Generator().manual_seed(0)
    table, norm_w, w13, w2 = _weights(g)
    ids = torch.tensor([3, 17, 42])
    with torch.inference_mode():
        graph, out = record(lambda: _step(table, ids, norm_w, w13, w2), [ids])
        assert torch.equal(out, _step(table, ids, norm_w, w13, w2))  # the recording run is a real run
        assert [c.name for c in graph.calls] == ["epserve_gather_rows", "epserve_rms_norm", "epserve_linear_bf16",
                                                 "epserve_silu_mul", "epserve_linear_bf16", "epserve_add"]
        for new in ([0, 1, 2], [49, 5, 5]):
            ids.copy_(torch.tensor(new))  # the step's input, rewritten in place as engine/graphs.py does
            graph.replay()
            assert torch.equal(out, _step(table, ids, norm_w, w13, w2))  # bit for bit: the same kernels
        seconds = graph.timer()
        graph.replay(seconds)
        assert len(seconds) == len(graph.calls) and all(s > 0 for s in seconds)


def test_a_replay_reports_a_call_that_refuses_its_inputs():
    g = torch.Generator().manual_seed(1)
    table, *_ = _weights(g)
    ids = torch.tensor([1, 2])
    with torch.inference_mode():
        graph, _ = record(lambda: gather_rows(table, ids, torch.float32), [ids])
        ids[1] = 50  # past the table
        with pytest.raises(IndexError, match="epserve_gather_rows refused"):
            graph.replay()


def test_a_recording_refuses_torch_ops_on_the_steps_data():
    g = torch.Generator().manual_seed(2)
    table, norm_w, *_ = _weights(g)
    ids = torch.tensor([4, 5])
    with torch.inference_mode():
        with pytest.raises(CaptureError, match="aten.add"):  # computing on an input
            record(lambda: gather_rows(table, ids + 1), [ids])
        with pytest.raises(CaptureError, match="aten.item"):  # reading it on the host
            record(lambda: gather_rows(table, ids[: int(ids[0])]), [ids])
        with pytest.raises(CaptureError, match="aten.mul"):  # computing on a kernel's output
            record(lambda: gather_rows(table, ids) * 2, [ids])
        with pytest.raises(CaptureError, match="no C kernel"):
            record(lambda: table[:2], [ids])
        with pytest.raises(CaptureError, match="aten.mul"):  # on a tensor made during the recording
            record(lambda: rms_norm(gather_rows(table, ids), norm_w.float() * 2, 1e-6), [ids])
        # An op on weights alone and views of the step's tensors are fine.
        graph, out = record(lambda: rms_norm(cast(gather_rows(table, ids), torch.float32)[:, :32],
                                             norm_w[:32].float(), 1e-6), [ids])
        ids.copy_(torch.tensor([7, 8]))
        graph.replay()
        assert torch.equal(out, rms_norm(table[ids].float()[:, :32], norm_w[:32].float(), 1e-6))


def test_kernel_calls_outside_a_recording_are_not_recorded():
    g = torch.Generator().manual_seed(3)
    table, *_ = _weights(g)
    ids = torch.tensor([1])
    with torch.inference_mode():
        graph, _ = record(lambda: gather_rows(table, ids), [ids])
        gather_rows(table, ids)  # eager again: nothing appended
        assert len(graph.calls) == 1 and cpu._recording.recorder is None
        with pytest.raises(CaptureError):
            record(lambda: gather_rows(table, ids) + 0, [ids])
        assert cpu._recording.recorder is None  # a failed recording leaves the kernels eager


def test_only_the_recording_threads_calls_are_recorded():
    """Another thread's kernel calls during a recording (a server's other threads) run eagerly, unrecorded."""
    g = torch.Generator().manual_seed(4)
    table, *_ = _weights(g)
    ids = torch.tensor([2, 3])
    other: list[torch.Tensor] = []

    def forward():  # noqa: ANN202
        worker = threading.Thread(target=lambda: other.append(gather_rows(table, torch.tensor([9]))))
        worker.start()
        worker.join()
        return gather_rows(table, ids)

    with torch.inference_mode():
        graph, _ = record(forward, [ids])
    assert [c.name for c in graph.calls] == ["epserve_gather_rows"] and torch.equal(other[0], table[[9]])
