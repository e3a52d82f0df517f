"""The NVFP4 decode benchmark's quick run (tiny128): bf16, FP8 and NVFP4 engines timed alternated in one run,
the floor from the bytes read, and the four-bit bytes of the quantized modules read from the checkpoint files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.bench_harness import bench_module

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
        assert row[f"{v}_best_round_ms"] == row[f"{v}_ms"] and row[f"{v}_steps_a_round"] >= 1
    assert row["nvfp4_vs_bf16"] == row["nvfp4_ms"] / row["bf16_ms"]
    # a step reads fewer bytes in four bits (attention and lm_head stay bf16), fewer than in FP8
    assert row["nvfp4_step_bytes"] < row["fp8_step_bytes"] < row["bf16_step_bytes"]
    sizes = result["sizes"]
    # 4 bits a weight plus one e4m3 scale per 16: 0.28125 of bf16, and the per-module fp32 scales
    assert 0.28125 < sizes["bytes_vs_bf16"] < 0.29 and sizes["quantized_modules"] > 0
    assert 0.5 < sizes["expert_share_main_model"] < 1
    assert set(result["goals"]) == {"bytes_vs_bf16", "b1_vs_bf16", "b1_vs_fp8", "b1_over_floor"}
    assert result["goals"]["bytes_vs_bf16"]["met"]


def test_vs_llamacpp_q4_0_table_and_its_own_markers(tmp_path):
    """``vs_llamacpp.py --quant q4_0``: the table names both four-bit formats and their bytes, and fills its own
    section of the document, leaving the bf16 table's alone."""
    v = bench_module("vs_llamacpp")
    table = {"epserve": {"decode_b1": 300.0, "decode_b16": 900.0},
             "llama.cpp": {"decode_b1": 250.0, "decode_b16": 600.0}}
    result = {"timings": {"table": table, "model_bytes": {"epserve": 260e6, "llama.cpp": 240e6}}, "quant": "q4_0",
              "machine": "test machine", "llama_cpp_python": "0.3.36", "date": "2026-12-06",
              "agreement": {"equal": 64, "tokens": 64, "max_logprob_diff": 8e-6}}
    text = v.markdown(result, "python benchmarks/vs_llamacpp.py --quant q4_0")
    assert text.startswith("| | epserve (NVFP4) | llama.cpp (Q4_0) | epserve / llama.cpp |")
    assert "| batch-16 decode (tok/s) | 900 | 600 | **1.50×** |" in text and "batch-4" not in text
    assert "(260 MB;" in text and "Q4_0 (240 MB" in text
    assert v.markers("bf16") == (v.BEGIN, v.END) and v.markers("q4_0")[0] == "<!-- vs_llamacpp_q4_0:begin -->"
    doc = tmp_path / "benchmarks.md"
    begin, end = v.markers("q4_0")
    doc.write_text(f"{v.BEGIN}\nbf16 table\n{v.END}\n\n{begin}\nold\n{end}\n")
    v.write_docs(text, doc, quant="q4_0")
    written = doc.read_text()
    assert "bf16 table" in written and "old" not in written and written.count("epserve (NVFP4)") == 1
