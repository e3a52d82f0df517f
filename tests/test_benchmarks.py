"""The expert-parallel benchmark script still runs (its --quick smoke mode) and its byte accounting
holds: all_to_all moves about the uniform-routing theory, padded moves more."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_harness import bench_module

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
    """``gpu_check.sh --dry-run``: every stage printed with its budget, each benchmark script's flags and the
    token reference checked, every test selection collected as its stage runs it (at least one test each: a
    renamed file or test, or a lost ``cuda`` mark, breaks it), the summary merge run; its last line is the
    lease's size."""
    import os
    import re

    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    m = re.fullmatch(r"budget (\d+) s, (\d+) files, wheels (\d+\.\d) MiB", lines[-1])
    assert m, lines[-1]
    assert int(m[1]) <= 540 and int(m[2]) <= 8 and float(m[3]) <= 64
    plan = [line.split()[0] for line in lines if re.match(r"  \w+ +\d+s  ", line)]
    assert plan[:3] == ["env", "mtp", "tokens"] and plan[-1] == "flashinfer", plan  # by value; FlashInfer last
    assert {"kernels", "dispatch", "capture", "micro", "v3", "sampling", "sanitizer"} <= set(plan)
    counts = dict(part.rsplit(" ", 1) for part in
                  proc.stdout.split("test selections (collected here): ")[1].splitlines()[0].split(", "))
    assert set(counts) == {"mtp", "kernels", "sanitizer", "dispatch", "capture", "sampling", "flashinfer"}
    assert all(int(n) >= 1 for n in counts.values()) and counts["mtp"] == "1"
    assert "summary: the merge writes a valid summary.json" in proc.stdout
    assert "token reference: benchmarks/gpu_reference/tokens.json" in proc.stdout


def test_the_summary_keeps_a_cut_off_stages_partial_results(tmp_path):
    """A pytest killed mid-test (the plugin's report: what finished, the test it was in) and a benchmark JSON
    cut mid-write (its values up to the cut) both reach summary.json; the full output travels in logs.tar.gz;
    the files under $OUT are the lease's (at most 8)."""
    import json
    import os
    import tarfile

    gpu_report = bench_module("gpu_report")
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (tmp_path / "toys").mkdir()
    (tmp_path / "toys" / "test_toys.py").write_text(
        "import time\n\nimport pytest\n\n\ndef test_passes():\n    pass\n\n\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n\n\n@pytest.mark.skip(reason='not here')\n"
        "def test_skipped():\n    pass\n\n\ndef test_hangs():\n    time.sleep(600)\n\n\ndef test_never_runs():\n"
        "    pass\n")
    proc = subprocess.run(
        ["timeout", "8", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_report",
         "--gpu-report", str(work / "kernels.jsonl"), str(tmp_path / "toys"), "--rootdir", str(tmp_path / "toys")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert proc.returncode == 124, proc.stdout[-2000:] + proc.stderr[-2000:]  # killed by timeout, no junit
    (work / "kernels.out").write_text(proc.stdout + "\nthe whole output\n")
    full = {"device": "NVIDIA H100", "rows": [{"m": 1, "tflops": 1.5}, {"m": 16, "tflops": 20.0}],
            "key_figures": {"copy_TBps": 3.0}, "complete": False}
    text = json.dumps(full, indent=1)
    (work / "micro.json").write_text(text[:text.index('"key_figures"') - 10])  # cut inside rows[1]
    (work / "micro.out").write_text("copy 3.0 TB/s\n")
    (work / "stages.tsv").write_text(
        f"kernels\ttimeout after 8s\t8.0\t80\t8\t124\tkernels.out\t{work / 'kernels.jsonl'}\t-\t\n"
        f"micro\ttimeout after 75s\t75.0\t75\t75\t124\tmicro.out\t-\t{work / 'micro.json'}\t\n")
    summary = gpu_report.summarize(work, out, 540)

    tests = summary["stages"]["kernels"]["tests"]
    assert (tests["passed"], tests["failed"], tests["skipped"], tests["collected"]) == (1, 1, 1, 5)
    assert tests["finished"] is False and tests["cut_off_in"].endswith("test_toys.py::test_hangs")
    assert tests["failed_tests"][0]["message"] == "AssertionError: one is not two"
    micro = summary["stages"]["micro"]
    assert micro["partial"] is True and micro["result"]["device"] == "NVIDIA H100"
    assert micro["result"]["rows"][0] == {"m": 1, "tflops": 1.5}
    assert summary["not_ok"] == ["kernels", "micro"]
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_report.LEASE_FILES) and len(gpu_report.LEASE_FILES) <= 8
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "the whole output" in tar.extractfile("logs/kernels.out").read().decode()
        assert {"logs/kernels.jsonl", "logs/micro.json", "logs/stages.tsv"} <= set(tar.getnames())
    assert "cut off in" in gpu_report.table(out)
    # the snapshot taken while a stage runs merges what it has written so far
    (work / "v3.json").write_text('{"rows": [{"batch": 1, "step_ms": 2.5}, {"batch": 16, "st')
    running = gpu_report.summarize(work, out, 540, running="v3")["stages"]["v3"]
    assert running["status"].startswith("running") and running["partial"] is True
    assert running["result"]["rows"] == [{"batch": 1, "step_ms": 2.5}, {"batch": 16}]  # every value before the cut


def test_salvage_json_recovers_the_prefix_of_a_cut_file():
    gpu_report = bench_module("gpu_report")
    assert gpu_report.salvage_json('{"a": [1, 2, {"b": "x, ]y"}], "c": 3}') == (
        {"a": [1, 2, {"b": "x, ]y"}], "c": 3}, True)
    assert gpu_report.salvage_json('{"a": [1, 2, {"b": "x, ]y"}], "c": [4, 5') == (
        {"a": [1, 2, {"b": "x, ]y"}], "c": [4]}, False)
    assert gpu_report.salvage_json('{"a": "unterminated') == ({}, False)
    with pytest.raises(ValueError):
        gpu_report.salvage_json("not json")


@pytest.mark.slow
def test_gpu_check_stages_run_and_report_off_the_gpu(tmp_path):
    """The lease plan's own machinery on this CPU (``--stages env,tokens``): the env probe runs, the tokens
    stage fails cleanly (no CUDA), summary.json, logs.tar.gz and tails.txt are written and the table printed."""
    import json
    import os

    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--stages", "tokens,env"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, "OUT": str(out)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["stages"] == ["env", "tokens"]  # in the plan's order, whatever order was asked
    assert summary["stages"]["env"]["status"] == "ok" and summary["env"]["cuda_available"] is False
    assert summary["stages"]["tokens"]["status"] == "failed (exit 2)" and summary["not_ok"] == ["tokens"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "tails.txt"]
    assert "needs a CUDA GPU" in (out / "tails.txt").read_text()
    assert proc.stdout.strip().splitlines()[-1].startswith("  tokens ")


def test_the_shipped_token_reference_is_current(tmp_path):
    """The GPU check's reference tokens, regenerated here: the same checkpoints (hashes) and greedy tokens, the
    captured and the eager CPU decode alike (``--check`` on the CPU), the top-2 gaps all clear of rounding."""
    import json

    gpu_tokens = bench_module("gpu_tokens")
    out = tmp_path / "tokens.json"
    assert gpu_tokens.check(gpu_tokens.REFERENCE, tmp_path / "ckpts", "cpu", out) == 0
    result = json.loads(out.read_text())
    assert result["status"] == "equal"
    for variant in ("bf16", "fp8"):
        rec = result["variants"][variant]
        assert rec["checkpoint_equal"] and min(rec["reference_min_top2_gap"]) > 2.0
        for mode in ("captured", "eager"):
            assert (rec["modes"][mode]["equal"], rec["modes"][mode]["of"]) == (5, 5)
            assert rec["modes"][mode]["max_gap_diff"] < 0.25
    ref = json.loads(gpu_tokens.REFERENCE.read_text())
    assert all(len(t) == gpu_tokens.TOKENS for v in ref["variants"].values() for t in v["tokens"])


def test_token_comparison_names_the_first_difference():
    gpu_tokens = bench_module("gpu_tokens")
    want = {"tokens": [[1, 2, 3, 4], [5, 6]], "top2_gaps": [[3.0, 3.0, 3.0, 3.0], [4.0, 4.0]]}
    got = {"tokens": [[1, 2, 9, 4], [5, 6]], "top2_gaps": [[3.5, 2.0, 0.1, 3.0], [4.0, 4.25]]}
    assert gpu_tokens.compare(want, got) == [
        {"equal": False, "max_gap_diff": 1.0, "first_diff": 2, "want": 3, "got": 9},
        {"equal": True, "max_gap_diff": 0.25},
    ]


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
    v3_layer = bench_module("v3_layer")
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
    """The CPU decode benchmark's quick run: the ways timed in one engine, the floor from the bytes read at the
    bandwidth read in the same round."""
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
    assert row["batch"] == 1 and row["floor_ms"] > 0 and row["rounds_floor_ms"] == [row["floor_ms"]]
    assert row["graph_over_floor"] == row["graph_ms"] / row["floor_ms"]  # (one round: its own ratio)
    assert all(row[f"{v}_ms"] > 0 and len(row[f"rounds_{v}_ms"]) == 1 for v in ("graph", "eager", "torch"))


def test_decode_inputs_stage_the_same_host_bytes_at_any_max_model_len(tmp_path):
    """``decode_inputs.py``: a captured step's host bytes do not grow with ``max_model_len``."""
    out = tmp_path / "inputs.json"
    subprocess.run([sys.executable, "benchmarks/decode_inputs.py", "--buckets", "4", "--lengths", "256", "8192",
                    "--context", "64", "--repeats", "3", "--json", str(out)], cwd=ROOT, check=True, timeout=120,
                   capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    rows = json.loads(out.read_text())["rows"]
    assert [r["how"] for r in rows] == ["DecodeGraphs.stage"] * 2
    assert rows[0]["host_bytes"] == rows[1]["host_bytes"] == 5 * 4 * 8
