"""The grammar worker: a serving engine's constraints compile in processes of their own, so that no input
can crash, exhaust or stall the rank. ``GrammarWorker`` is the rank's side: it starts the worker process
(``engine/grammar_process.py``) on the rank's first constraint and again after it exits, sends it each
compile with its time and memory limits, and cancels one whose request went away; a reader thread takes
its answers. A compile that crashes, exceeds its memory or its time fails only its request, as invalid,
saying so; the worker's own failure (it did not start, or exited) fails what it held as unavailable.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from epserve.engine.grammar_process import (
    CancelCompile,
    CompileJob,
    CompileStarted,
    WorkerConfig,
    WorkerReady,
    frame,
    read_frame,
)
from epserve.engine.grammars import CompileLimits

logger = logging.getLogger(__name__)


class GrammarWorker:
    """The rank's side of its grammar worker: :meth:`compile` (blocking, from the compiler's threads)
    returns a constraint's EBNF grammar, which compiled there within its limits; :meth:`cancel` stops a
    compile wherever it is. The worker starts on first use and again after it exits."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.config = WorkerConfig(str(model_path), vocab_size, tuple(eos_token_ids))
        self.tokenizer_info: Any = None  # xgrammar's, as the worker made it (set once it is ready)
        self.running: dict[int, int] = {}  # compile id: its process's pid (while it compiles)
        self._proc: subprocess.Popen | None = None
        # (order: the start lock, the write lock, then the lock of the tables; the reader takes the last only,
        # so a write blocked on a full pipe never keeps it from draining the worker's replies)
        self._start_lock, self._write_lock, self._lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._replies: dict[int, list] = {}  # compile id: [Event, (ok, payload) once done]
        self._cancelled: set[int] = set()  # cancelled before they were sent

    def compile(self, job: int, kind: str, spec: str, limits: CompileLimits) -> str:
        """The EBNF grammar of ``kind``/``spec``, which compiled within the time and memory of ``limits``
        (compile ``job``); ValueError saying why it does not compile, crashed, ran out of time or memory,
        or was cancelled; RuntimeError where the worker failed."""
        proc = self._start()
        event = threading.Event()
        with self._write_lock:  # (a cancel sent after this compile's frame, never before it)
            with self._lock:
                if job in self._cancelled:
                    self._cancelled.discard(job)
                    raise ValueError("the compile was cancelled")
                if proc.poll() is not None:  # (exited since: its reader failed what it held, or is about to)
                    raise RuntimeError("the grammar worker exited")
                self._replies[job] = [event, None]
            self._send(proc, frame(CompileJob(job, kind, limits.time_limit_s, limits.memory_limit_mib), spec.encode()))
        # (the worker enforces the time limit; this wait is a backstop against a worker that hangs)
        done = event.wait(limits.time_limit_s + 60)
        with self._lock:
            reply = self._replies.pop(job)[1]
        if not done or reply is None:
            self.cancel(job)
            raise ValueError(f"the {kind} constraint's compile did not finish")
        ok, payload = reply
        if ok is None:  # (the worker's failure, not the constraint's)
            raise RuntimeError(payload.decode())
        if ok:
            return payload.decode()
        raise ValueError(payload.decode())

    def cancel(self, job: int) -> None:
        """Stop compile ``job`` (queued or running; nothing if it is done)."""
        with self._write_lock:
            with self._lock:
                if job not in self._replies:
                    self._cancelled.add(job)
                    return
                proc = self._proc
            if proc is not None:
                self._send(proc, frame(CancelCompile(job)))

    def close(self) -> None:
        with self._start_lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    @property
    def num_in_flight(self) -> int:
        """Compiles sent to the worker and not answered yet."""
        with self._lock:
            return len(self._replies)

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _send(self, proc: subprocess.Popen, data: bytes) -> None:
        try:
            proc.stdin.write(data)  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):
            pass  # (it exited: the reader fails what waits on it)

    def _start(self) -> subprocess.Popen:
        with self._start_lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            import xgrammar as xgr

            env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
            proc = subprocess.Popen([sys.executable, "-m", "epserve.engine.grammar_process"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
            proc.stdin.write(frame(self.config))  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            ready = read_frame(proc.stdout)  # type: ignore[arg-type]
            if ready is None or not isinstance(ready[0], WorkerReady):
                proc.kill()
                proc.wait()
                raise RuntimeError("the grammar worker did not start (its log says why)")
            self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(ready[1].decode())
            self._proc = proc
            threading.Thread(target=self._read, args=(proc,), name="epserve-grammar-reader", daemon=True).start()
            logger.info("structured outputs: grammar worker %d ready", proc.pid)
            return proc

    def _read(self, proc: subprocess.Popen) -> None:
        while (got := read_frame(proc.stdout)) is not None:  # type: ignore[arg-type]
            message, payload = got
            with self._lock:
                if isinstance(message, CompileStarted):
                    self.running[message.job] = message.pid
                    continue
                self.running.pop(message.job, None)
                reply = self._replies.get(message.job)
                if reply is not None:
                    reply[1] = (message.ok, payload)
                    reply[0].set()
        proc.wait()
        logger.warning("structured outputs: the grammar worker %d exited (%s)", proc.pid, proc.returncode)
        with self._lock:
            for reply in self._replies.values():
                if reply[1] is None:
                    reply[1] = (None, b"the grammar worker exited while compiling")
                    reply[0].set()
            self.running.clear()
