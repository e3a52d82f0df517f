"""Checkpoint reading/writing, FP8 block quantization, and the random-weight presets."""

from __future__ import annotations

import json
import math
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from epserve import env
from epserve.checkpoint import (
    FP8_DTYPE,
    FP8_MAX,
    INDEX_FILE,
    CheckpointError,
    CheckpointReader,
    fp8_block_dequantize,
    fp8_block_quantize,
    iter_with_progress,
    progress_enabled,
    save_checkpoint,
)
from epserve.config import ModelConfig
from epserve.presets import build_config, count_parameters, default_model_path, tensor_specs

# DeepSeek-V3 stores exactly these linears in FP8.
FP8_NAME = re.compile(
    r"model\.layers\.\d+\.("
    r"self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)"
    r"|eh_proj)\.weight"
)


# ---- FP8 ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,block",
    [((300, 200), (128, 128)), ((128, 256), (128, 128)), ((1, 5), (128, 128)), ((70, 33), (16, 32))],
)
def test_fp8_roundtrip_error_bound_and_partial_blocks(shape, block):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    w_fp8, scale_inv = fp8_block_quantize(w, block)
    n0, n1 = math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])
    assert w_fp8.dtype == FP8_DTYPE and w_fp8.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (n0, n1)

    deq = fp8_block_dequantize(w_fp8, scale_inv, block)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    scale = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]
    # e4m3: 3 mantissa bits -> relative rounding error <= 2^-4; subnormal spacing 2^-9 (half = 2^-10).
    bound = w.abs() * 2**-4 + scale * 2**-10 + 1e-7
    assert ((deq - w).abs() <= bound).all()
    # Each block's largest magnitude maps to the e4m3 maximum.
    for i in range(n0):
        for j in range(n1):
            tile = w_fp8[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            assert tile.float().abs().max().item() == FP8_MAX


def test_fp8_zero_block_and_bad_scale_shape():
    w = torch.zeros(130, 10)
    w[129, 3] = 2.0
    w_fp8, scale_inv = fp8_block_quantize(w)
    assert scale_inv[0, 0] == 1.0 and scale_inv[1, 0] == pytest.approx(2.0 / FP8_MAX)
    assert torch.equal(fp8_block_dequantize(w_fp8, scale_inv), w)
    with pytest.raises(ValueError, match="scale_inv shape"):
        fp8_block_dequantize(w_fp8, torch.ones(1, 1))
    with pytest.raises(ValueError, match="2-D"):
        fp8_block_quantize(torch.ones(2, 2, 2))


def test_fp8_dequantize_into_a_bf16_view_matches_the_full_product():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    w_fp8, scale_inv = fp8_block_quantize(w)
    full = w_fp8.float() * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    target = torch.zeros(2, 300, 200, dtype=torch.bfloat16)
    got = fp8_block_dequantize(w_fp8, scale_inv, out=target[1])
    assert got.data_ptr() == target[1].data_ptr() and torch.equal(target[1], full.bfloat16())
    assert not target[0].any()
    with pytest.raises(ValueError, match="out has shape"):
        fp8_block_dequantize(w_fp8, scale_inv, out=torch.empty(300, 199))


# ---- save / read ----------------------------------------------------------------------------


def test_sharded_save_load_roundtrip(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.weight": torch.randn(64, 32, generator=g).bfloat16(),
        "c.bias": torch.randn(7, generator=g),
        "d.weight": torch.randn(100, 100, generator=g),
    }
    tensors["e.tied"] = tensors["a.weight"]  # shared storage must still save
    save_checkpoint(tmp_path, {"hello": 1}, tensors, max_shard_bytes=10_000)

    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert all((tmp_path / s).is_file() for s in shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert json.loads((tmp_path / "config.json").read_text()) == {"hello": 1}

    reader = CheckpointReader(tmp_path)
    assert reader.keys() == sorted(tensors)
    for name, t in tensors.items():
        got = reader.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t)
    assert reader.get("b.weight", dtype="float32").dtype == torch.float32

    # Re-saving into the same directory leaves no stale shards behind.
    save_checkpoint(tmp_path, {}, {"x": torch.ones(3)})
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


def test_single_file_checkpoint(tmp_path):
    save_file({"w": torch.arange(6.0).view(2, 3)}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert reader.keys() == ["w"] and reader.has("w") and not reader.has("v")
    assert torch.equal(reader.get("w"), torch.arange(6.0).view(2, 3))


def test_reader_dequantizes_fp8(tiny_fp8_ckpt):
    reader = CheckpointReader(tiny_fp8_ckpt)
    assert reader.block_size == (128, 128)
    assert not any(k.endswith("_scale_inv") for k in reader.keys())
    quantized = [k for k in reader.keys() if reader.is_fp8(k)]
    assert quantized and set(quantized) == {k for k in reader.keys() if FP8_NAME.fullmatch(k)}
    for name in quantized:
        raw, scale = reader.get_fp8(name)
        assert raw.dtype == FP8_DTYPE and scale.dtype == torch.float32
        assert torch.equal(reader.get(name), fp8_block_dequantize(raw, scale, (128, 128)))
    name = quantized[0]
    assert reader.get(name, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match="not an FP8 weight"):
        reader.get_fp8("model.norm.weight")


def test_fp8_bf16_dtypes_as_released(make_ckpt):
    reader = CheckpointReader(make_ckpt("tiny", fp8=True, dtype="bfloat16"))
    dtypes = {k: reader.get_raw(k).dtype for k in reader.raw_keys()}
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    assert dtypes["lm_head.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.mlp.gate.weight"] == torch.bfloat16
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    assert dtypes["model.layers.3.eh_proj.weight"] == FP8_DTYPE
    assert dtypes["model.layers.3.eh_proj.weight_scale_inv"] == torch.float32
    assert dtypes["model.layers.1.mlp.experts.7.down_proj.weight"] == FP8_DTYPE


def test_reader_errors_name_the_problem(tmp_path, tiny_ckpt):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match="nope"):
        CheckpointReader(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no safetensors"):
        CheckpointReader(tmp_path / "empty")

    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    shard = json.loads((broken / INDEX_FILE).read_text())["weight_map"]["lm_head.weight"]
    (broken / shard).unlink()
    with pytest.raises(CheckpointError, match=re.escape(shard)):
        CheckpointReader(broken)

    reader = CheckpointReader(tiny_ckpt)
    with pytest.raises(CheckpointError, match=re.escape("model.layers.9.mlp.gate.weight")):
        reader.get("model.layers.9.mlp.gate.weight")
    assert isinstance(CheckpointError("x"), ValueError)


def test_progress_disabled_by_env_and_without_tty(monkeypatch):
    monkeypatch.setenv(env.NO_PROGRESS, "1")
    assert not progress_enabled()
    assert list(iter_with_progress(range(5), "x")) == [0, 1, 2, 3, 4]
    monkeypatch.delenv(env.NO_PROGRESS)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    assert not progress_enabled()


# ---- presets ----------------------------------------------------------------------------------


def test_config_is_published_format(tiny_fp8_ckpt):
    cfg = json.loads((tiny_fp8_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["model_type"] == "deepseek_v3"
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["rope_scaling"]["mscale_all_dim"] == 1.0
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }
    mc = ModelConfig.from_hf(tiny_fp8_ckpt)
    assert mc.is_fp8 and mc.fp8_block_size == (128, 128) and mc.moe_layer_ids == (1, 2)
    assert mc.rope_scaling is not None and mc.rope_scaling.factor == 4


def test_tensors_follow_merged_config(make_ckpt):
    path = make_ckpt("tiny", overrides={"q_lora_rank": None, "num_hidden_layers": 2, "n_routed_experts": 8})
    mc = ModelConfig.from_hf(path)
    reader = CheckpointReader(path)
    specs = {s.name: s.shape for s in tensor_specs(mc)}
    assert reader.keys() == sorted(specs)
    for name, shape in specs.items():
        assert tuple(reader.get(name).shape) == shape, name
    assert reader.has("model.layers.0.self_attn.q_proj.weight")
    assert not reader.has("model.layers.0.self_attn.q_a_proj.weight")
    assert reader.has("model.layers.2.eh_proj.weight") and reader.has(
        "model.layers.1.mlp.experts.7.up_proj.weight"
    )


def test_same_seed_same_checkpoint(tmp_path, tiny_ckpt, make_ckpt):
    from epserve.presets import make_checkpoint

    again = make_checkpoint(tmp_path / "again", "tiny", dtype="float32", seed=0)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", INDEX_FILE):
        assert (again / f).read_bytes() == (tiny_ckpt / f).read_bytes(), f
    a, b = CheckpointReader(tiny_ckpt), CheckpointReader(again)
    assert all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    other = CheckpointReader(make_ckpt("tiny", seed=1))
    assert not torch.equal(
        a.get("model.layers.1.mlp.gate.weight"), other.get("model.layers.1.mlp.gate.weight")
    )
    bias = a.get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == torch.float32 and bias.abs().min() > 0


def test_small_preset_size():
    mc = ModelConfig.from_dict(build_config("small"))
    assert 350e6 < count_parameters(mc) < 450e6
    assert count_parameters(mc, include_mtp=True) > count_parameters(mc)


def test_default_model_path_is_built_once_and_race_free(tmp_path, monkeypatch):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0].parent == tmp_path
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temp dirs left
    stamp = (results[0] / "config.json").stat().st_mtime_ns
    assert default_model_path() == results[0]
    assert (results[0] / "config.json").stat().st_mtime_ns == stamp
    assert CheckpointReader(results[0]).get("lm_head.weight").dtype == torch.bfloat16


# ---- against transformers ---------------------------------------------------------------------


def _load_hf(path: Path):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    n_layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert info["unexpected_keys"] and all(
        k.startswith(f"model.layers.{n_layers}.") for k in info["unexpected_keys"]
    )
    return model.eval()


def _check_against_reader(model, reader: CheckpointReader) -> None:
    sd = model.state_dict()
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ):
        assert torch.equal(sd[name], reader.get(name, dtype=torch.float32)), name
    # transformers packs per-expert weights: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    e = 3
    p = "model.layers.1.mlp.experts"
    gate_up = torch.cat([reader.get(f"{p}.{e}.gate_proj.weight"), reader.get(f"{p}.{e}.up_proj.weight")])
    assert torch.equal(sd[f"{p}.gate_up_proj"][e], gate_up.float())
    assert torch.equal(sd[f"{p}.down_proj"][e], reader.get(f"{p}.{e}.down_proj.weight").float())


@pytest.mark.parametrize(
    "overrides",
    [None, {"q_lora_rank": None}, {"rope_scaling": None, "n_group": 1, "topk_group": 1}],
    ids=["tiny", "no-q-lora", "no-yarn-one-group"],
)
def test_loads_in_transformers(make_ckpt, overrides):
    path = make_ckpt("tiny", overrides=overrides)
    model = _load_hf(path)
    _check_against_reader(model, CheckpointReader(path))
    mc = ModelConfig.from_hf(path)
    assert mc.q_lora_rank == (overrides or {}).get("q_lora_rank", 48)
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 17, 300]])).logits
    assert logits.shape == (1, 4, mc.vocab_size) and torch.isfinite(logits).all()


def test_fp8_dequantized_loads_in_transformers(tiny_fp8_ckpt, tmp_path):
    """Without accelerate transformers cannot read FP8; check our dequantized tensors fit its model."""
    reader = CheckpointReader(tiny_fp8_ckpt)
    config = {k: v for k, v in reader.config.items() if k != "quantization_config"}
    save_checkpoint(tmp_path, config, {k: reader.get(k) for k in reader.keys()})
    _check_against_reader(_load_hf(tmp_path), reader)


def test_fp8_loads_in_transformers(tiny_fp8_ckpt):
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    _check_against_reader(_load_hf(tiny_fp8_ckpt), CheckpointReader(tiny_fp8_ckpt))


def test_random_init_is_not_degenerate(tiny_ckpt):
    model = _load_hf(tiny_ckpt)
    ids = torch.tensor([[0, 72, 101, 33, 260, 301, 17, 44]])
    with torch.no_grad():
        for _ in range(24):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        logits = model(ids).logits[0]  # [T, V]
    top2 = logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    assert 2.0 < logits.std(dim=-1).mean() < 8.0
    assert margin.median() > 0.1
    assert len(set(ids[0, 8:].tolist())) > 4  # greedy decoding does not lock onto one token
