"""End to end, colocated: prefill chunks under the scheduler's budget interleaved with decode steps
(``epserve plan --input-len I --output-len O``), and its throughput-interactivity Pareto front."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from epserve.planner import Deployment, load_hardware, resolve_model
from epserve.planner.cli import main
from epserve.planner.errors import PlanError
from epserve.planner.ops import BatchShape
from epserve.planner.step import estimate_step
from epserve.planner.workload import plan_workload
from epserve.planner.workload_sweep import sweep_workload, throughput_at, workload_pareto

NAME, V3 = resolve_model("deepseek-v3")
H200 = load_hardware("h200")
D = Deployment(ep=8, batch=64)


def _plan(d: Deployment = D, input_len: int = 1024, output_len: int = 1024, budget: int = 8192):
    return plan_workload(V3, H200, d, input_len, output_len, budget, NAME)


def test_prefill_takes_its_share_of_gpu_time() -> None:
    p = _plan()
    d = p.decode.deployment
    assert d.kv_len == 1024 + 512  # the mean KV over a request's decode
    # a DP group prefills what its finishing requests need: R a I / O tokens per step
    assert p.prefill_tokens_per_step == pytest.approx(64 * 1024 / 1024)
    assert 0 < p.group_chunk_share < p.chunk_step_share < 1  # DP8 in lockstep: any group's chunk stalls all
    assert p.mean_step_us == pytest.approx(p.decode_step_us + p.chunk_step_share * p.chunk_time_us)
    assert p.output_tokens_per_s_per_gpu == pytest.approx(64 / (p.mean_step_us * 1e-6))
    assert p.output_tokens_per_s_per_gpu < p.decode.throughput_tokens_per_s_per_gpu
    assert 0 < p.prefill_time_share < 1
    # longer prompts cost more of the GPU's time
    longer = _plan(input_len=4096)
    assert longer.prefill_time_share > p.prefill_time_share
    assert longer.output_tokens_per_s_per_gpu < p.output_tokens_per_s_per_gpu


def test_latency_percentiles_and_ttft() -> None:
    p = _plan()
    itl = [p.itl_percentile_us(q) for q in (50, 90, 99)]
    assert itl == sorted(itl) and itl[0] == p.decode_step_us and itl[-1] == p.mixed_step_us
    assert p.ttft_us == pytest.approx(p.request_step_us / 2 + p.mixed_step_us)  # one chunk holds the prompt
    assert p.tokens_per_s_per_request_with_ttft < p.interactivity
    # a lone request waits for no one's chunks but its own (they are its TTFT)
    one = _plan(Deployment(ep=8, tp=8, batch=1 / 8))
    assert one.request_chunk_share == 0 and one.tpot_us == pytest.approx(one.decode_step_us)


def test_a_chunk_carried_by_few_groups_costs_less_than_by_all() -> None:
    d = replace(D, batch=1, kv_len=1024, mtp_draft=0)
    shape = BatchShape(1, 1024, 0, "prefill")
    every = estimate_step(V3, H200, d, "dispatch", shape).step_time_us
    one = estimate_step(V3, H200, d, "dispatch", replace(shape, moe_groups=1)).step_time_us
    assert one < every


def test_a_small_budget_is_prefill_bound_and_a_full_one_is_refused() -> None:
    p = _plan(input_len=4096, output_len=64, budget=1024)
    assert p.prefill_bound and p.group_chunk_share == 1
    assert p.output_tokens_per_step == pytest.approx(p.chunk_tokens * 64 / 4096)
    with pytest.raises(PlanError, match="leaves no room for prefill"):
        _plan(budget=64)


def test_sweep_front_is_pareto() -> None:
    rows = sweep_workload(V3, H200, Deployment(ep=8), 1024, 1024, eps=[8], tps=[1, 8], batches=[1, 4, 16, 64],
                          model_name=NAME)
    assert workload_pareto([r.plan for r in rows]) == [r.pareto for r in rows]
    front = sorted((r.plan for r in rows if r.pareto), key=lambda p: p.interactivity)
    assert len(front) >= 2
    assert all(a.output_tokens_per_s_per_gpu > b.output_tokens_per_s_per_gpu for a, b in zip(front, front[1:]))
    slow = front[0].interactivity
    assert throughput_at(rows, slow) == max(p.output_tokens_per_s_per_gpu for p in front)
    assert throughput_at(rows, front[-1].interactivity + 1) == 0.0


def test_cli_json_text_sweep_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--ep", "8", "--batch", "32", "--input-len", "2048", "--output-len", "512"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("output_tokens_per_s_per_gpu", "interactivity_tokens_per_s_per_request", "ttft_us", "itl_us",
                "prefill_time_share", "chunk_tokens", "decode_only_tokens_per_s_per_gpu", "max_num_tokens"):
        assert key in out
    assert out["max_num_tokens"] == 8192 and set(out["itl_us"]) == {"p50", "p90", "p99"}
    assert main([*argv, "--max-num-tokens", "4096"]) == 0
    text = capsys.readouterr().out
    assert "colocated" in text and "TTFT" in text and "budget 4096" in text
    png = tmp_path / "front.png"
    sweep = ["plan", "--ep", "8", "--batch", "1", "--input-len", "1024", "--output-len", "1024", "--sweep"]  # TP 1-8
    assert main([*sweep, "--json", "--plot", str(png)]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert any(r["pareto"] for r in rows) and png.stat().st_size > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--input-len", "100", "--plot", "x.png"], "needs --sweep"),
    (["--disaggregated", "--max-num-tokens", "100"], "not with --disaggregated"),
    (["--input-len", "100", "--expert-load", "x.json"], "not priced end to end"),
    (["--input-len", "1000", "--batch", "64", "--max-num-tokens", "64"], "leaves no room"),
])
def test_cli_errors_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
