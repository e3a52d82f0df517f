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


# ---- the GPU check of one lease, and its scripts, on this CPU ---------------------------------------------


def test_gpu_check_dry_run_fits_one_lease():
    """``gpu_check.sh --dry-run``: every stage printed with its budget, the test selections collected (a
    renamed test file or test breaks it), the summary merge run; its last line is the lease's size."""
    import os
    import re

    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"budget (\d+) s, (\d+) files, wheels (\d+\.\d) MiB", lines[-1])
    assert m, lines[-1]
    assert int(m[1]) <= 540 and int(m[2]) <= 8 and float(m[3]) <= 64
    for stage in ("env", "kernels", "sanitizer", "flashinfer", "capture", "tokens", "micro", "v3", "sampling"):
        assert any(line.startswith(f"  {stage} ") for line in lines), stage
    assert "test selections (collected here): kernels " in proc.stdout
    assert "summary: the merge writes a valid summary.json" in proc.stdout


def test_v3_layer_tiny_on_the_cpu(tmp_path):
    """The V3-layer benchmark at its tiny size: eager and captured (torch.compile's trace here) give the
    same greedy tokens, and each mode's step, forward and per-layer times and the KV bytes are reported."""
    import os

    out = tmp_path / "v3.json"
    proc = subprocess.run(
        [sys.executable, "v3_layer.py", "--tiny", "--device", "cpu", "--batches", "1", "--rounds", "1", "--steps", "2",
         "--tokens", "4", "--checkpoint", str(tmp_path / "ckpt"), "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks",
        env={**os.environ, "EPSERVE_COMPILE_BACKEND": "aot_eager", "EPSERVE_NO_PROGRESS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["config"]["num_hidden_layers"] == 2 and result["config"]["n_routed_experts"] == 32
    (variant,) = result["variants"]
    assert variant["variant"] == "fp8" and variant["tokens_equal"] is True
    (row,) = variant["rows"]
    assert row["batch"] == 1 and row["eager"]["step_ms"] > 0 and row["captured"]["step_ms"] > 0
    assert set(row["eager"]["layers"]) == {"dense", "moe"}
    assert all(v > 0 for rec in row["eager"]["layers"].values() for v in rec.values())
    figures = result["key_figures"]["fp8"]
    assert figures["kv_bytes_per_token"] == 2 * (512 + 64) * 2  # two layers' bf16 latent cache
    assert figures["kv_bytes"] == variant["modes"]["eager"]["num_blocks"] * 16 * figures["kv_bytes_per_token"]


def test_v3_layer_full_size_is_deepseek_v3_with_one_ep8_shard():
    """The full-size config without building it: DeepSeek-V3's widths, a dense then an MoE layer holding
    32 of the 256 experts, runnable with FP8 weights (~2.3e9 parameters)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import v3_layer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from epserve.config import ModelConfig
    from epserve.model.quantization import fp8_runtime_problems
    from epserve.presets import build_config, count_parameters

    cfg = ModelConfig.from_dict(build_config("tiny", fp8=True, overrides=v3_layer.overrides("v3")))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (64, 128, 128)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size) == (18432, 2048)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (32, 8, 8, 4)
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)] == [False, True]
    assert cfg.num_nextn_predict_layers == 0 and fp8_runtime_problems(cfg) == []
    assert 2.2e9 < count_parameters(cfg) < 2.4e9


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: gpu_micro.py would measure")
def test_gpu_micro_refuses_cleanly_without_cuda(tmp_path):
    out = tmp_path / "micro.json"
    proc = subprocess.run([sys.executable, "gpu_micro.py", "--json", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT / "benchmarks")
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads(out.read_text())["status"] == "skipped"


def test_cpu_decode_steps_compares_captured_eager_and_torch_ops(tmp_path):
    """The CPU decode benchmark's quick run: the three ways timed in one engine, the floor from the bytes read."""
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [sys.executable, "cpu_decode.py", "steps", "--tiny", "--checkpoint", str(tmp_path / "ckpt"), "--batches", "1",
         "--rounds", "1", "--steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT / "benchmarks",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["steps"]
    assert result["capture"] == ("cpu_graph" if result["fused_ops_available"] else None)
    assert row["batch"] == 1 and row["floor_ms"] > 0
    assert all(row[f"{v}_ms"] > 0 and len(row[f"rounds_{v}_ms"]) == 1 for v in ("graph", "eager", "torch"))


def _vs_llamacpp():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vs_llamacpp
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return vs_llamacpp


def test_vs_llamacpp_epserve_side_and_the_table(make_ckpt, tmp_path):
    """The llama.cpp comparison's own parts (the llama.cpp build itself runs in the benchmark, minutes on 2
    cores): llama-batched-bench's JSON lines read, epserve's side counted as they count, the table put
    between the document's markers and replaced on the next run."""
    from epserve import LLM

    v = _vs_llamacpp()
    lines = ('main: n_kv_max = 512, n_batch = 2048\n'
             '{"n_kv_max": 512, "pp": 64, "tg": 8, "pl": 1, "t_pp": 0.148783, "speed_pp": 430.156677, '
             '"t_tg": 0.096352, "speed_tg": 83.028893}\n'
             '{"n_kv_max": 512, "pp": 64, "tg": 8, "pl": 16, "t_pp": 0.6, "speed_pp": 1706.6, "t_tg": 0.2, '
             '"speed_tg": 640.0}\n')
    rows = v.parse_batched_bench(lines)
    assert set(rows) == {1, 16} and rows[16]["speed_tg"] == 640.0 and rows[1]["speed_pp"] == 430.156677

    llm = LLM(make_ckpt("tiny", dtype="bfloat16"), dtype="bfloat16", num_blocks=64, enable_prefix_caching=False)
    measured = v.epserve_batched(llm, [1, 4, 16], prompt_len=8, steps=3, seed=0)
    assert set(measured) == {1, 4, 16} and all(m["prefill"] > 0 and m["decode"] > 0 for m in measured.values())
    assert not llm.engine.has_unfinished_requests()
    tokens, logprobs = v.epserve_greedy(llm, [5, 6, 7], 4)
    assert len(tokens) == len(logprobs) == 4 and all(lp <= 0 for lp in logprobs)

    table = {"epserve": {"decode_b1": 200.0, "decode_b4": 400.0, "decode_b16": 700.0, "prefill_b16": 2000.0,
                         "served_out_tok_s": 220.0},
             "llama.cpp": {"decode_b1": 250.0, "decode_b4": 400.0, "decode_b16": 560.0, "prefill_b16": 1600.0,
                           "served_out_tok_s": 160.0}}
    result = {"timings": {"table": table}, "machine": "test machine", "llama_cpp_python": "0.3.36",
              "date": "2026-12-04", "agreement": {"equal": 64, "tokens": 64, "max_logprob_diff": 8e-6}}
    text = v.markdown(result, "python benchmarks/vs_llamacpp.py")
    assert "| batch-1 decode (tok/s) | 200 | 250 | **0.80×** |" in text
    assert "| batch-16 decode (tok/s) | 700 | 560 | **1.25×** |" in text and "64/64 greedy tokens equal" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{v.BEGIN}\nold table\n{v.END}\n\nafter\n")
    v.write_docs(text, doc)
    v.write_docs(text, doc)
    written = doc.read_text()
    assert written.count(v.BEGIN) == 1 and "old table" not in written and written.count("batch-1 decode") == 1
    assert written.startswith("# B\n\nbefore\n\n") and written.endswith(f"{v.END}\n\nafter\n")
