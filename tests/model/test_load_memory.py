"""Loading fits: the peak resident memory of loading the ``small`` preset (FP8 and NVFP4 checkpoints, fewer
layers here; the full preset in benchmarks/load_memory.py) stays within the issues' bounds over the import
baseline, and close to what is kept: the meta-device build holds nothing, each tensor is read once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_loading_small_fp8_and_nvfp4_checkpoints_peaks_near_what_it_keeps(tmp_path):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_memory.py"), "--layers", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["quantization"]: r for r in json.loads(out.read_text())}
    for quant, bound in (("fp8", 1.3), ("none", 2.6), ("nvfp4", 1.1)):
        r = rows[quant]
        assert r["peak_over_import_bytes"] <= bound * r["checkpoint_bytes"] + 200e6, r
        assert r["peak_over_import_bytes"] <= 1.15 * r["model_bytes"] + 40e6, r  # weights kept + one tensor
    assert rows["fp8"]["model_bytes"] < 0.65 * rows["none"]["model_bytes"]
    assert rows["nvfp4"]["model_bytes"] < rows["fp8"]["model_bytes"]  # four-bit MLPs and experts kept as stored
    nvfp4 = rows["nvfp4"]  # and within issue 42's bound without the fixed allowance
    assert nvfp4["peak_over_import_bytes"] <= 1.1 * nvfp4["checkpoint_bytes"], nvfp4
