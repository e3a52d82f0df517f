"""``epserve plan --disaggregated``: prefill and decode instances, the KV transfer, the instance ratio."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from epserve.planner import Deployment, load_hardware, plan_decode, plan_prefill, resolve_model
from epserve.planner.cli import main
from epserve.planner.disagg import (
    PAIR_SLACK,
    decode_kv_len,
    default_prefill_ep,
    instance_pair,
    plan_disaggregated,
)
from epserve.planner.report import format_plan
from epserve.planner.sweep import microbatch_crossover

NAME, V3 = resolve_model("deepseek-v3")
H200 = load_hardware("h200")
DECODE = Deployment(ep=32, batch=32, mtp_draft=1)
PREFILL = replace(DECODE, ep=8)
# The single plan's JSON keys before --disaggregated existed: it must not gain or lose any.
PLAN_JSON_KEYS = {
    "accepted_tokens_per_step", "batch", "breakdown_us", "dispatch", "dp", "ep", "eplb", "expert_load",
    "exposed_comm_us", "fits", "fits_reason", "gpu", "gpus_per_node", "kv_bytes_per_token", "kv_dtype", "kv_len",
    "max_batch_per_gpu", "max_requests_per_dp_group", "memory_per_gpu_bytes", "microbatch_crossover_batch", "model",
    "moe_layer_time_us", "mtp_accept", "mtp_draft", "num_nodes", "num_redundant_experts",
    "output_tokens_per_s_per_request", "overlap", "prefill", "requests_per_dp_group", "step_time_us",
    "throughput_tokens_per_s_per_gpu", "throughput_tokens_per_s_per_node", "tp", "weight_dtype",
}


def _plan(input_len: int = 4096, output_len: int = 1000, prefill: Deployment = PREFILL, decode: Deployment = DECODE):
    decode = replace(decode, kv_len=decode_kv_len(input_len, output_len))
    return plan_disaggregated(V3, H200, prefill, decode, input_len, output_len, NAME)


def _run(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> dict:
    assert main(["plan", "--disaggregated", *argv, "--json"]) == rc
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("mtp", "kv_dtype", "layers", "dtype_bytes"), [(1, "bf16", 62, 2), (0, "bf16", 61, 2),
                                                                        (1, "fp8", 62, 1)])
def test_kv_bytes_per_request_is_the_latent_cache(mtp: int, kv_dtype: str, layers: int, dtype_bytes: int) -> None:
    d = replace(DECODE, mtp_draft=mtp, kv_dtype=kv_dtype)
    t = _plan(3000, prefill=replace(d, ep=8), decode=d).transfer
    assert t.bytes_per_request == layers * (512 + 64) * dtype_bytes * 3000  # V3: kv_lora_rank 512, rope 64
    assert t.time_us == pytest.approx(H200.ib_latency_us + t.bytes_per_request / (50e9 * H200.ib_efficiency) * 1e6)


def test_ttft_is_prefill_plus_transfer_and_decode_tp_copies_the_cache() -> None:
    plan = _plan()
    assert plan.ttft_us == pytest.approx(plan.prefill.prompt_time_us + plan.transfer.time_us)
    assert plan.prefill.prompt_time_us > plan.prefill.plan.step.step_time_us  # the MTP layer's forward is priced
    wide = _plan(decode=replace(DECODE, tp=4, batch=8))  # every decode TP rank holds the whole latent cache
    assert wide.transfer.copies == 4
    wire = plan.transfer.time_us - plan.transfer.latency_us
    assert wide.transfer.time_us - wide.transfer.latency_us == pytest.approx(4 * wire)


def test_ratio_grows_with_the_input_and_as_the_output_shrinks() -> None:
    base = _plan(4096, 1000)
    assert _plan(8192, 1000).prefill_per_decode > base.prefill_per_decode > _plan(2048, 1000).prefill_per_decode
    assert _plan(4096, 250).prefill_per_decode > base.prefill_per_decode > _plan(4096, 4000).prefill_per_decode
    r_p = base.prefill.tokens_per_s_per_gpu * 8 / 4096
    r_d = base.decode.throughput_tokens_per_s_per_gpu * 32 / 1000
    assert base.prefill_per_decode == pytest.approx(r_d / r_p)


@pytest.mark.parametrize(("ratio", "pair"), [(0.5, (1, 2)), (2.0, (2, 1)), (0.25, (1, 4)), (1.0, (1, 1))])
def test_instance_pair_is_exact_when_the_ratio_is(ratio: float, pair: tuple[int, int]) -> None:
    assert instance_pair(ratio, 8, 8) == pair


@pytest.mark.parametrize("ratio", [0.07, 0.419, 1.657, 3.3])
def test_instance_pair_feeds_every_decode_instance_within_the_slack(ratio: float) -> None:
    p, d = instance_pair(ratio, 8, 32)
    assert p >= d * ratio - 1e-9  # enough prefill instances: decode bounds the deployment
    assert p * 8 + d * 32 <= (1 + PAIR_SLACK) * d * (ratio * 8 + 32)
    assert all(math.ceil(k * ratio) * 8 + k * 32 > (1 + PAIR_SLACK) * k * (ratio * 8 + 32) for k in range(1, d))


def test_colocated_on_the_same_layout_never_beats_the_exact_ratio() -> None:
    """Same layout for both: colocated = a / (1 + ratio) per instance, as disaggregated at the exact ratio;
    disaggregation only loses the rounding of P."""
    same = _plan(prefill=replace(DECODE, ep=8), decode=replace(DECODE, ep=8))
    p, d = same.pair
    assert same.colocated_busy_fraction == pytest.approx(same.prefill_per_decode / (1 + same.prefill_per_decode))
    assert same.disaggregation_gain == pytest.approx((same.prefill_per_decode + 1) / (p / d + 1))
    assert same.disaggregation_gain <= 1
    assert _plan().disaggregation_gain > 1  # V3 on H200: wide decode EP32, prefill on one node


def test_default_prefill_ep_is_the_smallest_that_fits() -> None:
    assert default_prefill_ep(V3, H200, DECODE, 4096) == 8
    h100 = load_hardware("h100")
    assert default_prefill_ep(V3, h100, DECODE, 4096) == 16
    assert not _plan(prefill=replace(PREFILL, ep=4)).prefill.fits


def test_json_has_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, ["--decode-ep", "32", "--prompt-len", "2048", "--output-len", "500", "--slo-speed", "20"])
    assert {"prefill", "decode", "kv_transfer", "ttft_us", "ratio", "colocated", "disaggregation_gain", "fits",
            "fits_reason", "input_len", "output_len", "meets_slo"} <= set(out)
    assert (out["input_len"], out["output_len"], out["prefill"]["ep"], out["decode"]["ep"]) == (2048, 500, 8, 32)
    assert out["decode"]["kv_len"] == 2048 + 250 and out["decode"]["kv_len_source"] == "input+output/2"
    assert {"prompt_time_us", "tokens_per_s_per_gpu", "tokens_per_s_per_instance", "requests_per_s_per_instance",
            "fits", "fits_reason", "memory_per_gpu_bytes"} <= set(out["prefill"])
    assert {"tokens_per_s_per_instance", "requests_per_s_per_instance", "output_tokens_per_s_per_request",
            "throughput_tokens_per_s_per_gpu"} <= set(out["decode"])
    assert {"bytes_per_request", "time_us", "bandwidth_bytes_per_s", "nic_share_prefill"} <= set(out["kv_transfer"])
    ratio = out["ratio"]
    assert {"prefill_per_decode", "prefill_instances", "decode_instances", "gpus",
            "output_tokens_per_s_per_gpu"} <= set(ratio)
    assert ratio["gpus"] == 8 * ratio["prefill_instances"] + 32 * ratio["decode_instances"]
    assert ratio["output_tokens_per_s_per_gpu"] == pytest.approx(
        ratio["decode_instances"] * out["decode"]["tokens_per_s_per_instance"] / ratio["gpus"])
    assert out["ttft_us"] == pytest.approx(out["prefill"]["prompt_time_us"] + out["kv_transfer"]["time_us"])
    assert {"prefill_busy_fraction", "output_tokens_per_s_per_gpu", "ttft_us"} <= set(out["colocated"])
    assert _run(capsys, ["--kv-len", "3000"])["decode"]["kv_len"] == 3000


def test_a_layout_beyond_memory_is_priced_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(capsys, ["--gpu", "h100", "--prefill-ep", "8", "--decode-ep", "32"], rc=1)
    assert out["fits"] is False and out["prefill"]["fits"] is False and out["decode"]["fits"] is True
    assert "weights need" in out["prefill"]["fits_reason"] and out["fits_reason"].startswith("prefill: ")
    assert out["prefill"]["prompt_time_us"] > 0 and out["ratio"]["prefill_per_decode"] > 0
    assert main(["plan", "--disaggregated", "--gpu", "h100", "--prefill-ep", "8", "--decode-ep", "32"]) == 1
    text = capsys.readouterr().out
    assert "DOES NOT FIT: weights need" in text and "prefill instances per decode instance" in text


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--disaggregated", "--decode-ep", "32"]) == 0
    text = capsys.readouterr().out
    for needle in ("prefill instance: EP8", "decode instance: EP32", "KV transfer: 71,424 B/token", "TTFT:",
                   "prefill instances per decode instance", "colocated", "disaggregation pays"):
        assert needle in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-ep", "8"], "--prefill-ep only applies with --disaggregated"),
        (["--decode-tp", "2"], "--decode-tp only applies with --disaggregated"),
        (["--disaggregated", "--ep", "8", "--decode-ep", "16"], "--decode-ep 16 and --ep 8 disagree"),
        (["--disaggregated", "--prompt-len", "100", "--input-len", "200"], "--input-len 200 and --prompt-len 100"),
        (["--disaggregated", "--sweep"], "--sweep is not priced with --disaggregated"),
        (["--disaggregated", "--prompt-len", "0"], "input length must be at least 1"),
        (["--disaggregated", "--prefill-ep", "7"], "EP 7 does not divide the 256 expert slots"),
    ],
)
def test_bad_combinations_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


@pytest.mark.parametrize("argv", [["--output-len", "0"], ["--input-len", "-5"], ["--prefill-tp", "0"],
                                  ["--decode-ep", "x"]])
def test_non_positive_values_are_argparse_errors(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan", "--disaggregated", *argv])
    assert e.value.code == 2
    assert f"argument {argv[0]}:" in capsys.readouterr().err


def test_plan_without_the_flag_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    """The defaults (EP8 on H200, batch 32, KV 5000, 4096-token prompts) and the output, text and JSON."""
    assert main(["plan", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == PLAN_JSON_KEYS and out["kv_len"] == 5000 and out["prefill"]["prompt_len"] == 4096
    assert main(["plan"]) == 0
    d = replace(DECODE, ep=8, kv_len=5000, mtp_accept=0.6)
    expected = format_plan(plan_decode(V3, H200, d, NAME), microbatch_crossover(V3, H200, d),
                           plan_prefill(V3, H200, d, 4096))
    assert capsys.readouterr().out == expected + "\n"
