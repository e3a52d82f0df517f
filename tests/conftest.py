"""Shared fixtures: random-weight DeepSeek-V3 checkpoints, built once per test session."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from epserve.presets import make_checkpoint

CkptFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory: pytest.TempPathFactory) -> CkptFactory:
    """``make_ckpt(preset="tiny", **kw) -> Path``: ``make_checkpoint`` into a session temp dir.

    Same arguments → same directory (built once per session); treat it as read-only. Unlike
    ``make_checkpoint``, ``dtype`` defaults to ``"float32"`` so implementations can be compared
    exactly. Example: ``make_ckpt(overrides={"q_lora_rank": None})``, ``make_ckpt(fp8=True)``.
    """
    cache: dict[str, Path] = {}

    def factory(preset: str = "tiny", **kw: Any) -> Path:
        kw.setdefault("dtype", "float32")
        key = json.dumps({"preset": preset, **kw}, sort_keys=True, default=str)
        if key not in cache:
            path = tmp_path_factory.mktemp(f"ckpt-{preset}")
            cache[key] = make_checkpoint(path, preset=preset, **kw)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_ckpt(make_ckpt: CkptFactory) -> Path:
    """The ``tiny`` preset, float32, seed 0."""
    return make_ckpt("tiny")


@pytest.fixture(scope="session")
def tiny_fp8_ckpt(make_ckpt: CkptFactory) -> Path:
    """The ``tiny`` preset with FP8 block-quantized linears (other tensors float32), seed 0."""
    return make_ckpt("tiny", fp8=True)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the engine under test runs: ``$EPSERVE_TEST_DEVICE`` (e.g. ``cuda``), default ``cpu``.
    The transformers oracle always runs on the CPU."""
    import os

    return os.environ.get("EPSERVE_TEST_DEVICE", "cpu")


# The files that take longest (seconds of one serial run on 2 cores, longest first). They are collected first,
# so that xdist's workers, which take a file at a time in collection order, start on them and finish on short
# files together (in path order the longest came last: one worker ran them while the other idled).
LONGEST_FILES = (
    "tests/test_benchmarks.py",  # 150
    "tests/parallel/test_parallel.py",  # 75
    "tests/test_cli.py",  # 65
    "tests/serve/test_serve_multihost.py",  # 54
    "tests/serve/test_serve_deploy.py",  # 46
    "tests/serve/test_serve_disagg.py",  # 45
    "tests/planner/test_planner_cli.py",  # 42
    "tests/serve/test_serve_hardening.py",  # 40
    "tests/serve/test_serve_reliability.py",  # 37
    "tests/serve/test_serve_lifetime.py",  # 36
    "tests/kernels/test_fp8_kernels.py",  # 35
    "tests/parallel/test_dispatch.py",  # 35
    "tests/serve/test_serve.py",  # 29
    "tests/test_gpu_benchmarks.py",  # 25
    "tests/serve/test_deepseek_tools.py",  # 24
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FILES``, the rest in path order after them); tests marked ``cuda`` are
    skipped where no CUDA device is (CI), ``gpu_check.sh`` selects them."""
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: the rest keep order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (benchmarks/gpu_check.sh runs it)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def counter_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 checkpoint whose MTP layer drafts right about half the time (``tests/spec_toys.py``)."""
    from tests.spec_toys import counter_checkpoint

    return counter_checkpoint(tmp_path_factory.mktemp("counter"))


# Experts 4 and 5 (group 1; rank 1 at EP 4, rank 0 at EP 2; not among the start-up replicas 0..R-1) win
# nearly every token.
SKEWED_HOT_EXPERTS = {4: 1.0, 5: 1.0}


@pytest.fixture(scope="session")
def skewed_ckpt(make_ckpt: CkptFactory) -> Path:
    """``tiny`` with a large correction bias on experts 4 and 5 (a skewed expert load), clear logit margins."""
    return make_ckpt("tiny", hot_experts=SKEWED_HOT_EXPERTS, logit_margin=4.0)


# ---- tests that time the machine run alone, also on pytest-xdist's workers -----------------------------------
# Every test holds a shared lock while it runs (setup, call, teardown); a test marked ``timing`` holds it
# exclusively, so the other worker's tests wait and its timings see a quiet machine. A turnstile taken first by
# every test keeps the other worker's next tests from starving an exclusive taker.
_LOCKS: tuple[Any, Any] | None = None


def _locks() -> tuple[Any, Any] | None:
    global _LOCKS
    import os
    import tempfile

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process: nothing runs beside a test
        return None
    if _LOCKS is None:
        base = Path(tempfile.gettempdir()) / f"epserve-pytest-{run}"
        _LOCKS = (open(f"{base}.turnstile", "a+"), open(f"{base}.lock", "a+"))  # noqa: SIM115 (held all session)
    return _LOCKS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
    import fcntl

    locks = _locks()
    if locks is None:
        yield
        return
    turnstile, lock = locks
    alone = item.get_closest_marker("timing") is not None
    fcntl.flock(turnstile, fcntl.LOCK_EX)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
