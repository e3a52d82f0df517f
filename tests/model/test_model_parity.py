"""The engine against the numerical oracle: transformers' DeepseekV3ForCausalLM (and V2) in fp32."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.runner import BatchPlan
from tests.oracle import hf_greedy

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "tiny": {},  # YaRN, n_group 4 / topk_group 2, non-zero correction bias
    "q_lora_null": {"q_lora_rank": None},
    "no_yarn": {"rope_scaling": None},
    "one_group": {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2},
    # DeepSeek-V2-Lite style: softmax scores, plain top-k, no q LoRA, no renormalisation.
    "v2_lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "q_lora_rank": None,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    },
    # DeepSeek-V2 style: softmax scores, groups ranked by their best expert.
    "v2_group_limited": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "topk_method": "group_limited_greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 16.0,
    },
}

PROMPTS = [
    [5, 17, 99, 3],
    list(range(10, 60)),
    [7],
    [300, 200, 100, 50, 25, 12, 6, 3, 1 + 1],
    list(range(100, 133)),
    [42] * 20,
    [11, 400, 11, 400, 11, 400, 9],
    list(range(500, 480, -1)) + list(range(2, 30)),
]


def hf_model(path: str, overrides: dict):
    arch = overrides.get("architectures", ["DeepseekV3ForCausalLM"])[0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32)
    return model.eval()


def engine_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position from one prefill through the paged cache. [T, V]"""
    runner = llm.engine.runner
    request = Request("probe", prompt, SamplingParams(max_tokens=1))
    num_blocks = -(-len(prompt) // runner.block_size)
    request.block_ids = list(range(num_blocks))
    chunk = ScheduledChunk(request=request, start=0, num_tokens=len(prompt))
    batch = BatchPlan.from_chunks([chunk], runner.block_size).to_batch(runner.device, runner.block_size)
    with torch.inference_mode():
        hidden = runner.model(batch, runner.kv_caches)
        return runner.model.compute_logits(hidden)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, make_ckpt, device):
    path = make_ckpt("tiny", dtype="float32", overrides=VARIANTS[request.param])
    llm = LLM(path, dtype="float32", num_blocks=256, device=device)
    return path, hf_model(str(path), VARIANTS[request.param]), llm


def test_prefill_logits_match_transformers(variant):
    path, hf, llm = variant
    for prompt in PROMPTS[:4]:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        ours = engine_logits(llm, prompt).cpu()
        assert ours.shape == ref.shape
        assert rel_err(ours, ref) < 1e-4, f"prompt of {len(prompt)} tokens"


def test_greedy_continuations_match_transformers(variant):
    path, hf, llm = variant
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, prompt, 32)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"


def test_long_prompt_beyond_yarn_original_context_in_chunks(make_ckpt, device):
    """A 700-token prompt (past YaRN's original 512 positions) prefilled in 128-token chunks, each
    continuing from the cached blocks of the ones before, then decoded: same tokens as transformers."""
    path = make_ckpt("tiny", dtype="float32")
    hf = hf_model(str(path), {})
    llm = LLM(path, dtype="float32", num_blocks=128, max_num_batched_tokens=128, device=device)
    prompt = [(i * 37) % 500 + 2 for i in range(700)]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    ref = hf_greedy(hf, prompt, 16)
    assert out.token_ids == ref


def test_mtp_speculative_greedy_matches_transformers(variant, device, request):
    """Greedy tokens with MTP drafting (random weights: drafts verified and mostly rejected) equal the
    oracle's on every parity config, with 1, 2 or 3 draft tokens in turn."""
    path, hf, _ = variant
    k = 1 + list(VARIANTS).index(request.node.callspec.params["variant"]) % 3
    llm = LLM(path, dtype="float32", num_blocks=256, device=device, speculative="mtp", num_speculative_tokens=k)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:3], llm.generate(PROMPTS[:3], params)):
        ref = hf_greedy(hf, prompt, 12)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
    assert llm.speculative_stats()["num_draft_tokens"] > 0
