"""The grammar worker's process (``python -m epserve.engine.grammar_process``, started by a serving
rank's ``GrammarWorker``, ``engine/grammar_worker.py``): it loads the tokenizer and xgrammar's compiler
once, then forks one process per compile from itself (a copy-on-write fork of a single-threaded process:
milliseconds). That process takes the compile's memory budget (``RLIMIT_AS``: the worker's address space
plus the job's ``memory_limit_mib``) and a CPU-time backstop, converts the constraint to its EBNF grammar
and compiles that (``engine/grammars.py``), and writes back ``1`` and the EBNF grammar, or ``0`` and why
not. The rank compiles the EBNF grammar again with the same tokenizer info, within what this compile took
(a compiled grammar serialized is far larger: 36 MB for a forced call among 128 tools whose EBNF is 33 KB,
seconds to serialize and read back). The worker's one thread selects on the rank's pipe and its compiles'
pipes: it kills a compile that runs past its ``time_limit_s`` or is cancelled, and reports a compile that
crashed (a stack overflow in xgrammar's converters) by its signal. It leaves when the rank closes its end of the pipe.

The messages both ways are the frozen dataclasses below, each a JSON line (its type, fields and the size
of the payload after it) and then its payload.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import selectors
import signal
import time
from dataclasses import dataclass, field
from typing import IO, Any

from epserve.engine.grammars import compile_grammar, constraint_grammar, load_compiler


@dataclass(frozen=True)
class WorkerConfig:
    """The rank's first message: the tokenizer to load, for this vocabulary."""

    model_path: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class WorkerReady:
    """The worker loaded its compiler (payload: xgrammar's tokenizer info, serialized)."""

    pid: int


@dataclass(frozen=True)
class CompileJob:
    """Compile ``job`` (payload: its spec) within these limits."""

    job: int
    kind: str
    time_limit_s: float
    memory_limit_mib: int


@dataclass(frozen=True)
class CancelCompile:
    """Stop ``job`` (queued or compiling; nothing once it is done)."""

    job: int


@dataclass(frozen=True)
class CompileStarted:
    """``job`` compiles in process ``pid``."""

    job: int
    pid: int


@dataclass(frozen=True)
class CompileDone:
    """``job`` is over (payload: its EBNF grammar, which compiled within the limits, where ``ok``; else why
    not)."""

    job: int
    ok: bool


_MESSAGES = {cls.__name__: cls for cls in (WorkerConfig, WorkerReady, CompileJob, CancelCompile, CompileStarted,
                                           CompileDone)}


def frame(message: Any, payload: bytes = b"") -> bytes:
    """``message`` and ``payload`` as they travel: the header line, then the payload."""
    header = {"type": type(message).__name__, **dataclasses.asdict(message), "size": len(payload)}
    return json.dumps(header).encode() + b"\n" + payload


def read_header(line: bytes) -> tuple[Any, int]:
    """The message of a frame's header line, and how many payload bytes follow it."""
    fields = json.loads(line)
    cls, size = _MESSAGES[fields.pop("type")], fields.pop("size")
    return cls(**fields), size


def read_frame(stream: IO[bytes]) -> tuple[Any, bytes] | None:
    line = stream.readline()
    if not line:
        return None
    message, size = read_header(line)
    return message, stream.read(size) if size else b""


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

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.compiler, self.added, self.info = load_compiler(config.model_path, config.vocab_size,
                                                             tuple(config.eos_token_ids))
        self.compiles: dict[int, _Compile] = {}
        self.selector = selectors.DefaultSelector()

    def reply(self, message: Any, payload: bytes = b"") -> None:
        _write_all(1, frame(message, payload))

    def start(self, order: CompileJob, spec: str) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the compile's process: nothing of the worker's loop runs here
            os.close(read)
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, 0)  # (the rank's pipes stay the worker's alone)
            os.dup2(null, 1)
            _compile_and_exit(self, write, order, spec)
        os.close(write)
        deadline = time.monotonic() + order.time_limit_s
        self.compiles[order.job] = _Compile(order.job, order.kind, pid, read, order.time_limit_s, deadline)
        self.selector.register(read, selectors.EVENT_READ, order.job)
        self.reply(CompileStarted(order.job, pid))

    def stop(self, job: int, why: str) -> None:
        """Kill compile ``job`` and fail it with ``why``."""
        entry = self.compiles.pop(job, None)
        if entry is None:
            return
        os.kill(entry.pid, signal.SIGKILL)
        os.waitpid(entry.pid, 0)
        self.selector.unregister(entry.fd)
        os.close(entry.fd)
        self.reply(CompileDone(job, False), why.encode())

    def finish(self, entry: _Compile) -> None:
        """Compile ``entry``'s process closed its pipe: its result, or why it has none."""
        self.compiles.pop(entry.job)
        self.selector.unregister(entry.fd)
        os.close(entry.fd)
        _, status = os.waitpid(entry.pid, 0)
        data = b"".join(entry.chunks)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and data[:1] in (b"0", b"1"):
            self.reply(CompileDone(entry.job, data[:1] == b"1"), data[1:])
            return
        how = (_signal_name(os.WTERMSIG(status)) if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        why = (f"the {entry.kind} constraint's compile crashed ({how}): it is too large or too deeply nested for "
               "the grammar compiler")
        self.reply(CompileDone(entry.job, False), why.encode())

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
            message, size = read_header(buffer[:end])
            if len(buffer) < end + 1 + size:
                break
            payload, buffer = buffer[end + 1:end + 1 + size], buffer[end + 1 + size:]
            if isinstance(message, CompileJob):
                self.start(message, payload.decode())
            elif isinstance(message, CancelCompile):
                self.stop(message.job, "the compile was cancelled")
        return buffer


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _compile_and_exit(worker: _Worker, out: int, order: CompileJob, spec: str) -> None:
    """In a compile's process: bound its memory and CPU time, convert and compile, write ``1`` + the EBNF
    grammar or ``0`` + why not to ``out``, and exit."""
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        most = mapped + (order.memory_limit_mib << 20)
        resource.setrlimit(resource.RLIMIT_AS, (most, most))
        cpu = int(order.time_limit_s) + 5
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        kind = "json_schema" if order.kind == "json_object" else order.kind
        ebnf = constraint_grammar(worker.added, worker.config.vocab_size, order.kind, spec)
        compile_grammar(worker.compiler, kind, ebnf)  # (within the limits: the rank's compile of it is too)
        result = b"1" + ebnf.encode()
    except BaseException as e:  # (whatever it is, it is this request's)
        text = str(e).strip()
        if isinstance(e, MemoryError) or "bad_alloc" in text:
            result = b"0" + (f"the {order.kind} constraint's compile needs more than its memory limit of "
                             f"{order.memory_limit_mib} MiB").encode()
        elif isinstance(e, ValueError):
            result = b"0" + text.encode()
        else:
            first = text.splitlines()[0].split(": ", 1)[-1] if text else type(e).__name__
            result = b"0" + f"the {order.kind} constraint does not compile: {first}".encode()
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
    config, _ = read_header(line)
    worker = _Worker(config)
    _write_all(1, frame(WorkerReady(os.getpid()), worker.info.serialize_json().encode()))
    worker.run(0)


if __name__ == "__main__":
    main()
