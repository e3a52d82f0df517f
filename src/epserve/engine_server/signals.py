"""Signal handling of serving processes."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable


class SignalWatcher:
    """SIGTERM/SIGINT call ``on_signal`` at once, even while the main thread blocks in C++ (the step
    loop sleeping in a store wait, where a Python handler would only run after it returns): the
    signal's byte arrives on a wakeup fd that a small thread reads."""

    def __init__(self, on_signal: Callable[[], None]) -> None:
        self._read, self._write = socket.socketpair()
        self._write.setblocking(False)
        self._old_fd = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        self._old_handlers = {sig: signal.signal(sig, lambda signum, frame: None)
                              for sig in (signal.SIGTERM, signal.SIGINT)}
        self._on_signal = on_signal
        self._thread = threading.Thread(target=self._watch, name="signals", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        wanted = {int(signal.SIGTERM), int(signal.SIGINT)}
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if wanted.intersection(data):
                self._on_signal()

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._write.close()
        self._read.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)
        self._read.close()


class StopSignals:
    """First SIGINT/SIGTERM: stop gracefully; second: stop now. The handler only counts (it takes no
    lock: a handler runs between two bytecodes of the main thread, which may hold any lock, and a
    second signal may arrive inside the first's handler); the command's loop polls :attr:`stopping`."""

    def __init__(self) -> None:
        self.count = 0
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    @property
    def stopping(self) -> bool:
        return self.count > 0

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
