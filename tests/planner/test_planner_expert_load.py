"""``epserve plan --expert-load`` (a measured skew, with and without EPLB), ``--requests`` (a DP group's
requests, a fraction of one per GPU) and plans that do not fit in memory, priced all the same."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from epserve.eplb import gpu_loads, imbalance, rebalance_experts
from epserve.parallel.stages import moe_layer_schedule
from epserve.planner import Deployment, PlanError, load_hardware, plan_decode, resolve_model
from epserve.planner.cli import main
from epserve.planner.ops import BatchShape, price_ops
from epserve.planner.skew import load_expert_load

NAME, V3 = resolve_model("deepseek-v3")
H200 = load_hardware("h200")
NUM_MOE = len(V3.moe_layer_ids)  # 58
D = Deployment(ep=8, batch=32, mtp_draft=1)


def _zipf(layers: int = NUM_MOE, seed: int = 0) -> list[list[float]]:
    """Each layer: expert popularity ~ 1 / rank^0.8, ranks shuffled per layer (a real router's skew)."""
    rng = np.random.default_rng(seed)
    base = 1e6 / np.arange(1, V3.n_routed_experts + 1) ** 0.8
    return [rng.permutation(base).round().tolist() for _ in range(layers)]


def _write(tmp_path: Path, name: str, obj: object) -> Path:
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.fixture(scope="module")
def zipf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the shape of LLM.expert_load().summary(): extra keys are ignored
    summary = {"layers": list(V3.moe_layer_ids), "per_expert": _zipf(), "per_rank": [[0] * 8] * NUM_MOE,
               "imbalance": 1.5, "layer_imbalance": [1.5] * NUM_MOE, "tokens_per_rank": [0] * 8}
    return _write(tmp_path_factory.mktemp("load"), "zipf.json", summary)


def test_skew_slows_the_step_and_eplb_with_redundancy_wins_it_back(zipf_file: Path) -> None:
    load = load_expert_load(zipf_file, V3)
    uniform = plan_decode(V3, H200, D, NAME)
    skewed = plan_decode(V3, H200, D, NAME, load)
    assert skewed.expert_load is not None and not skewed.expert_load.eplb
    assert 1.4 < skewed.expert_load.imbalance < 2.0  # the busiest of 8 GPUs gets ~1.65x the mean's copies
    assert skewed.step.step_time_us > uniform.step.step_time_us
    assert skewed.step.moe_ops["experts"].flops > 1.4 * uniform.step.moe_ops["experts"].flops
    assert (skewed.step.moe_ops["combine_send"].transfer.wire_us
            > 1.4 * uniform.step.moe_ops["combine_send"].transfer.wire_us)
    eplb = plan_decode(V3, H200, replace(D, num_redundant_experts=8, eplb=True), NAME, load)
    assert eplb.expert_load is not None and eplb.expert_load.imbalance < 1.05
    assert eplb.step.step_time_us < skewed.step.step_time_us
    assert eplb.output_tokens_per_s_per_request > skewed.output_tokens_per_s_per_request


def test_imbalance_is_eplbs_own_busiest_gpu_over_the_mean(zipf_file: Path) -> None:
    load = load_expert_load(zipf_file, V3)
    weight = torch.tensor(_zipf(), dtype=torch.float64)
    for d in (replace(D, num_redundant_experts=8), replace(D, ep=16, num_redundant_experts=16, eplb=True)):
        slots = V3.n_routed_experts + d.num_redundant_experts
        if d.eplb:
            phy2log, _, logcnt = rebalance_experts(weight, slots, V3.n_group, d.num_nodes, d.ep)
        else:  # the engine's start-up placement: expert e in slot e, then copies of experts 0..R-1
            phy2log = torch.cat([torch.arange(256), torch.arange(d.num_redundant_experts)]).repeat(NUM_MOE, 1)
            logcnt = torch.ones(NUM_MOE, 256, dtype=torch.int64)
            logcnt[:, : d.num_redundant_experts] = 2
        expected = imbalance(gpu_loads(weight, phy2log, logcnt, d.ep))
        got = load.report(V3, d).layer_imbalance
        assert got == pytest.approx(expected.tolist(), rel=1e-12)


def test_a_uniform_load_reproduces_the_plan_without_one(tmp_path: Path) -> None:
    for name, obj in (("even.json", {"per_expert": [[7] * 256] * NUM_MOE}),
                      ("one-layer.json", {"per_expert": [[3] * 256]}),  # stretched over the 58 layers
                      ("instances.json", {"instances": [{"per_expert": [[1] * 256] * 5}] * 3}),
                      ("bare-list.json", [{"per_expert": [[2] * 256] * 2}, {"per_expert": [[5] * 256] * 2}])):
        load = load_expert_load(_write(tmp_path, name, obj), V3)
        for d in (D, replace(D, ep=32, tp=2, batch=3, overlap="microbatch")):
            with_file = plan_decode(V3, H200, d, NAME, load)
            assert with_file.step.step_time_us == pytest.approx(plan_decode(V3, H200, d, NAME).step.step_time_us,
                                                                rel=1e-12)
            assert with_file.expert_load is not None and with_file.expert_load.imbalance == pytest.approx(1.0)
    summed = load_expert_load(_write(tmp_path, "sum.json", {"instances": [{"per_expert": [[1, 2] + [0] * 254]},
                                                                          {"per_expert": [[3, 0] + [0] * 254]}]}), V3)
    assert summed.per_expert[0, :3].tolist() == [4, 2, 0]


def test_an_mtp_engines_load_prices_the_mtp_layer_with_its_own_row(tmp_path: Path) -> None:
    """An engine decoding with MTP counts its layer too (layer id num_hidden_layers, the last row): the main
    layers are priced as without that row, the MTP layer with it (it was stretched in as a main layer)."""
    main_rows = _zipf()
    mtp_row = [1e6] * 32 + [1.0] * 224  # the copies on the first GPU's 32 experts: it takes them all
    base = {"layers": list(V3.moe_layer_ids), "per_expert": main_rows}
    plain = load_expert_load(_write(tmp_path, "plain.json", base), V3)
    with_mtp = load_expert_load(_write(tmp_path, "mtp.json", {"layers": [*V3.moe_layer_ids, V3.num_hidden_layers],
                                                              "per_expert": [*main_rows, mtp_row]}), V3)
    assert (with_mtp.num_main, with_mtp.num_mtp) == (NUM_MOE, 1)
    a, b = plan_decode(V3, H200, D, NAME, plain).step, plan_decode(V3, H200, D, NAME, with_mtp).step
    assert b.moe_layer_time_us == pytest.approx(a.moe_layer_time_us, rel=1e-12)
    assert b.mtp_time_us > 1.05 * a.mtp_time_us  # its own skew (the mean of the main layers was priced)
    idle_mtp = load_expert_load(_write(tmp_path, "idle.json", {"layers": [*V3.moe_layer_ids, V3.num_hidden_layers],
                                                               "per_expert": [*main_rows, [0] * 256]}), V3)
    assert idle_mtp.num_mtp == 0 and plan_decode(V3, H200, D, NAME, idle_mtp).step.mtp_time_us == a.mtp_time_us


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not JSON"),
        ({"layers": [3]}, 'expected an object with "per_expert"'),
        ({"per_expert": [1, 2]}, "not a non-empty list of lists"),
        ({"per_expert": [[1] * 256, [1] * 255]}, "different numbers of experts"),
        ({"per_expert": [[1] * 64]}, "64 experts per layer, the model has 256 routed experts"),
        ({"per_expert": [[1] * 255 + [-1]]}, "layer 0, expert 255: -1 is not a non-negative number"),
        ({"per_expert": [[0] * 256] * 2}, "every count is zero"),
        ({"instances": [{"per_expert": [[1] * 256]}, {"per_expert": [[1] * 256] * 2}]}, "instances differ in shape"),
        ({"layers": [3, 4], "per_expert": [[1] * 256]}, '"layers" is not a sorted list of layer ids'),
        ({"layers": [61], "per_expert": [[1] * 256]}, "every layer is past the model's 61"),
        ({"instances": [{"layers": [3, 61], "per_expert": [[1] * 256] * 2}, {"per_expert": [[1] * 256] * 2}]},
         "instances differ in their MTP layer's rows"),
    ],
)
def test_bad_load_files_name_the_file_and_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      content: object, message: str) -> None:
    path = tmp_path / "load.json" if content is None else _write(tmp_path, "load.json", content)
    with pytest.raises(PlanError, match="expert load .*load.json: ") as e:
        load_expert_load(path, V3)
    assert message in str(e.value)
    assert main(["plan", "--expert-load", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("epserve plan: error: expert load") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_cli_compares_uniform_start_up_placement_and_eplb(zipf_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--gpu", "h200", "--ep", "8", "--batch", "32", "--num-redundant-experts", "8",
            "--expert-load", str(zipf_file)]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    load = out["expert_load"]
    assert load["file"] == str(zipf_file) and load["layers"] == load["model_moe_layers"] == NUM_MOE
    assert load["eplb"] is False and load["imbalance"] == load["imbalance_without_eplb"]
    assert load["imbalance_with_eplb"] < 1.05 < load["imbalance_without_eplb"]
    assert len(load["layer_imbalance_with_eplb"]) == NUM_MOE
    assert load["without_eplb"]["step_time_us"] == out["step_time_us"]
    assert load["with_eplb"]["step_time_us"] < load["without_eplb"]["step_time_us"]
    assert load["uniform"]["step_time_us"] < load["without_eplb"]["step_time_us"]
    assert main([*argv, "--eplb"]) == 0
    text = capsys.readouterr().out
    assert f"expert load {zipf_file} (58 MoE layers, 8 redundant experts)" in text
    eplb_line = next(line for line in text.splitlines() if line.startswith("  EPLB"))
    assert eplb_line.endswith("<- this plan") and "start-up placement  1.6" in text
    assert main(["plan", "--eplb"]) == 2
    assert "--eplb places experts by a measured load" in capsys.readouterr().err


def test_one_request_on_eight_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--gpu", "h200", "--ep", "8", "--tp", "8", "--json", "--overlap", "dispatch"]
    assert main([*base, "--requests", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["batch"] == 0.125 and one["requests_per_dp_group"] == 1 and one["dp"] == 1
    assert main([*base, "--batch", "1"]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert eight["requests_per_dp_group"] == 8
    assert one["step_time_us"] < eight["step_time_us"]
    assert one["throughput_tokens_per_s_per_gpu"] == pytest.approx(one["output_tokens_per_s_per_request"] / 8)
    assert one["memory_per_gpu_bytes"]["kv"] == eight["memory_per_gpu_bytes"]["kv"] / 8
    # its two tokens (MTP) go to attention on all 8 TP ranks, then one each to the first two ranks' FFN half
    ops = price_ops(V3, H200, Deployment(ep=8, tp=8, batch=1 / 8, mtp_draft=1), BatchShape(1 / 8, 2, 5000),
                    moe_layer_schedule("dispatch").ops)
    ref = price_ops(V3, H200, Deployment(ep=8, mtp_draft=1), BatchShape(1, 2, 5000), moe_layer_schedule("dispatch").ops)
    assert ops["shared_expert"].flops == ref["shared_expert"].flops / 2  # 1 token; 2 on a TP1 rank at batch 1
    assert ops["experts"].flops < ref["experts"].flops / 4  # 2 tokens in the EP group, not 16
    assert main([*base, "--requests", "3", "--tp", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["batch"] == 1.5


def test_requests_and_batch_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--requests", "2", "--batch", "1"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert main(["plan", "--requests", "0"]) == 2
    assert "--requests must be at least 1 (requests per DP group), got 0" in capsys.readouterr().err
    with pytest.raises(PlanError, match="1.5 requests per DP group, not a whole number"):
        plan_decode(V3, H200, Deployment(ep=8, tp=2, batch=0.75))


def test_a_layout_beyond_memory_is_priced_for_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    # DeepSeek-V3 in BF16 on one node of H100s: ~190 GiB of weights per GPU against 72 usable
    argv = ["plan", "--gpu", "h100", "--ep", "8", "--weight-dtype", "bf16", "--batch", "4", "--overlap", "dispatch"]
    assert main([*argv, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["fits_reason"].startswith("weights need ")
    assert "GiB short" in out["fits_reason"] and out["max_batch_per_gpu"] == 0
    assert out["step_time_us"] > 0 and out["moe_layer_time_us"] > 0 and out["throughput_tokens_per_s_per_node"] > 0
    fp8 = plan_decode(V3, load_hardware("h100"), Deployment(ep=8, batch=4, mtp_draft=1, overlap="dispatch"))
    assert out["moe_layer_time_us"] > fp8.step.moe_layer_time_us  # twice the weight bytes to read
