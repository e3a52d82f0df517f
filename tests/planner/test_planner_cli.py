"""``epserve plan``: JSON, sweeps, errors, plots, hardware files and calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epserve.planner import BUILTIN, load_hardware, save_hardware
from epserve.planner.cli import main
from epserve.planner.models import DEEPSEEK_V3

PLAN_KEYS = {"ep", "tp", "dp", "batch", "kv_bytes_per_token", "max_batch_per_gpu", "memory_per_gpu_bytes",
             "moe_layer_time_us", "step_time_us", "breakdown_us", "output_tokens_per_s_per_request",
             "throughput_tokens_per_s_per_gpu", "throughput_tokens_per_s_per_node"}
PNG = b"\x89PNG\r\n\x1a\n"


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_has_the_documented_fields(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["--gpu", "h100", "--ep", "128", "--tp", "2", "--batch", "16", "--slo-speed", "20"])
    assert PLAN_KEYS <= set(out)
    assert (out["ep"], out["tp"], out["dp"], out["batch"]) == (128, 2, 64, 16)
    assert {"weights", "kv"} <= set(out["memory_per_gpu_bytes"])
    assert {"gemm", "group_gemm", "attention", "dispatch", "combine", "other"} <= set(out["breakdown_us"])
    assert out["throughput_tokens_per_s_per_node"] == pytest.approx(8 * out["throughput_tokens_per_s_per_gpu"])
    assert out["meets_slo"] is True
    assert out["prefill"]["tokens_per_s_per_gpu"] > 0


def test_sweep_json_rows_and_fixed_axes(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, ["--gpu", "h200", "--sweep", "--ep", "8", "--slo-speed", "30"])
    rows = out["rows"]
    assert {r["ep"] for r in rows} == {8}
    assert {r["tp"] for r in rows} == {1, 2, 4, 8}
    assert {r["batch"] for r in rows} >= {1, 256}
    assert all("pareto" in r and "meets_slo" in r for r in rows)
    assert any(r["pareto"] for r in rows)
    assert all(r["fits"] or not r["pareto"] for r in rows)
    assert any(not r["fits"] and r["fits_reason"] and r["step_time_us"] > 0 for r in rows)  # batch 256: priced
    best = out["best"]
    assert best["output_tokens_per_s_per_request"] >= 30
    assert best["throughput_tokens_per_s_per_node"] == max(
        r["throughput_tokens_per_s_per_node"] for r in rows if r["meets_slo"])


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpu", "h100", "--ep", "64", "--batch", "32"]) == 0
    text = capsys.readouterr().out
    assert "EP64 = DP64 x TP1" in text and "tok/s per node" in text and "experts" in text
    assert main(["plan", "--gpu", "h100", "--sweep", "--ep", "64", "--slo-speed", "25"]) == 0
    assert "best at >= 25 tok/s per request" in capsys.readouterr().out


def test_plan_beyond_memory_is_priced_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--gpu", "h200", "--ep", "8", "--batch", "200"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT: KV needs" in text and "GiB short" in text and "tok/s per node" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/dir"], "neither a built-in"),
        (["--gpu", "a100"], "unknown GPU 'a100'"),
        (["--ep", "7"], "EP 7 does not divide the 256 expert slots"),
        (["--ep", "8", "--tp", "3"], "TP 3 does not divide the 128 attention heads"),
        (["--ep", "16", "--tp", "16"], "never span nodes"),
        (["--mtp-accept", "1.5"], "mtp-accept"),
        (["--sweep", "--ep", "6"], "EP 6 does not divide"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_model_from_config_path_and_checkpoint_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    by_dir = _json(capsys, ["--model", str(tmp_path), "--ep", "32"])
    by_file = _json(capsys, ["--model", str(tmp_path / "config.json"), "--ep", "32"])
    builtin = _json(capsys, ["--ep", "32"])
    assert by_dir["step_time_us"] == by_file["step_time_us"] == builtin["step_time_us"]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["plan", "--model", str(tmp_path / "bad")]) == 2
    assert "unsupported architecture" in capsys.readouterr().err


def test_hardware_file_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_hardware(BUILTIN["h100"], tmp_path / "h100.json")
    assert load_hardware(path) == BUILTIN["h100"]
    from_file = _json(capsys, ["--gpu", str(path), "--ep", "16", "--batch", "8"])
    builtin = _json(capsys, ["--gpu", "h100", "--ep", "16", "--batch", "8"])
    assert from_file["step_time_us"] == builtin["step_time_us"]
    (tmp_path / "junk.json").write_text('{"peak_flops": {"bf16": 1}, "colour": 1}')
    assert main(["plan", "--gpu", str(tmp_path / "junk.json")]) == 2
    assert "unknown fields: colour" in capsys.readouterr().err


def test_plots_are_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "v3.png"
    assert main(["plan", "--gpu", "h100", "--sweep", "--tp", "1", "--plot", str(target)]) == 0
    for name in ("v3.png", "v3-roofline.png", "v3-prefill.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    single = tmp_path / "one.png"
    assert main(["plan", "--gpu", "h100", "--ep", "32", "--plot", str(single)]) == 0
    assert single.read_bytes()[:8] == PNG
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.timing
def test_calibrate_quick_writes_a_usable_hardware_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "local.json"
    assert main(["plan", "calibrate", "--quick", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    spec = load_hardware(out)
    kinds = {p.kind for p in spec.points}
    assert {"floor", "stream", "gemm", "group_gemm", "attention", "other", "all_to_all", "engine_step",
            "engine_stream", "gemm_fp4", "group_gemm_fp4"} <= kinds
    assert 0.25 <= spec.stream_efficiency <= 2.0
    assert all(0 < e.compute <= 1 and 0 < e.memory <= 1 for e in spec.efficiency.values())
    assert spec.kernel_latency_us > 0 and spec.nvlink_latency_us > 0
    # the engine's own kernels give the bandwidth curves; its own steps the host overhead
    for kernel_class in ("gemm", "group_gemm", "gemm_fp4", "group_gemm_fp4"):  # the four-bit kernels' too
        curve = spec.memory_by_rows[kernel_class]
        assert min(r for r, _, _ in curve) == 1 and all(0 < f <= 1 for _, _, f in curve)
        assert len({size for _, size, _ in curve}) == 2  # two weight sizes
    # the host overhead is fitted from the engine's own steps (the fit itself: test_planner_overhead.py); with the
    # recorded CPU decode a step's per-op cost is a few microseconds, which a busy host can hide entirely
    steps = [p for p in spec.points if p.kind == "engine_step"]
    assert len(steps) >= 4 and all(p.time_us > 0 for p in steps)
    assert spec.op_overhead_us >= 0 and spec.op_overhead_per_token_us >= 0 and spec.step_overhead_us >= 0
    assert load_hardware(out) == spec  # loads back as written
    small = json.dumps({**DEEPSEEK_V3, "n_routed_experts": 16, "num_hidden_layers": 4, "hidden_size": 512,
                        "moe_intermediate_size": 128, "intermediate_size": 1024, "num_attention_heads": 8,
                        "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "quantization_config": None})
    (tmp_path / "config.json").write_text(small)
    plan = _json(capsys, ["--model", str(tmp_path), "--gpu", str(out), "--ep", "2", "--batch", "4",
                          "--weight-dtype", "bf16", "--kv-len", "256"])
    assert plan["fits"] and plan["step_time_us"] > 0


@pytest.mark.slow
def test_calibrate_records_the_engines_mtp_acceptance(counter_ckpt, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``calibrate --mtp-model`` measures the draft acceptance on this engine; ``plan --gpu FILE`` then
    prices MTP with it unless ``--mtp-accept`` says otherwise."""
    out = tmp_path / "local.json"
    assert main(["plan", "calibrate", "--quick", "--no-engine", "--world-size", "0", "--mtp-model",
                 str(counter_ckpt), "--out", str(out)]) == 0
    assert "MTP acceptance" in capsys.readouterr().out
    accept = load_hardware(out).mtp_accept
    assert accept is not None and 0.3 < accept < 0.9  # the counter's MTP is right about 2 times in 3
    plan = _json(capsys, ["--model", str(counter_ckpt), "--gpu", str(out), "--ep", "1", "--batch", "1",
                          "--weight-dtype", "bf16", "--kv-len", "64"])
    assert plan["mtp_draft"] == 1 and plan["mtp_accept"] == accept
    plan = _json(capsys, ["--model", str(counter_ckpt), "--gpu", str(out), "--ep", "1", "--batch", "1",
                          "--weight-dtype", "bf16", "--kv-len", "64", "--mtp-accept", "0.5"])
    assert plan["mtp_accept"] == 0.5
