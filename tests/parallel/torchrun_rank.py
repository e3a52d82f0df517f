"""One torchrun rank of ``test_parallel.py``'s two-node test: ``epserve generate`` (``epserve.cli.main`` with this
script's arguments), then, on stderr, the native threads this process still runs once the command has
returned (``threads left: [...]``, from ``/proc/self/task``): what the interpreter's finalization would meet.

gloo's threads must be gone by then: one still releasing the last collective's tensors when the interpreter
finalizes takes the GIL there and aborts the rank ("terminate called without an active exception"), which
left its node's torchrun agent waiting out its exit barrier."""

from __future__ import annotations

import sys
from pathlib import Path

from epserve.cli import main


def native_threads() -> list[str]:
    """The name of every thread of this process (Linux names them in ``comm``: gloo's ``gloo_tcp_loop``...)."""
    return sorted(p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm"))


if __name__ == "__main__":
    code = main(sys.argv[1:])
    print(f"threads left: {native_threads()}", file=sys.stderr, flush=True)
    sys.exit(code)
