"""The planner's weights per GPU equal the engine's, byte for byte: the loader's plan on the meta device
(``plan_weight_bytes``) for DeepSeek-V3 layouts, and a small model the engine actually loads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from epserve import LLM
from epserve.config import ModelConfig
from epserve.model.load_plan import model_bytes, plan_weight_bytes
from epserve.parallel.context import ParallelContext
from epserve.planner import Deployment, estimate_memory, load_hardware
from epserve.planner.memory import expert_counts, weight_counts
from epserve.planner.models import DEEPSEEK_V3
from epserve.presets import build_config

V3 = ModelConfig.from_dict(DEEPSEEK_V3)
GIB = 2**30


def _engine_bytes(model: ModelConfig, d: Deployment, rank: int = 0) -> int:
    """Bytes the engine's ``rank`` plans to hold (rank 0: a DP group's leader, the most loaded)."""
    ctx = ParallelContext(dp=d.dp, tp=d.tp, rank=rank, device=torch.device("cpu"))
    return plan_weight_bytes(model, ctx, fp8=d.weight_dtype == "fp8", dtype=torch.bfloat16,
                             num_redundant_experts=d.num_redundant_experts)


@pytest.mark.parametrize("weight_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize(("ep", "tp", "redundant"), [(8, 1, 0), (16, 1, 0), (32, 1, 0), (16, 2, 0), (32, 1, 32)])
def test_deepseek_v3_weights_match_the_engine_plan(ep: int, tp: int, redundant: int, weight_dtype: str) -> None:
    d = Deployment(ep=ep, tp=tp, num_redundant_experts=redundant, weight_dtype=weight_dtype)
    planned = estimate_memory(V3, load_hardware("h200"), d).weights_bytes
    assert planned == _engine_bytes(V3, d)


def test_deepseek_v3_figures() -> None:
    """The FP8 EP8 figure and what moves between layouts, exactly."""
    d = Deployment(ep=8)
    fp8 = weight_counts(V3, d).bytes("fp8")
    assert fp8 / GIB == pytest.approx(96.06, abs=0.005)
    # EP8 -> EP16: 16 experts x 58 MoE layers leave every GPU, with their int64 entries of the slot table
    assert fp8 - weight_counts(V3, replace(d, ep=16)).bytes("fp8") == 16 * 58 * (expert_counts(V3).bytes("fp8") + 8)
    # every V3 expert matrix is a whole number of 128x128 tiles: 3 * 7168 * 2048 bytes + 2688 fp32 scales
    assert expert_counts(V3).bytes("fp8") == 3 * 7168 * 2048 + 4 * 2688
    # MTP, not loaded by the engine, comes on top
    assert weight_counts(V3, replace(d, mtp_draft=1)).bytes("fp8") > fp8


@pytest.mark.parametrize("weight_dtype", ["fp8", "bf16"])
@pytest.mark.parametrize("overrides", [
    {},
    {"q_lora_rank": None},  # q_proj and kv_a_proj_with_mqa separate, no q_a_layernorm
    {"n_shared_experts": 0, "tie_word_embeddings": True},  # the engine keeps an LM head even when tied
    {"topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1},  # no correction bias
])
@pytest.mark.parametrize(("ep", "tp", "redundant"), [(1, 1, 0), (4, 2, 0), (4, 4, 4)])
def test_small_models_match_the_engine_plan(overrides: dict, ep: int, tp: int, redundant: int,
                                            weight_dtype: str) -> None:
    """Dimensions that are not multiples of 128 (edge tiles), the configuration variants, TP up to 4."""
    model = ModelConfig.from_dict(build_config("tiny", overrides=overrides))
    d = Deployment(ep=ep, tp=tp, num_redundant_experts=redundant, weight_dtype=weight_dtype)
    held = [_engine_bytes(model, d, rank) for rank in range(d.ep)]
    assert weight_counts(model, d).bytes(weight_dtype) == held[0] == max(held)


@pytest.mark.parametrize("quantization", ["fp8", None])
def test_loaded_model_matches_the_planner(make_ckpt, quantization: str | None) -> None:
    path = make_ckpt("tiny128", fp8=True, dtype="bfloat16")
    with LLM(path, quantization=quantization, num_blocks=16) as llm:
        held = model_bytes(llm.engine.runner.model)
    d = Deployment(ep=1, weight_dtype="fp8" if quantization else "bf16")
    assert weight_counts(ModelConfig.from_hf(path), d).bytes(d.weight_dtype) == held
