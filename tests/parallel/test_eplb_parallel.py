"""EPLB across rank processes on a model skewed on purpose (experts 4 and 5, both on rank 1 at dp 4,
win nearly every token): at dp 4 (padded dispatcher, every overlap mode) a rebalance with 4 redundant
experts brings the busiest rank to within 15% of the mean, moves only the experts that change rank, and
never changes a token or a logprob; a server at dp 2 (all_to_all, the ``local`` replica selection)
rebalancing every few steps under load changes no request in flight."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from tests.engine.test_eplb import assert_same, outputs
from tests.serve_harness import Proc, metric, wait_http_ok

pytestmark = pytest.mark.slow

PROMPTS = [[i + 1, i * 3 % 50 + 2, 7, 9, 11 + i] for i in range(8)]
ENGINE = {"dtype": "float32", "num_blocks": 64, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def single(skewed_ckpt):
    llm = LLM(skewed_ckpt, **ENGINE)
    return outputs(llm, PROMPTS, 12), llm.expert_load()


def test_rebalance_at_dp4_balances_and_keeps_tokens(skewed_ckpt, single):
    reference, ref_load = single
    with LLM(skewed_ckpt, dp=4, num_redundant_experts=4, dispatch="padded", **ENGINE) as llm:
        assert_same(outputs(llm, PROMPTS, 12), reference)
        before = llm.expert_load()
        assert before.per_expert == ref_load.per_expert  # the replicas take tokens, routing is unchanged
        assert before.imbalance > 1.3
        report = llm.rebalance_experts()
        assert 0 < report.experts_moved <= 2 * 20 and report.bytes_moved > 0
        assert report.imbalance_after < report.imbalance_before
        for mode in ("none", "dispatch", "microbatch"):
            llm.reset_expert_load()
            llm.set_overlap(mode)
            assert_same(outputs(llm, PROMPTS, 12), reference)
            after = llm.expert_load()
            assert after.per_expert == ref_load.per_expert
            assert after.imbalance <= 1.15, (mode, after.summary())
        again = llm.rebalance_experts()  # the same load again: the same placement, nothing moves
        assert again.experts_moved == 0 and again.bytes_moved == 0 and again.layers_changed == 0


def test_server_rebalances_under_load(skewed_ckpt, tmp_path):
    port = free_port()
    proc = Proc(["serve", str(skewed_ckpt), "--port", str(port), "--dp", "2", "--dtype", "float32",
                 "--num-blocks", "64", "--num-redundant-experts", "2", "--enable-eplb", "--eplb-window-size", "8",
                 "--eplb-step-interval", "4", "--eplb-replica-selection", "local"], tmp_path / "serve.log")
    url = f"http://127.0.0.1:{port}"
    plain = LLM(skewed_ckpt, dtype="float32", num_blocks=64)
    try:
        wait_http_ok(f"{url}/health", proc)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda p: client.completions.create(
                model=str(skewed_ckpt), prompt=p, max_tokens=16, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True}), prompts))
        want = plain.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1))
        for out, w in zip(outs, want):
            assert out.choices[0].text == w.text
            got = out.choices[0].logprobs.token_logprobs
            assert max(abs(a - b.logprob) for a, b in zip(got, w.logprobs, strict=True)) < 1e-4
        deadline = time.monotonic() + 30
        while True:  # the router refreshes each instance's load figures every few seconds
            text = httpx.get(f"{url}/metrics", timeout=10).text
            rebalances = [metric(text, "epserve:eplb_rebalances_total", engine=str(i)) for i in range(2)]
            if min(rebalances) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert min(rebalances) >= 2, rebalances  # both DP groups' leaders report the world's rebalances
        assert 1.0 <= metric(text, "epserve:expert_load_layer_imbalance", engine="0", layer="1") < 4.0
        stats = httpx.get(f"{url}/expert_load", timeout=10).json()["instances"]
        assert len(stats) == 1  # one world: its DP groups' leaders report the same load
        per_expert = torch.tensor(stats[0]["per_expert"])
        assert stats[0]["layers"] == [1, 2] and per_expert.shape == (2, 16)
        assert (per_expert[:, 4:6].min(dim=1).values > 3 * per_expert.float().mean(dim=1)).all()
    finally:
        proc.kill_all()
    assert "EPLB rebalance" in (tmp_path / "serve.log").read_text()
