"""ModelConfig.from_hf: the published fields, both rope spellings, and clear errors."""

from __future__ import annotations

import json
import math

import pytest

from epserve.config import ConfigError, ModelConfig, yarn_get_mscale
from epserve.presets import build_config


def test_tiny_preset_parses_with_derived_fields():
    c = ModelConfig.from_dict(build_config("tiny"))
    assert c.architecture == "DeepseekV3ForCausalLM"
    assert c.kv_cache_dim == c.kv_lora_rank + c.qk_rope_head_dim
    assert c.qk_head_dim == c.qk_nope_head_dim + c.qk_rope_head_dim
    assert c.moe_layer_ids == tuple(range(c.first_k_dense_replace, c.num_hidden_layers))
    assert c.rope_scaling is not None and c.topk_method == "noaux_tc" and c.scoring_func == "sigmoid"
    m = yarn_get_mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim)
    assert math.isclose(c.softmax_scale, c.qk_head_dim**-0.5 * m * m)


def test_rope_parameters_and_rope_scaling_are_equivalent():
    published = build_config("tiny")
    current = dict(published)
    scaling = current.pop("rope_scaling")
    current["rope_parameters"] = {
        "rope_type": scaling["type"], "rope_theta": current.pop("rope_theta"),
        **{k: v for k, v in scaling.items() if k != "type"},
    }
    assert ModelConfig.from_dict(published) == ModelConfig.from_dict(current)


def test_moe_layer_freq_and_dense_prefix():
    c = ModelConfig.from_dict(build_config("tiny", overrides={"num_hidden_layers": 6, "moe_layer_freq": 2}))
    assert c.moe_layer_ids == (2, 4)


def test_v2_defaults_softmax_greedy():
    raw = build_config("tiny", overrides={"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"})
    for key in ("scoring_func", "topk_method"):
        raw.pop(key)
    c = ModelConfig.from_dict(raw)
    assert (c.scoring_func, c.topk_method) == ("softmax", "greedy")


def test_fp8_quantization_config():
    c = ModelConfig.from_dict(build_config("tiny", fp8=True))
    assert c.fp8_block_size == (128, 128)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture"),
        ({"topk_method": "sinkhorn"}, "unsupported topk_method 'sinkhorn'"),
        ({"scoring_func": "relu"}, "unsupported scoring_func 'relu'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"n_group": 3}, "not divisible by n_group"),
        ({"topk_group": 9}, "topk_group=9"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rotary scaling 'dynamic'"),
        ({"quantization_config": {"quant_method": "awq"}}, "unsupported quantization"),
        ({"kv_lora_rank": None}, "kv_lora_rank"),
    ],
)
def test_unsupported_fields_name_the_problem(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(build_config("tiny", overrides=overrides))


def test_from_hf_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_hf(tmp_path / "missing")
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(build_config("tiny")))
    assert ModelConfig.from_hf(tmp_path).hidden_size == 64


@pytest.mark.parametrize("kv_dtype, mtp", [("bf16", 0), ("fp8", 0), ("bf16", 1), ("fp8", 1)])
def test_planner_prices_the_engines_kv_bytes_per_token(kv_dtype, mtp):
    """One figure under two names: the planner's (by dtype name, torch-free) is the engine's allocation."""
    import torch

    from epserve.engine.memory import kv_bytes_per_token
    from epserve.planner import planned_kv_bytes_per_token, resolve_model

    _, model = resolve_model("deepseek-v3")
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[kv_dtype]
    layers = model.num_hidden_layers + mtp  # the engine caches the MTP layer too when it drafts
    assert planned_kv_bytes_per_token(model, kv_dtype, mtp) == kv_bytes_per_token(model, dtype, layers)


def test_gpu_memory_utilization_is_a_share_of_total_memory(monkeypatch):
    """``memory_fraction`` (--gpu-memory-utilization) budgets weights + KV cache + headroom out of the
    device's total memory, whatever is free; more than is free is refused, and it is checked when made."""
    import torch

    from epserve.config import CacheConfig, OutOfMemoryError
    from epserve.engine import memory

    model, gib, cpu = ModelConfig.from_dict(build_config("tiny")), 2**30, torch.device("cpu")
    monkeypatch.setattr(memory, "total_memory", lambda device: 10 * gib)
    monkeypatch.setattr(memory, "available_memory", lambda device: 8 * gib)
    per_block = memory.kv_bytes_per_block(model, 16, torch.float32)

    def blocks(**cache) -> int:
        return memory.determine_num_blocks(model, CacheConfig(**cache), torch.float32, cpu, gib, 10**9)

    # 0.5 of 10 GiB = 5 GiB for everything: 1 GiB of weights, 90 % of the other 4 GiB for the KV cache
    assert blocks(memory_fraction=0.5) == int(4 * gib * 0.9) // per_block
    assert blocks() == int(0.5 * 8 * gib * 0.9) // per_block  # the default: half of what is free
    with pytest.raises(OutOfMemoryError, match="only 8192.0 MiB is free"):
        blocks(memory_fraction=1.0)  # 9 GiB left for the cache, 8 free
    with pytest.raises(OutOfMemoryError, match="weights need"):
        blocks(memory_fraction=0.05)  # 0.5 GiB: less than the weights
    with pytest.raises(ConfigError, match="memory_fraction must be in"):
        CacheConfig(memory_fraction=1.5)


def test_engine_options_are_declared_once_and_placed_by_one_mapping():
    """Each field of ``EngineOptions`` names one field of the frozen configs and defaults to its default;
    ``placed`` puts every value there, the configs' own options are all covered, and
    ``build_engine_config``'s keywords are exactly the fields (an unknown one is a TypeError naming it)."""
    import dataclasses
    import inspect

    from epserve.engine.options import SECTIONS, EngineOptions, build_engine_config

    fields = dataclasses.fields(EngineOptions)
    places = [f.metadata["into"] for f in fields]
    assert len(set(places)) == len(places)  # no two options for one config field
    for f, (section, name) in zip(fields, places):
        target = {g.name: g for g in dataclasses.fields(SECTIONS[section])}[name]
        assert f.default == target.default, f.name
    values = {f.name: object() for f in fields}  # a distinct value each: placed where its field says
    placed = EngineOptions(**values).placed()
    assert all(placed[section][name] is values[f.name] for f, (section, name) in zip(fields, places))
    assert sum(map(len, placed.values())) == len(fields)
    not_options = {"engine": {"model", "model_path", "cache", "scheduler", "parallel"},  # built, not given
                   "parallel": {"eplb", "timeout_s"}}  # (eplb: from its own options; timeout_s: no option)
    for section, config in SECTIONS.items():
        assert {g.name for g in dataclasses.fields(config)} - set(placed[section]) == not_options.get(section, set())
    keywords = inspect.signature(build_engine_config).parameters
    assert list(keywords) == ["model", *(f.name for f in fields)]
    with pytest.raises(TypeError, match="unknown engine options bogus, max_seqs"):
        build_engine_config(None, max_seqs=4, bogus=1)  # refused before any checkpoint is read
