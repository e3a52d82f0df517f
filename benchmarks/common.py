"""Shared by the benchmark scripts: bring an engine to a steady decode batch; run a server and the
serving benchmark client against it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from epserve import env
from epserve.engine.engine import LLMEngine
from epserve.messages.sampling import SamplingParams


def start_decode_batch(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int, tag: str,
                       params: SamplingParams | None = None) -> None:
    """Queue ``batch`` requests of ``prompt_len`` random tokens that will decode for at least ``steps``
    more steps, run their prefills, then one warm decode step: the next ``engine.step()`` is a pure
    decode step of ``batch`` sequences. ``params``: theirs (greedy, ``ignore_eos``, by default; its
    ``max_tokens`` is set to last the steps)."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.config.model.vocab_size
    base = params if params is not None else SamplingParams(temperature=0.0, ignore_eos=True)
    params = replace(base, max_tokens=steps + 2)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", torch.randint(10, vocab, (prompt_len,), generator=g).tolist(), params)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()


def _epserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "epserve.cli", "--log-level", "WARNING", *args]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float, what: str) -> None:
    """Until ``url``'s ``/health`` answers 200; SystemExit with the log's tail if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{what} did not come up:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.2)


@contextlib.contextmanager
def serving(serve_args: list[str], log: Path, timeout_s: float = 300.0, src: Path | None = None,
            environ: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """``epserve serve *serve_args --port <free>`` until it answers ``/health``; yields the process and
    its base URL; stops it (SIGTERM, drained) afterwards. ``src``: another tree's ``src/`` to run the
    server from (a before/after comparison); ``environ``: more environment for it."""
    from epserve.parallel.launch import free_port

    port = free_port()
    child_env = {**os.environ, env.NO_PROGRESS: "1", **(environ or {}), **({"PYTHONPATH": str(src)} if src else {})}
    with log.open("w") as out:
        proc = subprocess.Popen(_epserve("serve", *serve_args, "--port", str(port)), stdout=out,
                                stderr=subprocess.STDOUT, env=child_env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, timeout_s, "the server")
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def bench_serve(url: str, bench_args: list[str], out: Path) -> dict:
    """``epserve bench serve`` against ``url``; its JSON result."""
    subprocess.run(_epserve("bench", "serve", "--base-url", url, *bench_args, "--disable-tqdm", "--json", str(out)),
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def wide_vocab_checkpoint(vocab: int) -> Path:
    """The `small` preset (bf16) with a ``vocab``-entry vocabulary (0: the preset's 8192), written once to
    the cache: what a step over DeepSeek-V3's 129280-entry vocabulary costs, on a small model."""
    from epserve.presets import make_checkpoint

    path = Path(os.path.expanduser(f"~/.cache/epserve/bench-small-v{vocab or 8192}"))
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype="bfloat16", seed=0,
                        overrides={"vocab_size": vocab} if vocab else None)
    return path


def median_step_ms(engine: LLMEngine, steps: int) -> float:
    """The median of ``steps`` timed ``engine.step()`` calls (ms); then the engine's requests run out."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * statistics.median(times)


def small_checkpoint(quantization: str | None) -> Path:
    """The `small` preset's weights (bf16, seed 0) as written with ``quantization`` (None: bf16, the one
    ``wide_vocab_checkpoint(0)`` makes; ``"fp8"``: DeepSeek's block FP8, ``fp8_engine.py``'s; ``"nvfp4"``:
    ModelOpt's NVFP4), written once to the cache."""
    if quantization is None:
        return wide_vocab_checkpoint(0)
    from epserve.presets import make_checkpoint

    path = Path(os.path.expanduser(f"~/.cache/epserve/bench-small-{quantization}"))
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype="bfloat16", seed=0, quantization=quantization)
    return path
