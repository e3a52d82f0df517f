"""``engine.memory.keep_freed_host_memory``: once an engine is up, the host memory a step frees is there
for the next step, not mapped and zeroed again by the kernel (glibc's own accounting, ``mallinfo2``, in
a fresh process so no earlier test has moved its thresholds)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import ctypes, json, sys
import torch
from epserve.engine.memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
applied = keep_freed_host_memory() if sys.argv[1] == "kept" else None
before = mallinfo2()
a = torch.empty(4 << 20, dtype=torch.float32).fill_(1.0)  # a step's 16 MB activation
during = mallinfo2()
del a
after = mallinfo2()
print(json.dumps({"applied": applied, "mapped": during.hblkhd - before.hblkhd,
                  "kept_free": after.fordblks - before.fordblks}))
"""


def _probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_step_reuses_the_memory_the_last_one_freed():
    mb = 1 << 20
    kept = _probe("kept")
    assert kept["applied"] is True
    assert kept["mapped"] < mb and kept["kept_free"] >= 15 * mb, kept  # from the heap, and kept there
    default = _probe("default")  # glibc left alone: its own mapping, unmapped again when freed
    assert default["mapped"] >= 16 * mb and default["kept_free"] < mb, default


def test_an_engine_on_the_cpu_keeps_freed_memory(monkeypatch, make_ckpt):
    from epserve.engine import engine as engine_module
    from epserve.engine.llm import LLM

    calls = []
    monkeypatch.setattr(engine_module, "keep_freed_host_memory", lambda: calls.append(True) or True)
    LLM(make_ckpt("tiny", dtype="bfloat16"), dtype="bfloat16", num_blocks=16)
    assert calls == [True]
