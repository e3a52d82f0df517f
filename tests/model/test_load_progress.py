"""Weight loading's progress: with stderr no terminal (systemd, Kubernetes) rank 0 logs lines with the
bytes loaded, the total, the rate and the time left, then the whole load's line; a terminal gets
tqdm's bar instead of those lines."""

from __future__ import annotations

import io
import logging
import sys

import pytest
import torch

from epserve.config import ModelConfig
from epserve.model.load_plan import model_bytes
from epserve.model.loader import load_model
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.context import ParallelContext

LOGGER = "epserve.model.loader"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _load(path, **kw):
    mc = ModelConfig.from_hf(path)
    ctx = ParallelContext.single(torch.device("cpu"))
    placement = ExpertPlacement.build(mc.n_routed_experts)
    return load_model(mc, str(path), torch.float32, ctx.device, LocalDispatcher(mc.n_routed_experts), placement,
                      ctx, **kw)


def _progress(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("loading ")]


def test_a_load_without_a_terminal_logs_its_progress(make_ckpt, monkeypatch, caplog):
    path = make_ckpt("tiny")
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = _load(path, progress_interval_s=0.0)  # (a line at each tenth of the bytes, however fast)
    lines = _progress(caplog)
    assert 5 <= len(lines) <= 11, [r.getMessage() for r in lines]
    done = [r.args[1] * 2**30 for r in lines]  # (path, loaded GiB, total GiB, rank, %, MB/s, seconds left)
    total = lines[0].args[2] * 2**30
    assert done == sorted(done) and total - done[-1] < total / 10  # (the last tenth: the final line)
    assert total <= model_bytes(model)  # what was read; the computed tensors come on top
    assert total >= 0.9 * model_bytes(model)
    assert all(r.args[3] == 0 and r.args[5] > 0 and r.args[6] >= 0 for r in lines)
    assert [r.args[4] for r in lines] == pytest.approx([100 * d / total for d in done])
    assert [r.args[6] for r in lines] == pytest.approx([(total - d) / (r.args[5] * 1e6) for d, r in zip(done, lines)])
    assert all(b - a >= total / 10 for a, b in zip(done, done[1:]))  # calm: a tenth at least between lines
    final = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("loaded ")]
    assert len(final) == 1 and "MB/s" in final[0]


def test_lines_wait_for_the_interval(make_ckpt, monkeypatch, caplog):
    path = make_ckpt("tiny")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger=LOGGER)
    _load(path, progress_interval_s=3600.0)
    assert _progress(caplog) == []  # a load shorter than the interval: only its last line
    assert any(r.getMessage().startswith("loaded ") for r in caplog.records if r.name == LOGGER)


def test_a_terminal_gets_the_bar_not_the_lines(make_ckpt, monkeypatch, caplog):
    path = make_ckpt("tiny")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.delenv("EPSERVE_NO_PROGRESS", raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    _load(path, progress_interval_s=0.0)
    assert _progress(caplog) == []
    assert "Loading weights" in terminal.getvalue()
