"""The planner on NVFP4 checkpoints (ModelOpt's layout): the weights per GPU equal the engine's plan byte for
byte, ``epserve plan`` on a checkpoint directory prices its MLPs and experts in FP4 and its attention in its
stored dtype without being told, the bytes it plans for each group equal the safetensors tensors' bytes (our
writer's checkpoint and ModelOpt's own export), and a bf16 checkpoint of the same preset prices its MLPs and
experts ~3.5x higher."""

from __future__ import annotations

import io
import json
import struct
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from epserve.config import ModelConfig
from epserve.model.load_plan import plan_weight_bytes
from epserve.parallel.context import ParallelContext
from epserve.parallel.stages import Op
from epserve.planner import Deployment, PlanError, estimate_memory, load_hardware
from epserve.planner.cli import main as plan_main
from epserve.planner.memory import weight_counts
from epserve.planner.models import DEEPSEEK_V3
from epserve.planner.ops import BatchShape, price_ops
from epserve.planner.stored import read_stored
from epserve.presets import build_config, make_checkpoint

MODELOPT = Path(__file__).resolve().parents[1] / "model" / "modelopt_nvfp4_tiny"
# What ModelOpt leaves out of a DeepSeek-V3 export (its exclude_modules for the published R1 FP4 checkpoint).
R1_FP4 = {"quantization": {"quant_algo": "NVFP4", "group_size": 16,
                           "exclude_modules": ["lm_head", "model.embed_tokens", "model.layers.*.self_attn*",
                                               "model.layers.*.mlp.gate"]}}


def _nvfp4(raw: dict) -> ModelConfig:
    return ModelConfig.from_dict({k: v for k, v in raw.items() if k != "quantization_config"}, R1_FP4)


def _plan_json(*args: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        plan_main(["plan", "--gpu", "h200", "--ep", "1", "--batch", "1", "--mtp-draft", "0", "--json", *args])
    return json.loads(out.getvalue())


def _tensor_bytes(path: Path) -> int:
    """The data bytes of every safetensors file (file size less the 8-byte length and the header)."""
    total = 0
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - length
    return total


@pytest.mark.parametrize(("raw", "ep", "tp", "redundant"), [
    (build_config("tiny"), 1, 1, 0), (build_config("tiny"), 4, 2, 0), (build_config("tiny"), 4, 4, 4),
    (DEEPSEEK_V3, 32, 2, 32),
])
def test_nvfp4_weights_match_the_engine_plan(raw: dict, ep: int, tp: int, redundant: int) -> None:
    """Packed e2m1 bytes, e4m3 block scales, per-part fp32 global and input scales; attention, embedding and head
    in bf16 and MLA's absorbed weights in fp32 beside them, as the engine holds an NVFP4 checkpoint (every rank
    of the tiny model; V3's first, a DP group's leader: each of its meta builds takes seconds)."""
    model = _nvfp4(raw)
    d = Deployment(ep=ep, tp=tp, num_redundant_experts=redundant, weight_dtype="fp4", attention_dtype="bf16")
    ranks = range(ep) if raw is not DEEPSEEK_V3 else range(1)
    held = [plan_weight_bytes(model, ParallelContext(dp=d.dp, tp=tp, rank=r, device=torch.device("cpu")), fp8=False,
                              num_redundant_experts=redundant) for r in ranks]
    assert estimate_memory(model, load_hardware("h200"), d).weights_bytes == held[0] == max(held)


def test_plan_prices_an_nvfp4_checkpoint_from_its_tensors(tmp_path: Path) -> None:
    nvfp4 = make_checkpoint(tmp_path / "nvfp4", "tiny", quantization="nvfp4")
    bf16 = make_checkpoint(tmp_path / "bf16", "tiny")
    for path in (nvfp4, MODELOPT):
        plan = _plan_json("--model", str(path))
        c = plan["checkpoint"]
        assert (plan["weight_dtype"], plan["attention_dtype"]) == ("fp4", "bf16"), "not told, read from the files"
        assert (c["ffn_dtype"], c["attention_dtype"]) == ("fp4", "bf16")
        assert c["planned_ffn_bytes"] == c["group_bytes"]["ffn"] > 0
        assert c["planned_linear_bytes"] == c["group_bytes"]["linear"] > 0
        assert c["bytes"] == _tensor_bytes(path)  # every tensor counted in one group
    # the same preset in bf16 (priced so): its MLPs and experts ~2 / (0.5 + 1/16) = 3.56x the NVFP4 bytes
    stored = read_stored(nvfp4, ModelConfig.from_hf(nvfp4))
    whole = weight_counts(ModelConfig.from_hf(bf16), Deployment(ep=1, weight_dtype="bf16"))
    assert 3.4 < whole.ffn_bytes("bf16") / stored.group_bytes["ffn"] < 2 / 0.5625
    plain = _plan_json("--model", str(bf16), "--weight-dtype", "bf16")
    assert "checkpoint" not in plain
    quantized = _plan_json("--model", str(nvfp4))
    saved = plain["memory_per_gpu_bytes"]["weights"] - quantized["memory_per_gpu_bytes"]["weights"]
    assert saved == whole.ffn_bytes("bf16") - stored.group_bytes["ffn"]


def _header_file(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file of zeros with these (dtype, shape) tensors."""
    size = {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype] * (shape[0] * shape[1] if shape else 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_stored_formats_read_from_headers(tmp_path: Path) -> None:
    """FP8 attention beside NVFP4 experts is read as such; a dense MLP left in bf16 beside NVFP4 experts is
    refused (one dtype per group), naming both modules."""
    model = _nvfp4(build_config("tiny"))
    fp4 = {f"model.layers.1.mlp.experts.0.down_proj.{k}": v for k, v in
           {"weight": ("U8", [64, 16]), "weight_scale": ("F8_E4M3", [64, 2]), "weight_scale_2": ("F32", []),
            "input_scale": ("F32", [])}.items()}
    attention = {"model.layers.0.self_attn.o_proj.weight": ("F8_E4M3", [64, 128]),
                 "model.layers.0.self_attn.o_proj.weight_scale_inv": ("F32", [1, 1])}
    _header_file(tmp_path / "model.safetensors", {**fp4, **attention})
    stored = read_stored(tmp_path, model)
    assert (stored.ffn_dtype, stored.attention_dtype) == ("fp4", "fp8")
    assert stored.group_bytes == {"ffn": 64 * 16 + 64 * 2 + 8, "linear": 64 * 128 + 4, "mtp": 0, "other": 0}
    _header_file(tmp_path / "model.safetensors", {**fp4, "model.layers.0.mlp.up_proj.weight": ("BF16", [32, 64])})
    with pytest.raises(PlanError, match=r"model.layers.0.mlp.up_proj bf16.*experts.0.down_proj fp4"):
        read_stored(tmp_path, model)


def test_attention_and_experts_are_priced_in_their_own_dtypes() -> None:
    """An FP4 deployment with bf16 attention streams four-bit experts and two-byte attention projections."""
    model = _nvfp4(DEEPSEEK_V3)
    hw = load_hardware("h100")
    shape = BatchShape(requests=1, query_len=1, kv_len=1000)
    ops = [Op("o_proj", "gemm"), Op("experts", "group_gemm")]

    def priced(**kw: str) -> dict:
        return price_ops(model, hw, Deployment(ep=8, **kw), shape, ops)

    both_fp4, mixed, bf16 = priced(weight_dtype="fp4"), priced(weight_dtype="fp4", attention_dtype="bf16"), \
        priced(weight_dtype="bf16")
    assert mixed["experts"].bytes == both_fp4["experts"].bytes < 0.3 * bf16["experts"].bytes
    assert mixed["o_proj"].bytes == bf16["o_proj"].bytes > 3 * both_fp4["o_proj"].bytes


def test_fp4_gemms_are_priced_by_the_four_bit_kernels_curves() -> None:
    """A hardware file with the four-bit kernels' measured curves (``calibrate_fp4``) prices FP4 GEMMs with them;
    without (a datasheet entry) or for bf16 weights, nothing changes."""
    from dataclasses import replace

    model = _nvfp4(DEEPSEEK_V3)
    hw = load_hardware("h100")
    shape = BatchShape(requests=4, query_len=1, kv_len=1000)
    ops = [Op("experts", "group_gemm"), Op("o_proj", "gemm")]
    slow = replace(hw, memory_by_rows={"group_gemm_fp4": ((1.0, 1e6, 0.05),), "gemm_fp4": ((1.0, 1e6, 0.05),)})
    fp4, bf16 = Deployment(ep=8, weight_dtype="fp4", attention_dtype="bf16"), Deployment(ep=8, weight_dtype="bf16")
    assert hw.kernel_class("group_gemm", "fp4") == "group_gemm" and slow.kernel_class("gemm", "fp4") == "gemm_fp4"
    base, curved = price_ops(model, hw, fp4, shape, ops), price_ops(model, slow, fp4, shape, ops)
    assert curved["experts"].compute_us > 3 * base["experts"].compute_us  # the four-bit experts' own curve
    assert curved["o_proj"].compute_us == base["o_proj"].compute_us  # bf16 attention: the bf16 kernels'
    assert price_ops(model, slow, bf16, shape, ops) == price_ops(model, hw, bf16, shape, ops)
