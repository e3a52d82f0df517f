"""The grammar worker: a serving engine's constraints compile in processes of their own, so that no
input can crash, exhaust or stall the rank.

The worker (``python -m epserve.engine.grammar_worker``, started by the rank on its first constraint)
loads the tokenizer and xgrammar's compiler once, then forks one process per compile from itself (a
copy-on-write fork of a single-threaded process: milliseconds). That process takes the compile's
memory budget (``RLIMIT_AS``: the worker's address space plus ``memory_limit_mib``) and a CPU-time
backstop, compiles (``engine/grammars.py``) and writes back the compiled grammar serialized
(``CompiledGrammar.serialize_json``), which the rank deserializes with the worker's tokenizer info. The
worker kills a compile that runs past ``time_limit_s`` or whose request was cancelled; a compile that
crashes (a stack overflow in xgrammar's converters), exceeds its memory or its time fails only its
request, as invalid, saying so. The worker leaves when the rank closes its end of the pipe.

Frames, both ways: a JSON header line, then ``size`` bytes. To the worker: the configuration first,
then ``{"op": "compile", "id", "kind", "size"}`` + the spec, ``{"op": "cancel", "id"}``. From it:
``{"op": "ready", "size"}`` + the tokenizer info, ``{"op": "started", "id", "pid"}``, ``{"op": "done",
"id", "ok", "size"}`` + the grammar or the error message.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from epserve.engine.grammars import CompileLimits, compile_constraint, load_compiler

logger = logging.getLogger(__name__)


def _frame(header: dict, payload: bytes = b"") -> bytes:
    return json.dumps({**header, "size": len(payload)}).encode() + b"\n" + payload


def _read_frame(stream: IO[bytes]) -> tuple[dict, bytes] | None:
    line = stream.readline()
    if not line:
        return None
    header = json.loads(line)
    payload = stream.read(header["size"]) if header["size"] else b""
    return header, payload


class GrammarWorker:
    """The rank's side of its grammar worker: :meth:`compile` (blocking, from the compiler's threads)
    returns a compiled grammar's serialized bytes; :meth:`cancel` stops a compile wherever it is. The
    worker starts on first use and again after it exits."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.config = {"model_path": str(model_path), "vocab_size": vocab_size, "eos": list(eos_token_ids)}
        self.tokenizer_info: Any = None  # xgrammar's, as the worker made it (set once it is ready)
        self.running: dict[int, int] = {}  # compile id: its process's pid (while it compiles)
        self._proc: subprocess.Popen | None = None
        # (order: the start lock, the write lock, then the lock of the tables; the reader takes the last only,
        # so a write blocked on a full pipe never keeps it from draining the worker's replies)
        self._start_lock, self._write_lock, self._lock = threading.Lock(), threading.Lock(), threading.Lock()
        self._replies: dict[int, list] = {}  # compile id: [Event, (ok, payload) once done]
        self._cancelled: set[int] = set()  # cancelled before they were sent

    def compile(self, job: int, kind: str, spec: str, limits: CompileLimits) -> bytes:
        """The serialized compiled grammar of ``kind``/``spec`` (compile ``job``, within the time and
        memory of ``limits``); ValueError saying why it does not compile, crashed, ran out of time or
        memory, or was cancelled."""
        proc = self._start()
        event = threading.Event()
        with self._write_lock:  # (a cancel sent after this compile's frame, never before it)
            with self._lock:
                if job in self._cancelled:
                    self._cancelled.discard(job)
                    raise ValueError("the compile was cancelled")
                self._replies[job] = [event, None]
            self._send(proc, _frame({"op": "compile", "id": job, "kind": kind, "time_limit_s": limits.time_limit_s,
                                     "memory_limit_mib": limits.memory_limit_mib}, spec.encode()))
        # (the worker enforces the time limit; this wait is a backstop against a worker that hangs)
        done = event.wait(limits.time_limit_s + 60)
        with self._lock:
            reply = self._replies.pop(job)[1]
        if not done or reply is None:
            self.cancel(job)
            raise ValueError(f"the {kind} constraint's compile did not finish")
        ok, payload = reply
        if ok:
            return payload
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
                self._send(proc, _frame({"op": "cancel", "id": job}))

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
            proc = subprocess.Popen([sys.executable, "-m", "epserve.engine.grammar_worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, env=env)
            proc.stdin.write(_frame(self.config))  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            ready = _read_frame(proc.stdout)  # type: ignore[arg-type]
            if ready is None or ready[0].get("op") != "ready":
                proc.kill()
                proc.wait()
                raise RuntimeError("the grammar worker did not start (its log says why)")
            self.tokenizer_info = xgr.TokenizerInfo.deserialize_json(ready[1].decode())
            self._proc = proc
            threading.Thread(target=self._read, args=(proc,), name="epserve-grammar-reader", daemon=True).start()
            logger.info("structured outputs: grammar worker %d ready", proc.pid)
            return proc

    def _read(self, proc: subprocess.Popen) -> None:
        while (frame := _read_frame(proc.stdout)) is not None:  # type: ignore[arg-type]
            header, payload = frame
            with self._lock:
                if header["op"] == "started":
                    self.running[header["id"]] = header["pid"]
                    continue
                self.running.pop(header["id"], None)
                reply = self._replies.get(header["id"])
                if reply is not None:
                    reply[1] = (header["ok"], payload)
                    reply[0].set()
        proc.wait()
        logger.warning("structured outputs: the grammar worker %d exited (%s)", proc.pid, proc.returncode)
        with self._lock:
            for reply in self._replies.values():
                if reply[1] is None:
                    reply[1] = (False, b"the grammar worker exited while compiling")
                    reply[0].set()
            self.running.clear()


# ---- the worker process ---------------------------------------------------------------------------
@dataclass
class _Compile:
    """One compile's process, its output so far and its deadline."""

    job: int
    kind: str
    pid: int
    fd: int
    time_limit_s: float
    deadline: float
    chunks: list[bytes] = field(default_factory=list)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Worker:
    """The worker's loop: one thread, selecting on its input and its compiles' pipes."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.compiler, self.added, self.info = load_compiler(config["model_path"], config["vocab_size"],
                                                             tuple(config["eos"]))
        self.compiles: dict[int, _Compile] = {}
        self.selector = selectors.DefaultSelector()

    def reply(self, header: dict, payload: bytes = b"") -> None:
        _write_all(1, _frame(header, payload))

    def start(self, job: int, kind: str, spec: str, time_limit_s: float, memory_limit_mib: int) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the compile's process: nothing of the worker's loop runs here
            os.close(read)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # (the rank's pipes stay the worker's alone)
            os.dup2(null, 1)
            _compile_and_exit(self, write, kind, spec, time_limit_s, memory_limit_mib)
        os.close(write)
        self.compiles[job] = _Compile(job, kind, pid, read, time_limit_s, time.monotonic() + time_limit_s)
        self.selector.register(read, selectors.EVENT_READ, job)
        self.reply({"op": "started", "id": job, "pid": pid})

    def stop(self, job: int, why: str) -> None:
        """Kill compile ``job`` and fail it with ``why``."""
        entry = self.compiles.pop(job, None)
        if entry is None:
            return
        os.kill(entry.pid, signal.SIGKILL)
        os.waitpid(entry.pid, 0)
        self.selector.unregister(entry.fd)
        os.close(entry.fd)
        self.reply({"op": "done", "id": job, "ok": False}, why.encode())

    def finish(self, entry: _Compile) -> None:
        """Compile ``entry``'s process closed its pipe: its result, or why it has none."""
        self.compiles.pop(entry.job)
        self.selector.unregister(entry.fd)
        os.close(entry.fd)
        _, status = os.waitpid(entry.pid, 0)
        data = b"".join(entry.chunks)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and data[:1] in (b"0", b"1"):
            self.reply({"op": "done", "id": entry.job, "ok": data[:1] == b"1"}, data[1:])
            return
        how = (_signal_name(os.WTERMSIG(status)) if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        why = (f"the {entry.kind} constraint's compile crashed ({how}): it is too large or too deeply nested for "
               "the grammar compiler")
        self.reply({"op": "done", "id": entry.job, "ok": False}, why.encode())

    def run(self, inbox: int) -> None:
        self.selector.register(inbox, selectors.EVENT_READ, None)
        buffer = b""
        while True:
            deadlines = [c.deadline for c in self.compiles.values()]
            timeout = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    data = os.read(inbox, 1 << 20)
                    if not data:  # the rank is gone
                        for job in list(self.compiles):
                            self.stop(job, "the worker stopped")
                        return
                    buffer = self.take(buffer + data)
                elif (entry := self.compiles.get(key.data)) is not None:
                    chunk = os.read(entry.fd, 1 << 20)
                    if chunk:
                        entry.chunks.append(chunk)
                    else:
                        self.finish(entry)
            now = time.monotonic()
            for entry in [c for c in self.compiles.values() if c.deadline <= now]:
                self.stop(entry.job, f"the {entry.kind} constraint's compile took longer than its limit of "
                          f"{entry.time_limit_s:g} s")

    def take(self, buffer: bytes) -> bytes:
        """Act on the whole frames at the start of ``buffer``; the rest, kept for later."""
        while (end := buffer.find(b"\n")) >= 0:
            header = json.loads(buffer[:end])
            if len(buffer) < end + 1 + header["size"]:
                break
            payload, buffer = buffer[end + 1:end + 1 + header["size"]], buffer[end + 1 + header["size"]:]
            if header["op"] == "compile":
                self.start(header["id"], header["kind"], payload.decode(), float(header["time_limit_s"]),
                           int(header["memory_limit_mib"]))
            elif header["op"] == "cancel":
                self.stop(header["id"], "the compile was cancelled")
        return buffer


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _compile_and_exit(worker: _Worker, out: int, kind: str, spec: str, time_limit_s: float,
                      memory_limit_mib: int) -> None:
    """In a compile's process: bound its memory and CPU time, compile, write ``1`` + the serialized
    grammar or ``0`` + why not to ``out``, and exit."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        most = mapped + (memory_limit_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (most, most))
        cpu = int(time_limit_s) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        grammar = compile_constraint(worker.compiler, worker.added, worker.config["vocab_size"], kind, spec)
        result = b"1" + grammar.serialize_json().encode()
    except BaseException as e:  # (whatever it is, it is this request's)
        text = str(e).strip()
        if isinstance(e, MemoryError) or "bad_alloc" in text:
            result = b"0" + (f"the {kind} constraint's compile needs more than its memory limit of "
                             f"{memory_limit_mib} MiB").encode()
        elif isinstance(e, ValueError):
            result = b"0" + text.encode()
        else:
            first = text.splitlines()[0].split(": ", 1)[-1] if text else type(e).__name__
            result = b"0" + f"the {kind} constraint does not compile: {first}".encode()
    try:
        _write_all(out, result)
    finally:
        os._exit(0)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s grammar worker %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the rank's group's Ctrl-C: the rank decides)
    line = b""
    while not line.endswith(b"\n"):  # (a byte at a time: what follows the line is the loop's)
        chunk = os.read(0, 1)
        if not chunk:
            return
        line += chunk
    worker = _Worker(json.loads(line))
    info = worker.info.serialize_json().encode()
    _write_all(1, _frame({"op": "ready"}, info))
    worker.run(0)


if __name__ == "__main__":
    main()
