"""The GPU benchmarks' CPU-checkable parts: the floor and ratio arithmetic on known numbers, the shapes being
DeepSeek-V3's, the JSON written as they go (a killed writer leaves valid JSON), the key figures and goals read
off known results, and the scripts' clean skip without CUDA."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench_harness import bench_module as _bench

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


gf = _bench("gpu_figures")


# ---- the shapes ----------------------------------------------------------------------------------------------
def test_shapes_are_deepseek_v3():
    v3 = gf.V3
    assert (v3["hidden"], v3["heads"], v3["intermediate"], v3["moe_intermediate"], v3["experts"]) == (
        7168, 128, 18432, 2048, 256)
    assert (v3["q_lora_rank"], v3["kv_lora_rank"], v3["rope"], v3["nope"], v3["v_head"], v3["top_k"]) == (
        1536, 512, 64, 128, 128, 8)
    assert gf.LOCAL_EXPERTS == 32 and gf.LATENT == 576
    shapes = gf.gemm_shapes()
    assert set(shapes.values()) == {(2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432),
                                    (4096, 7168), (7168, 2048)}
    assert shapes["o_proj (7168x16384)"] == (7168, 16384)
    assert shapes["dense gate_up (36864x7168)"] == (2 * 18432, 7168) and shapes["dense down (7168x18432)"] == (
        7168, 18432)
    assert gf.GEMM_ROWS == (1, 16, 64, 128, 4096)
    assert gf.MLA["heads"] == (128, 16) and gf.MLA["context"] == 4096 and gf.MLA["batches"] == (1, 16, 64)
    assert (gf.MLA["kv_lora_rank"], gf.MLA["rope"], gf.MLA["block_size"]) == (512, 64, 16)
    assert gf.GROUPED_ROWS_PER_EXPERT == (1, 2, 4, 8, 16)


def test_the_layer_benchmark_and_the_figures_share_v3s_widths():
    v3_layer = _bench("v3_layer")
    size, v3 = v3_layer.SIZES["v3"], gf.V3
    assert (size["hidden_size"], size["num_attention_heads"], size["q_lora_rank"], size["kv_lora_rank"]) == (
        v3["hidden"], v3["heads"], v3["q_lora_rank"], v3["kv_lora_rank"])
    assert (size["intermediate_size"], size["moe_intermediate_size"], size["qk_rope_head_dim"]) == (
        v3["intermediate"], v3["moe_intermediate"], v3["rope"])
    assert v3_layer.SHARD["n_routed_experts"] == gf.LOCAL_EXPERTS and v3_layer.SHARD["num_experts_per_tok"] == 8


# ---- the arithmetic ------------------------------------------------------------------------------------------
def test_bytes_floors_and_ratios_on_known_numbers():
    assert gf.fp8_weight_bytes(7168, 16384) == 7168 * 16384 + 56 * 128 * 4
    assert gf.fp8_weight_bytes(200, 130) == 200 * 130 + 2 * 2 * 4  # partial tiles count whole scales
    # weight 128x128 + its scale, input 1x128 fp8 + one scale, output 1x128 bf16
    assert gf.gemm_bytes(1, 128, 128) == 128 * 128 + 4 + 128 + 4 + 256
    assert gf.gemm_bytes(2, 64, 64, weight_bytes_per_elem=2, act_bytes_per_elem=2) == 64 * 64 * 2 + 2 * 64 * 2 + 256
    assert gf.gemm_flops(64, 7168, 16384) == 2 * 64 * 7168 * 16384
    assert gf.floor_s(3e12, 3.0) == pytest.approx(1.0)
    assert gf.floor_s(1e9, 1.0, flops=2e15, peak_tflops=1000.0) == pytest.approx(2.0)  # compute-bound
    assert gf.floor_s(1e12, 1.0, flops=1e12, peak_tflops=1000.0) == pytest.approx(1.0)  # memory-bound
    assert gf.pct(1.5, 3.0) == pytest.approx(50.0) and gf.pct(1.0, 0.0) == 0.0
    assert gf.mla_cache_bytes(64, 4096, 2) == 64 * 4096 * 576 * 2 == 301_989_888
    assert gf.expected_active_experts(0) == 0.0
    assert gf.expected_active_experts(1) == pytest.approx(8.0)  # one token reaches exactly its top 8
    assert gf.expected_active_experts(2) == pytest.approx(32 * (1 - 0.75**2))
    assert 31.99 < gf.expected_active_experts(64) <= 32.0
    expert = gf.expert_bytes()
    assert expert == (4096 * 7168 + 32 * 56 * 4) + (7168 * 2048 + 56 * 16 * 4) == 44_050_944
    assert gf.expert_bytes(fp8=False) == 3 * 2048 * 7168 * 2


def test_layer_stream_bytes_of_a_v3_decode_step():
    moe = gf.layer_stream_bytes(64, 4096)
    assert set(moe) == {"qkv_a_proj", "q_b_proj", "q_absorb", "attention_core", "v_absorb", "o_proj", "gate",
                        "experts", "shared_expert"}
    assert moe["attention_core"] == 64 * 4096 * 576 * 2
    assert moe["o_proj"] == gf.fp8_weight_bytes(7168, 16384)
    assert moe["q_absorb"] == moe["v_absorb"] == 128 * 128 * 512 * 2
    assert moe["experts"] == round(gf.expected_active_experts(64) * gf.expert_bytes())
    assert moe["shared_expert"] == gf.expert_bytes() and moe["gate"] == 32 * 7168 * 2
    assert 1.8e9 < sum(moe.values()) < 2.0e9  # ~1.4 GB of experts, 0.3 GB of KV, 0.2 GB of attention
    dense = gf.layer_stream_bytes(64, 4096, moe=False)
    assert "experts" not in dense and dense["mlp"] == gf.fp8_weight_bytes(36864, 7168) + gf.fp8_weight_bytes(
        7168, 18432)
    fp8_kv = gf.layer_stream_bytes(64, 4096, kv_bytes_per_elem=1)
    assert fp8_kv["attention_core"] * 2 == moe["attention_core"]
    bf16 = gf.layer_stream_bytes(1, 16, fp8=False)
    assert bf16["o_proj"] == 7168 * 16384 * 2 and bf16["experts"] == round(8.0 * gf.expert_bytes(fp8=False))


def test_goals_say_whether_they_are_met():
    mla = gf.goal("mla_128h_4k_pct_of_copy", 61.0, batch=64)
    assert mla["met"] is True and mla["goal"] == "≥ 60" and mla["batch"] == 64
    assert gf.goal("mla_128h_4k_pct_of_copy", 59.9)["met"] is False
    assert gf.goal("fp8_gemm_pct_of_scaled_mm", 70.0)["met"] is True
    assert gf.goal("v3_layer_vs_floor", 1.49)["met"] is True and gf.goal("v3_layer_vs_floor", 1.51)["met"] is False
    assert gf.goal("v3_layer_vs_floor", 1.5)["goal"] == "≤ 1.5"
    assert gf.goal("v3_layer_vs_floor", None)["met"] is None


# ---- the key figures, read off known results -----------------------------------------------------------------
def test_micro_key_figures_carry_the_ratios_and_goals():
    micro, fp8_gemm = _bench("gpu_micro"), _bench("fp8_gemm")
    rows = [{"shape": "o_proj (7168x16384)", "M": 4096, "path": p, "tflops": t} for p, t in
            (("triton", 450.0), ("_scaled_mm", 600.0), ("cuBLAS bf16 F.linear", 500.0))]
    fp8_gemm._compare_to_scaled_mm(rows)
    assert [r["pct_of_scaled_mm"] for r in rows] == pytest.approx([75.0, 100.0, 83.333], rel=1e-4)
    rows += [{"shape": "dense down (7168x18432)", "M": 4096, "path": "triton", "tflops": 300.0,
              "pct_of_scaled_mm": 50.0},
             {"shape": "o_proj (7168x16384)", "M": 1, "path": "triton", "tflops": 0.1, "weight_pct_of_copy": 80.0}]
    mla = [{"cache": "bf16", "heads": 128, "batch": b, "path": k, "cache_GBps": g, "pct_of_copy": g / 30.0}
           for b, k, g in ((16, "a", 1200.0), (64, "a", 1500.0), (64, "b", 2100.0))]
    mla.append({"cache": "bf16", "heads": 128, "batch": 64, "path": "c", "error": "failed"})
    result = {"copy": {"copy_TBps": 3.0, "bf16_matmul_tflops": 790.0}, "gemm": rows, "mla": {"rows": mla},
              "grouped": [{"shape": "w13 (4096x7168)", "case": "1/expert", "M": 32, "path": "triton grouped",
                           "pct_of_floor": 40.0}]}
    f = micro.key_figures(result)
    assert f["copy_TBps"] == 3.0 and f["gemm o_proj (7168x16384) M=4096 triton % of _scaled_mm"] == 75.0
    assert f["gemm o_proj (7168x16384) M=1 triton weight % of copy"] == 80.0
    assert f["mla bf16 h=128 B=64 best GB/s"] == 2100 and f["mla bf16 h=128 B=64 best % of copy"] == 70.0
    assert f["grouped w13 1/expert triton % of floor"] == 40.0
    goals = f["goals"]
    assert goals["mla_128h_4k_pct_of_copy"]["value"] == 70.0 and goals["mla_128h_4k_pct_of_copy"]["met"] is True
    assert goals["mla_128h_4k_pct_of_copy"]["kernel"] == "b" and goals["mla_128h_4k_pct_of_copy"]["batch"] == 64
    gemm = goals["fp8_gemm_pct_of_scaled_mm"]  # the worst shape decides
    assert gemm["value"] == 50.0 and gemm["met"] is False and gemm["shape"] == "dense down (7168x18432)"
    assert micro.key_figures({})["goals"]["mla_128h_4k_pct_of_copy"]["met"] is None


def test_v3_layer_floor_and_goal_on_known_numbers():
    import argparse

    v3_layer = _bench("v3_layer")
    args = argparse.Namespace(prompt_len=4096, rounds=2, steps=12, size="v3")
    floor = v3_layer.streaming_floor(args, "fp8", 64, copy_TBps=2.0)
    context = 4096 + v3_layer.WARM_STEPS + 12
    assert floor["context"] == context
    want = sum(sum(gf.layer_stream_bytes(64, context, 2, moe=m).values()) for m in (False, True))
    assert floor["forward_bytes"] == want and floor["forward_floor_ms"] == pytest.approx(want / 2e12 * 1e3)
    assert v3_layer.streaming_floor(args, "fp8-kv", 64, 2.0)["bytes"]["moe"]["attention_core"] * 2 == \
        floor["bytes"]["moe"]["attention_core"]
    row = {"batch": 64, "captured": {"forward_ms": 1.2 * floor["forward_floor_ms"], "step_ms": 2.0,
                                     "forward_ms_per_layer": 0.6},
           "eager": {"step_ms": 9.0, "forward_ms_per_layer": 4.0, "ops": {"moe": {"o_proj": 1.0, "norms?": 0.1}}}}
    gf.add_floor(row, floor)
    assert row["captured"]["forward_vs_floor"] == pytest.approx(1.2)
    o_proj_floor_ms = gf.fp8_weight_bytes(7168, 16384) / 2e12 * 1e3
    assert row["floor"]["ops_vs_floor"]["moe"]["o_proj"] == pytest.approx(1.0 / o_proj_floor_ms)
    result = {"variants": [{"variant": "fp8", "options": {"quantization": "fp8"}, "modes": {}, "rows": [row]}]}
    g = v3_layer.key_figures(result)["goals"]["v3_layer_vs_floor"]
    assert g["value"] == pytest.approx(1.2) and g["met"] is True and g["batch"] == 64
    row["captured"]["forward_ms"] = 2.0 * floor["forward_floor_ms"]
    gf.add_floor(row, floor)
    assert v3_layer.key_figures(result)["goals"]["v3_layer_vs_floor"]["met"] is False


def test_op_groups_sum_the_ops_the_issue_names():
    step_timers = _bench("step_timers")
    OP_GROUPS, group_ops = step_timers.OP_GROUPS, step_timers.group_ops

    grouped = group_ops({"qkv_a_proj": 1.0, "q_b_proj": 2.0, "attention_core": 3.0, "dispatch_send": 0.5,
                         "dispatch_recv": 0.25, "experts": 4.0, "something_new": 7.0})
    assert grouped == {"attention projections": 3.0, "MLA decode": 3.0, "dispatch": 0.75, "grouped experts": 4.0,
                       "something_new": 7.0}
    assert {"MLA decode", "o_proj", "gate", "dispatch", "grouped experts", "shared expert", "combine"} <= set(OP_GROUPS)


def test_the_mla_kernels_are_read_off_the_op():
    micro = _bench("gpu_micro")
    from epserve.kernels import ops

    kernels, notes = micro.mla_kernels()
    names = [name for name, _, _ in kernels]
    listed = [impl.target.split(".")[-1] for impl in ops.mla_decode.impls["cuda"] if impl.backend is None]
    assert "mla_decode_triton:paged_mla_decode_triton" in names and names == [n for n in listed if n in names]
    assert len(names) + len(notes) == len(listed) and all("does not import" in note for note in notes)
    assert all(callable(fn) for _, fn, _ in kernels) and not any("flashinfer" in n for n in names)


# ---- the JSON, written as it goes ----------------------------------------------------------------------------
def test_json_progress_is_atomic_and_marks_completion(tmp_path):
    path = tmp_path / "sub" / "out.json"
    result = {"rows": []}
    out = gf.JsonProgress(path, result)
    out.save()
    assert json.loads(path.read_text()) == {"rows": [], "complete": False}
    result["rows"].append({"x": 1})
    out.save()
    out.finish()
    assert json.loads(path.read_text()) == {"rows": [{"x": 1}], "complete": True}
    assert out.writes == 3 and [p.name for p in path.parent.iterdir()] == ["out.json"]  # no temporary left
    gf.JsonProgress(None, {}).save()  # no path: nothing written, no error
    gf.write_skipped(tmp_path / "s.json", "no GPU")
    assert json.loads((tmp_path / "s.json").read_text()) == {"status": "skipped", "reason": "no GPU", "complete": True}


_WRITER = """
import sys
sys.path.insert(0, sys.argv[2])
from pathlib import Path
import gpu_figures
result = {"rows": []}
out = gpu_figures.JsonProgress(Path(sys.argv[1]), result)
i = 0
while True:
    result["rows"].append({"i": i, "pad": "x" * 4096})
    out.save()
    i += 1
"""


def test_a_killed_writer_leaves_valid_json(tmp_path):
    """A writer killed (SIGKILL) at arbitrary points while it rewrites ever larger JSON: the file always parses
    and holds every row of some save, marked incomplete."""
    path = tmp_path / "out.json"
    for delay in (0.3, 0.55, 0.8):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(BENCH)])
        deadline = time.monotonic() + 30
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        data = json.loads(path.read_text())
        assert data["complete"] is False and data["rows"]
        assert [r["i"] for r in data["rows"]] == list(range(len(data["rows"])))


# ---- without CUDA ----------------------------------------------------------------------------------------------
no_cuda = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: the scripts would measure")


@no_cuda
@pytest.mark.parametrize("argv", [["gpu_micro.py"], ["fp8_gemm.py"], ["v3_layer.py"],
                                  ["v3_layer.py", "--device", "cuda", "--size", "tiny"]])
def test_the_scripts_skip_cleanly_without_cuda(tmp_path, argv):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, *argv, "--json", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=BENCH)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "CUDA" in proc.stderr
    data = json.loads(out.read_text())
    assert data["status"] == "skipped" and data["complete"] is True


@pytest.mark.slow
def test_v3_layer_tiny_times_each_op_on_the_cpu(tmp_path):
    """The tiny layer on the CPU: each op of both layers timed in an eager pass and grouped as the issue names
    them, the JSON complete at the end; no floor (no copy bandwidth measured on the CPU)."""
    out = tmp_path / "v3.json"
    proc = subprocess.run(
        [sys.executable, "v3_layer.py", "--size", "tiny", "--device", "cpu", "--modes", "eager", "--batches", "2",
         "--rounds", "1", "--steps", "2", "--tokens", "2", "--checkpoint", str(tmp_path / "ckpt"), "--json",
         str(out)],
        capture_output=True, text=True, timeout=300, cwd=BENCH, env={**os.environ, "EPSERVE_NO_PROGRESS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["status"] == "ok"
    (row,) = result["variants"][0]["rows"]
    assert row["batch"] == 2 and row["context"] == 32 and "floor" not in row
    assert row["eager"]["min_running"] == 2  # every timed step decoded the whole batch
    groups = row["eager"]["op_groups"]
    assert {"attention projections", "MLA decode", "o_proj", "dense MLP"} <= set(groups["dense"])
    assert {"attention projections", "MLA decode", "o_proj", "gate", "dispatch", "grouped experts", "shared expert",
            "combine"} <= set(groups["moe"])
    assert all(ms > 0 for rec in row["eager"]["ops"].values() for ms in rec.values())
    assert result["key_figures"]["goals"]["v3_layer_vs_floor"]["met"] is None


@pytest.mark.slow
def test_gpu_micro_smoke_runs_every_part_on_the_cpu(tmp_path):
    """``gpu_micro.py --smoke``: every part end to end at tiny shapes (here the Triton kernels under their
    interpreter), each Triton path agreeing with its reference, the JSON complete with the goals listed."""
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "gpu_micro.py", "--smoke", "--repeats", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=BENCH)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["status"] == "ok" and result["smoke"] is True
    assert set(result["seconds"]) == {"copy", "gemm", "grouped", "mla"} and result["copy"]["copy_TBps"] > 0
    triton_rows = [r for r in result["gemm"] if r["path"] == "triton"] + [
        r for r in result["grouped"] if r["path"] == "triton grouped"] + result["mla"]["rows"]
    assert triton_rows and all(r["rel_err_vs_ref"] < 2e-2 for r in triton_rows), triton_rows
    assert {r["M"] for r in result["gemm"]} == {1, 16}
    assert {r["case"] for r in result["grouped"]} >= {"1/expert", "1/expert padded to 4", "16 rows skewed"}
    assert all("floor_us" in r for r in result["grouped"] if "us" in r)
    masked = [r for r in result["grouped"] if "masked" in r["path"]]  # as the dispatcher calls it, with padding
    assert masked and all("padded" in r["case"] and r["tile_m"] == 16 for r in masked)
    mla_paths = {r["path"] for r in result["mla"]["rows"]}
    assert mla_paths == set(result["mla"]["kernels"]) and {r["heads"] for r in result["mla"]["rows"]} == {64, 4}
    assert set(result["key_figures"]["goals"]) == {"mla_128h_4k_pct_of_copy", "fp8_gemm_pct_of_scaled_mm"}
