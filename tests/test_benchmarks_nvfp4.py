"""The NVFP4 decode benchmark's quick run (tiny128): bf16, FP8 and NVFP4 engines timed alternated in one run,
the floor from the bytes read, and the four-bit bytes of the quantized modules read from the checkpoint files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_nvfp4_decode_quick_times_three_checkpoints_alternated(tmp_path):
    out = tmp_path / "nvfp4.json"
    proc = subprocess.run([sys.executable, "nvfp4_decode.py", "--quick", "--batches", "1", "--cache", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["steps"]
    assert row["batch"] == 1
    for v in ("bf16", "fp8", "nvfp4"):
        assert row[f"{v}_ms"] > 0 and len(row[f"rounds_{v}_ms"]) == 1 and row[f"{v}_floor_ms"] > 0
    assert row["nvfp4_vs_bf16"] == row["nvfp4_ms"] / row["bf16_ms"]
    # a step reads fewer bytes in four bits (attention and lm_head stay bf16), fewer than in FP8
    assert row["nvfp4_step_bytes"] < row["fp8_step_bytes"] < row["bf16_step_bytes"]
    sizes = result["sizes"]
    # 4 bits a weight plus one e4m3 scale per 16: 0.28125 of bf16, and the per-module fp32 scales
    assert 0.28125 < sizes["bytes_vs_bf16"] < 0.29 and sizes["quantized_modules"] > 0
    assert 0.5 < sizes["expert_share_main_model"] < 1
    assert set(result["goals"]) == {"bytes_vs_bf16", "b1_vs_bf16", "b1_vs_fp8", "b1_over_floor"}
    assert result["goals"]["bytes_vs_bf16"]["met"]
