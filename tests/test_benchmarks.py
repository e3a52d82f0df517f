"""The expert-parallel benchmark script still runs (its --quick smoke mode) and its byte accounting
holds: all_to_all moves about the uniform-routing theory, padded moves more."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_ep_breakdown_quick(make_ckpt, tmp_path):
    ckpt = make_ckpt("tiny", dtype="bfloat16")
    out = tmp_path / "ep.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ep_breakdown.py"), "--quick", "--checkpoint", str(ckpt),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    by_backend = {row["dispatch_backend"]: row for row in results["bytes"]}
    for phase in ("dispatch", "combine"):
        assert 0.5 < by_backend["all_to_all"][phase]["ratio"] < 1.5
        assert by_backend["padded"][phase]["ratio"] > by_backend["all_to_all"][phase]["ratio"]
    assert {row["dp"] for row in results["breakdown"]} == {1, 2}
