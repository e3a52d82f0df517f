"""NVFP4 checkpoints as NVIDIA's ModelOpt writes them: the format (``checkpoint/nvfp4.py``), its detection and
refusals (``config/model.py``, ``check_nvfp4_module``) and the writer (``checkpoint/nvfp4_export.py``,
``make_checkpoint(quantization="nvfp4")``), checked against a real ModelOpt export (``modelopt_nvfp4_tiny/``,
made by its ``export_with_modelopt.py``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from epserve.checkpoint import CheckpointError, CheckpointReader, save_checkpoint
from epserve.checkpoint.nvfp4 import (
    E2M1_VALUES,
    NVFP4_SUFFIXES,
    check_nvfp4_module,
    e2m1_codes,
    is_excluded,
    nvfp4_dequantize,
    nvfp4_quantize,
    pack_e2m1,
    unpack_e2m1,
)
from epserve.checkpoint.nvfp4_export import (
    STAND_IN_INPUT_AMAX,
    is_nvfp4_target,
    nvfp4_checkpoint,
    summarize_exclusions,
)
from epserve.config import ModelConfig
from epserve.config.model import ConfigError
from epserve.presets import build_config, make_checkpoint, random_weights

MODELOPT_EXPORT = Path(__file__).parent / "modelopt_nvfp4_tiny"
# The export's model in the presets' terms (its transformers config has no MTP weights).
EXPORT_SHAPE = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "num_nextn_predict_layers": 0,
}


def _module_tensors(reader: CheckpointReader, module: str) -> dict[str, torch.Tensor | None]:
    return {s: reader.get_raw(f"{module}.{s}") if reader.has(f"{module}.{s}") else None for s in NVFP4_SUFFIXES}


def _quantized_modules(reader: CheckpointReader) -> list[str]:
    return sorted(k.removesuffix(".weight_scale_2") for k in reader.raw_keys() if k.endswith(".weight_scale_2"))


@pytest.fixture(scope="module")
def nvfp4_tiny(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("nvfp4") / "tiny", preset="tiny", seed=3, quantization="nvfp4")


# ---- the format --------------------------------------------------------------------------------


def test_code_points_in_modelopt_order():
    assert E2M1_VALUES.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(E2M1_VALUES[8]) and not torch.signbit(E2M1_VALUES[0])


def test_pack_unpack_exact():
    codes = torch.randint(0, 16, (5, 3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_e2m1(codes)
    assert packed.shape == (5, 3, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_e2m1(packed), codes)
    every_byte = torch.arange(256, dtype=torch.uint8).view(8, 32)
    assert torch.equal(pack_e2m1(unpack_e2m1(every_byte)), every_byte)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))


def test_nibble_order_hand_worked():
    """A row whose amax is 6 has global scale 6 / 2688 and block scale 448 (exact in e4m3): the values are
    their own e2m1 points. ModelOpt packs column 2j in the low nibble, 2j + 1 in the high one."""
    row = [0.5, -1.0, 6.0, 0.0, 1.5, -0.25, 0.75, -6.0, 2.0, 3.0, 4.0, -0.5, 1.0, -1.5, -2.0, 5.0]
    q = nvfp4_quantize(torch.tensor([row]))
    assert q.weight_scale_2.item() == pytest.approx(6 / 2688) and q.weight_scale.float().item() == 448
    # codes: 0.5->1, -1->10 | 6->7, 0->0 | 1.5->3, -0.25->8 (-0) | 0.75->2 (tie to even), -6->15 | 2->4, 3->5 |
    # 4->6, -0.5->9 | 1->2, -1.5->11 | -2->12, 5->6 (tie to even)
    assert q.weight[0].tolist() == [0xA1, 0x07, 0x83, 0xF2, 0x54, 0x96, 0xB2, 0x6C]
    assert nvfp4_dequantize(*q)[0].tolist()[:8] == [0.5, -1.0, 6.0, 0.0, 1.5, -0.0, 1.0, -6.0]


def test_rounding_ties_to_even_code_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5, -0.1, -5.5, 0.26, 2.51])
    assert e2m1_codes(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 15, 1, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_the_format_error(dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g) * 3).to(dtype)
    w[3, 16:32] = 0  # an all-zero block: scale 1, codes 0
    q = nvfp4_quantize(w)
    assert q.weight.shape == (96, 128) and q.weight.dtype == torch.uint8
    assert q.weight_scale.shape == (96, 16) and q.weight_scale.dtype == torch.float8_e4m3fn
    assert q.weight_scale_2.shape == () and q.weight_scale_2.dtype == torch.float32
    assert q.weight_scale[3, 1].float().item() == 1.0 and not q.weight[3, 8:16].any()
    deq = nvfp4_dequantize(*q)
    assert deq.dtype == torch.float32 and nvfp4_dequantize(*q, dtype=torch.bfloat16).dtype == torch.bfloat16
    x = w.float()
    block_amax = x.view(96, 16, 16).abs().amax(-1, keepdim=True)
    # Half the widest e2m1 step (1, between 4 and 6) of a block scale that e4m3 rounds by at most 1/16.
    err = (deq - x).view(96, 16, 16).abs()
    assert (err <= block_amax / 6 * (1 + 1 / 16) + 1e-6).all()
    assert (deq - x).norm() / x.norm() < 0.12


def test_bit_identical_to_modelopt():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g) * 5).to(dtype)
        packed, scale, scale_2 = qtensor.NVFP4QTensor.quantize(w.clone(), 16)
        q = nvfp4_quantize(w)
        assert torch.equal(packed._quantized_data, q.weight)
        assert torch.equal(scale.view(torch.uint8), q.weight_scale.view(torch.uint8))
        assert torch.equal(scale_2, q.weight_scale_2)
        theirs = packed.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
        assert torch.equal(theirs, nvfp4_dequantize(*q))


def test_is_excluded_with_modelopt_wildcards():
    patterns = ["lm_head", "model.embed_tokens", "model.layers.1.self_attn*", "model.layers.1.mlp.gate"]
    assert is_excluded("lm_head", patterns)
    assert is_excluded("model.layers.1.self_attn.kv_a_proj_with_mqa", patterns)
    assert is_excluded("model.layers.1.mlp.gate", patterns)
    assert not is_excluded("model.layers.1.mlp.experts.0.gate_proj", patterns)
    assert not is_excluded("model.layers.11.self_attn.o_proj", patterns)
    assert not is_excluded("model.layers.1.mlp.shared_experts.up_proj", patterns)
    assert is_excluded("model.layers.2.mlp.down_proj", ["model.layers.2.mlp"])  # a parent module's name
    assert not is_excluded("lm_head", [])


# ---- a real ModelOpt export --------------------------------------------------------------------


def test_modelopt_export_detected_and_valid():
    cfg = ModelConfig.from_hf(MODELOPT_EXPORT)
    assert cfg.is_nvfp4 and not cfg.is_fp8 and cfg.nvfp4_group_size == 16
    assert cfg.nvfp4_exclude == (
        "lm_head", "model.embed_tokens", "model.layers.0.self_attn*", "model.layers.1.mlp.gate",
        "model.layers.1.self_attn*",
    )
    raw = json.loads((MODELOPT_EXPORT / "config.json").read_text())
    assert ModelConfig.from_dict(raw).nvfp4_exclude == cfg.nvfp4_exclude  # config.json alone says the same
    with CheckpointReader(MODELOPT_EXPORT) as reader:
        modules = _quantized_modules(reader)
        assert len(modules) == 3 + 3 * 5  # the dense MLP, 4 routed experts and the shared expert
        for m in modules:
            assert is_nvfp4_target(m) and not is_excluded(m, cfg.nvfp4_exclude)
            t = _module_tensors(reader, m)
            check_nvfp4_module(m, t, in_features=2 * t["weight"].shape[1], out_features=t["weight"].shape[0])
            assert torch.isfinite(nvfp4_dequantize(t["weight"], t["weight_scale"], t["weight_scale_2"])).all()
        for name in reader.raw_keys():
            if name.endswith(".weight") and reader.get_raw(name).dim() == 2 and not is_nvfp4_target(name[:-7]):
                assert is_excluded(name.removesuffix(".weight"), cfg.nvfp4_exclude), name


def test_writer_layout_is_modelopts(tmp_path):
    """The same model shape written by ``make_checkpoint`` and exported by ModelOpt: the same tensor names,
    the quantized ones with the same dtypes and shapes, the same module lists and quantization config."""
    config = build_config("tiny", overrides=EXPORT_SHAPE)  # (a vocabulary too small for make_checkpoint's tokenizer)
    config, tensors, hf_quant = nvfp4_checkpoint(config, random_weights(config))
    ours = save_checkpoint(tmp_path / "ours", config, tensors, hf_quant_config=hf_quant)
    mine = load_file(ours / "model-00001-of-00001.safetensors")
    theirs = load_file(MODELOPT_EXPORT / "model.safetensors")
    assert set(mine) == set(theirs)
    for name, t in theirs.items():
        assert mine[name].shape == t.shape, name
        if t.dtype in (torch.uint8, torch.float8_e4m3fn) or name.endswith(("_scale", "_scale_2")):
            assert mine[name].dtype == t.dtype, name
    hq_mine = json.loads((ours / "hf_quant_config.json").read_text())
    hq_theirs = json.loads((MODELOPT_EXPORT / "hf_quant_config.json").read_text())
    assert hq_mine["quantization"] == hq_theirs["quantization"]
    assert list(hq_mine["quantization"]) == list(hq_theirs["quantization"])  # the key order too
    qc_mine = json.loads((ours / "config.json").read_text())["quantization_config"]
    qc_theirs = json.loads((MODELOPT_EXPORT / "config.json").read_text())["quantization_config"]
    assert {**qc_mine, "producer": None} == {**qc_theirs, "producer": None}


def test_exclusion_summary_matches_modelopts():
    summarize = pytest.importorskip("modelopt.torch.export.quant_utils")._prefix_wildcard_summarize_exclude_modules
    names = [f"model.layers.{i}.{m}" for i in range(12) for m in (
        "self_attn.q_proj", "mlp.gate", "mlp.experts.0.up_proj", "mlp.shared_experts.down_proj", "eh_proj")]
    names += ["lm_head", "model.embed_tokens", "model.layers.1", "model.layers.10.x.y"]
    quantized = [n for n in names if is_nvfp4_target(n)]
    unquantized = [n for n in names if not is_nvfp4_target(n)]
    assert summarize_exclusions(unquantized, quantized) == sorted(summarize(unquantized, quantized))


# ---- the writer --------------------------------------------------------------------------------


def test_written_checkpoint_per_module(nvfp4_tiny, tmp_path):
    cfg = ModelConfig.from_hf(nvfp4_tiny)
    assert cfg.is_nvfp4 and cfg.nvfp4_group_size == 16
    bf16 = make_checkpoint(tmp_path / "bf16", preset="tiny", seed=3)
    with CheckpointReader(nvfp4_tiny) as reader, CheckpointReader(bf16) as ref:
        modules = _quantized_modules(reader)
        n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) + cfg.num_nextn_predict_layers
        assert len(modules) == 3 * (n_layers - moe_layers) + 3 * (cfg.n_routed_experts + 1) * moe_layers
        assert any(m.startswith(f"model.layers.{cfg.num_hidden_layers}.mlp.experts.") for m in modules)  # MTP's
        quantized_bytes = bf16_bytes = 0
        for m in modules:
            t = _module_tensors(reader, m)
            w = ref.get_raw(m + ".weight")
            check_nvfp4_module(m, t, in_features=w.shape[1], out_features=w.shape[0])
            assert not is_excluded(m, cfg.nvfp4_exclude)
            assert t["input_scale"].item() == pytest.approx(STAND_IN_INPUT_AMAX / 2688)
            deq = nvfp4_dequantize(t["weight"], t["weight_scale"], t["weight_scale_2"])
            assert (deq - w.float()).norm() / w.float().norm() < 0.12, m
            quantized_bytes += sum(x.numel() * x.element_size() for x in t.values())
            bf16_bytes += w.numel() * w.element_size()
            if m.endswith("gate_proj"):  # gate and up share their global and input scales, as ModelOpt fuses them
                up = _module_tensors(reader, m.removesuffix("gate_proj") + "up_proj")
                assert torch.equal(up["weight_scale_2"], t["weight_scale_2"])
                amax = max(w.float().abs().max(), ref.get_raw(m.removesuffix("gate_proj") + "up_proj.weight").float()
                           .abs().max())
                assert t["weight_scale_2"].item() == pytest.approx(amax.item() / 2688)
        assert quantized_bytes <= 0.29 * bf16_bytes
        for name in reader.raw_keys():  # everything else as the bf16 checkpoint stores it
            if not name.endswith(("_scale", "_scale_2")) and name.removesuffix(".weight") not in modules:
                assert torch.equal(reader.get_raw(name), ref.get_raw(name)), name
                if name.endswith(".weight") and reader.get_raw(name).dim() == 2:
                    assert is_excluded(name.removesuffix(".weight"), cfg.nvfp4_exclude), name


def test_bf16_checkpoint_over_an_nvfp4_one_is_not_nvfp4(tmp_path):
    make_checkpoint(tmp_path / "c", preset="tiny", quantization="nvfp4")
    make_checkpoint(tmp_path / "c", preset="tiny")
    assert not (tmp_path / "c" / "hf_quant_config.json").exists()
    assert not ModelConfig.from_hf(tmp_path / "c").is_nvfp4


def test_make_checkpoint_refuses_conflicting_quantization(tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        make_checkpoint(tmp_path / "x", preset="tiny", fp8=True, quantization="nvfp4")
    with pytest.raises(ValueError, match="quantization"):
        make_checkpoint(tmp_path / "x", preset="tiny", quantization="int4")


def test_cli_make_checkpoint_nvfp4(tmp_path):
    out = subprocess.run([sys.executable, "-m", "epserve.cli", "make-checkpoint", str(tmp_path / "c"), "--preset",
                          "tiny", "--quantization", "nvfp4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "nvfp4" in out.stdout
    assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"
    assert json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
    bad = subprocess.run([sys.executable, "-m", "epserve.cli", "make-checkpoint", str(tmp_path / "d"), "--fp8",
                          "--quantization", "nvfp4"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "contradict" in bad.stderr


# ---- refusals of an edited checkpoint ----------------------------------------------------------


def _edited(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    shard = dst / "model-00001-of-00001.safetensors"
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: shard.name for k in tensors}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_refuses_a_missing_scale(nvfp4_tiny, tmp_path):
    m = "model.layers.1.mlp.experts.2.down_proj"
    for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
        ckpt = _edited(nvfp4_tiny, tmp_path / suffix, lambda t, s=suffix: t.pop(f"{m}.{s}"))
        with CheckpointReader(ckpt) as reader, pytest.raises(CheckpointError, match=rf"{m}\.{suffix}\b"):
            check_nvfp4_module(m, _module_tensors(reader, m))


def test_refuses_a_shape_mismatch(nvfp4_tiny, tmp_path):
    m = "model.layers.0.mlp.up_proj"

    def halve_scales(t):
        t[f"{m}.weight_scale"] = t[f"{m}.weight_scale"][:, ::2].contiguous()

    def vector_scale(t):
        t[f"{m}.weight_scale_2"] = t[f"{m}.weight_scale_2"].repeat(2)

    def bf16_weight(t):
        t[f"{m}.weight"] = t[f"{m}.weight"].to(torch.bfloat16)

    for edit, tensor in ((halve_scales, "weight_scale"), (vector_scale, "weight_scale_2"), (bf16_weight, "weight")):
        ckpt = _edited(nvfp4_tiny, tmp_path / tensor, edit)
        with CheckpointReader(ckpt) as reader, pytest.raises(CheckpointError, match=rf"{m}\.{tensor}\b"):
            check_nvfp4_module(m, _module_tensors(reader, m))
    with CheckpointReader(nvfp4_tiny) as reader:
        t = _module_tensors(reader, m)
        n, k = t["weight"].shape[0], 2 * t["weight"].shape[1]
        check_nvfp4_module(m, t, in_features=k, out_features=n)
        check_nvfp4_module(m, {s: (x.dtype, x.shape) for s, x in t.items()})  # headers alone will do
        with pytest.raises(CheckpointError, match=rf"{m}\.weight\b"):
            check_nvfp4_module(m, t, in_features=k + 32, out_features=n)


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("file, edit, field", [
    ("hf_quant_config.json", lambda d: d["quantization"].update(group_size=32), "group_size"),
    ("hf_quant_config.json", lambda d: d["quantization"].update(quant_algo="W4A16_AWQ"), "quant_algo"),
    ("config.json", lambda d: d["quantization_config"].update(quant_algo="FP8"), "quant_algo"),
    ("config.json", lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=32),
     "group_size"),
    ("config.json", lambda d: d["quantization_config"].update(ignore=["lm_head"]), "exclude_modules"),
    ("config.json", lambda d: d["quantization_config"].update(quant_method="fp8"), "quant_method"),
    ("hf_quant_config.json", lambda d: d["quantization"].update(exclude_modules="lm_head"), "exclude_modules"),
    ("hf_quant_config.json", lambda d: d.pop("quantization"), "quantization"),
])
def test_refuses_a_config_the_format_cannot_describe(nvfp4_tiny, tmp_path, file, edit, field):
    ckpt = tmp_path / "c"
    shutil.copytree(nvfp4_tiny, ckpt)
    _edit_json(ckpt / file, edit)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(ckpt)


def test_config_json_alone_or_hf_quant_config_alone(nvfp4_tiny, tmp_path):
    only_file = tmp_path / "only_file"
    shutil.copytree(nvfp4_tiny, only_file)
    _edit_json(only_file / "config.json", lambda d: d.pop("quantization_config"))
    only_config = tmp_path / "only_config"
    shutil.copytree(nvfp4_tiny, only_config)
    (only_config / "hf_quant_config.json").unlink()
    full = ModelConfig.from_hf(nvfp4_tiny)
    assert ModelConfig.from_hf(only_file) == full == ModelConfig.from_hf(only_config)
    _edit_json(only_file / "hf_quant_config.json", lambda d: d["quantization"].pop("group_size"))
    assert ModelConfig.from_hf(only_file).nvfp4_group_size == 16  # ModelOpt's default
