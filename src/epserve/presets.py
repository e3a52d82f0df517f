"""Random-weight DeepSeek-V3 checkpoints in exactly the published Hugging Face format.

``make_checkpoint(dir, preset)`` writes ``config.json``, safetensors shards with the published tensor
names (FP8 block-quantized like the release when ``fp8=True``; NVFP4 MLPs as NVIDIA's ModelOpt exports them
when ``quantization="nvfp4"``), and tokenizer files. Weights are
random but shaped so the model is not degenerate: activations stay O(1), logits have a std of a
few units with clearly separated top-1, and routing spreads over the experts.

``default_model_path()`` is the built-in ``tiny`` model, generated once into a cache directory.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epserve.checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    SCALE_SUFFIX,
    as_torch_dtype,
    fp8_block_quantize,
    iter_with_progress,
    save_checkpoint,
)
from epserve.checkpoint.nvfp4_export import nvfp4_checkpoint
from epserve.config import ModelConfig
from epserve.env import builtin_model_dir
from epserve.tokenizer import write_tokenizer_files

FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

# Fields shared by every preset, as in DeepSeek-V3's config.json.
_COMMON: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "moe_layer_freq": 1,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "use_cache": True,
}


def _yarn(factor: float, original: int) -> dict[str, Any]:
    return {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": factor,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": original,
        "type": "yarn",
    }


_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 2048,
    "rope_scaling": _yarn(4, 512),
}

PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: runs in milliseconds.
    "tiny": _TINY,
    # FP8 runtime tests: tiny, with every dimension the FP8 runtime fuses or splits a multiple of 128.
    "tiny128": {
        **_TINY,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 128,
        "q_lora_rank": 128,
    },
    # Benchmarks: ~400M parameters in the main model.
    "small": {
        "vocab_size": 8192,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "moe_intermediate_size": 256,
        "num_hidden_layers": 8,
        "first_k_dense_replace": 1,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,
        "n_group": 8,
        "topk_group": 4,
        "q_lora_rank": 384,
        "kv_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_scaling": _yarn(4, 1024),
    },
}

# Initialisation gains (see _init_tensor): chosen so that every block moves the residual stream by
# about as much as the embedding, the routing scores spread, and logits have std ~ LOGIT_STD.
RESIDUAL_GAIN = 0.7
NORM_JITTER = 0.1
GATE_GAIN = 2.0
BIAS_STD = 0.05
LOGIT_STD = 4.0


@dataclass(frozen=True)
class TensorSpec:
    """One published tensor: ``name``, logical ``shape`` (before FP8), and its ``kind``:
    ``embedding``, ``norm``, ``linear`` (input side), ``out_linear`` (writes the residual stream),
    ``gate`` (``mlp.gate.weight``), ``bias`` (``e_score_correction_bias``) or ``head``."""

    name: str
    shape: tuple[int, ...]
    kind: str

    @property
    def is_quantizable(self) -> bool:
        """DeepSeek-V3 stores exactly these in FP8: attention, MLP, expert and eh_proj linears."""
        return self.kind in ("linear", "out_linear")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def build_config(
    preset: str = "tiny",
    fp8: bool = False,
    overrides: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """The ``config.json`` dict of a preset, with FP8 quantization config and ``overrides`` merged."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; available: {', '.join(PRESETS)}")
    if str(as_torch_dtype(dtype)).removeprefix("torch.") not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', got {dtype!r}")
    cfg = {**copy.deepcopy(_COMMON), **copy.deepcopy(PRESETS[preset])}
    cfg["torch_dtype"] = str(as_torch_dtype(dtype)).removeprefix("torch.")
    if fp8:
        cfg["quantization_config"] = copy.deepcopy(FP8_QUANTIZATION_CONFIG)
    cfg.update(copy.deepcopy(overrides or {}))
    return dict(sorted(cfg.items()))


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint in file order, main layers first, then the MTP layers."""
    h = cfg.hidden_size
    specs = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, h), "embedding")]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, f"model.layers.{i}", cfg.is_moe_layer(i))
    specs.append(TensorSpec("model.norm.weight", (h,), "norm"))
    specs.append(TensorSpec("lm_head.weight", (cfg.vocab_size, h), "head"))
    for j in range(cfg.num_nextn_predict_layers):
        p = f"model.layers.{cfg.num_hidden_layers + j}"
        specs += [
            TensorSpec(f"{p}.embed_tokens.weight", (cfg.vocab_size, h), "embedding"),
            TensorSpec(f"{p}.enorm.weight", (h,), "norm"),
            TensorSpec(f"{p}.hnorm.weight", (h,), "norm"),
            TensorSpec(f"{p}.eh_proj.weight", (h, 2 * h), "linear"),
        ]
        specs += _layer_specs(cfg, p, cfg.n_routed_experts > 0)
        specs += [
            TensorSpec(f"{p}.shared_head.norm.weight", (h,), "norm"),
            TensorSpec(f"{p}.shared_head.head.weight", (cfg.vocab_size, h), "head"),
        ]
    return specs


def _layer_specs(cfg: ModelConfig, p: str, is_moe: bool) -> list[TensorSpec]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    a = f"{p}.self_attn"
    specs = [TensorSpec(f"{p}.input_layernorm.weight", (h,), "norm")]
    if cfg.q_lora_rank is None:
        specs.append(TensorSpec(f"{a}.q_proj.weight", (heads * cfg.qk_head_dim, h), "linear"))
    else:
        specs += [
            TensorSpec(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h), "linear"),
            TensorSpec(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,), "norm"),
            TensorSpec(f"{a}.q_b_proj.weight", (heads * cfg.qk_head_dim, cfg.q_lora_rank), "linear"),
        ]
    kv_b_rows = heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    specs += [
        TensorSpec(f"{a}.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), "linear"),
        TensorSpec(f"{a}.kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm"),
        TensorSpec(f"{a}.kv_b_proj.weight", (kv_b_rows, cfg.kv_lora_rank), "linear"),
        TensorSpec(f"{a}.o_proj.weight", (h, heads * cfg.v_head_dim), "out_linear"),
        TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), "norm"),
    ]
    if not is_moe:
        return specs + _mlp_specs(f"{p}.mlp", h, cfg.intermediate_size)
    specs += [
        TensorSpec(f"{p}.mlp.gate.weight", (cfg.n_routed_experts, h), "gate"),
        TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (cfg.n_routed_experts,), "bias"),
    ]
    for e in range(cfg.n_routed_experts):
        specs += _mlp_specs(f"{p}.mlp.experts.{e}", h, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        specs += _mlp_specs(f"{p}.mlp.shared_experts", h, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return specs


def _mlp_specs(p: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{p}.gate_proj.weight", (inter, hidden), "linear"),
        TensorSpec(f"{p}.up_proj.weight", (inter, hidden), "linear"),
        TensorSpec(f"{p}.down_proj.weight", (hidden, inter), "out_linear"),
    ]


def count_parameters(cfg: ModelConfig, include_mtp: bool = False) -> int:
    """Parameters of the main model (and of the MTP layers if ``include_mtp``), FP8 scales excluded."""
    mtp_prefixes = tuple(
        f"model.layers.{cfg.num_hidden_layers + j}." for j in range(cfg.num_nextn_predict_layers)
    )
    return sum(s.numel for s in tensor_specs(cfg) if include_mtp or not s.name.startswith(mtp_prefixes))


def _init_tensor(spec: TensorSpec, seed: int) -> torch.Tensor:
    """A float32 random tensor for ``spec``, from a generator seeded by (``seed``, name) alone."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(spec.name.encode())) % 2**63)
    x = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    fan_in = spec.shape[-1]
    if spec.kind == "embedding":
        return x
    if spec.kind == "norm":
        return 1.0 + NORM_JITTER * x
    if spec.kind == "bias":
        return BIAS_STD * x
    gain = {"linear": 1.0, "out_linear": RESIDUAL_GAIN, "gate": GATE_GAIN, "head": LOGIT_STD}[spec.kind]
    return x * (gain / math.sqrt(fan_in))


def random_weights(
    config: dict[str, Any], seed: int = 0, dtype: str = "bfloat16", logit_margin: float = 0.0,
    hot_experts: dict[int, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for ``config`` (a ``config.json`` dict), in file order.

    ``logit_margin`` > 0 adds to every LM head row ``logit_margin`` times the unit-norm embedding of a
    fixed permutation of the vocabulary: the current token's embedding, strong in the final hidden
    state, then lifts one next token clear of the rest (clear logit margins, for comparing numerics
    that differ slightly, such as FP8 against bf16, by their greedy tokens).

    ``hot_experts`` ({expert: bias}) adds ``bias`` to those experts' correction bias in every MoE layer:
    the gate then picks them far more often (a skewed load, for expert load balancing).

    FP8 (when ``config`` has a ``quantization_config``): quantizable linears become float8_e4m3fn
    plus a float32 ``weight_scale_inv``. The correction bias is always float32; everything else is
    ``dtype``. The MTP layers' ``embed_tokens`` / ``shared_head.head`` copy the main model's, as the
    MTP module shares them.
    """
    cfg = ModelConfig.from_dict(config)
    torch_dtype = as_torch_dtype(dtype)
    specs = tensor_specs(cfg)
    shared = {"embedding": "model.embed_tokens.weight", "head": "lm_head.weight"}
    out: dict[str, torch.Tensor] = {}
    for spec in iter_with_progress(specs, "initialising weights"):
        if spec.kind in shared and spec.name != shared[spec.kind]:
            out[spec.name] = out[shared[spec.kind]].clone()
            continue
        w = _init_tensor(spec, seed)
        if spec.name == "lm_head.weight" and logit_margin:
            emb = out["model.embed_tokens.weight"].float()
            perm = torch.randperm(len(emb), generator=torch.Generator().manual_seed(seed))
            w = w + logit_margin * emb[perm] / emb[perm].norm(dim=1, keepdim=True)
        if spec.kind == "bias":
            for e, b in (hot_experts or {}).items():
                w[e] += b
            out[spec.name] = w
        elif cfg.fp8_block_size is not None and spec.is_quantizable:
            out[spec.name], out[spec.name + SCALE_SUFFIX] = fp8_block_quantize(w, cfg.fp8_block_size)
        else:
            out[spec.name] = w.to(torch_dtype)
    return out


def make_checkpoint(
    path: str | Path,
    preset: str = "tiny",
    fp8: bool = False,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    logit_margin: float = 0.0,
    hot_experts: dict[int, float] | None = None,
    quantization: str | None = None,
) -> Path:
    """Write a random-weight DeepSeek-V3 checkpoint plus tokenizer files into ``path``
    (``logit_margin``, ``hot_experts``: see :func:`random_weights`). ``quantization="nvfp4"`` quantizes the
    ``dtype`` weights' MLPs to NVFP4 (``checkpoint/nvfp4_export.py``, a stand-in ``input_scale``);
    ``"fp8"`` is ``fp8=True``.

    Deterministic: the same arguments give byte-identical tensors and tokenizer files.
    """
    if quantization not in (None, "fp8", "nvfp4") or (fp8 and quantization == "nvfp4"):
        raise ValueError(f"quantization must be None, 'fp8' or 'nvfp4' (not with fp8=True), got {quantization!r}")
    config = build_config(preset, fp8=fp8 or quantization == "fp8", overrides=overrides, dtype=dtype)
    tensors = random_weights(config, seed=seed, dtype=dtype, logit_margin=logit_margin, hot_experts=hot_experts)
    hf_quant = None
    if quantization == "nvfp4":
        config, tensors, hf_quant = nvfp4_checkpoint(config, tensors)
    path = save_checkpoint(path, config, tensors, max_shard_bytes=max_shard_bytes, hf_quant_config=hf_quant)
    write_tokenizer_files(
        path, vocab_size=config["vocab_size"], model_max_length=config["max_position_embeddings"]
    )
    return path


def default_model_path() -> Path:
    """The built-in ``tiny`` model (bfloat16), generated on first use into ``cache_dir()/tiny-v1``.

    Safe under concurrency: each process builds into its own temporary directory and renames it into
    place; a process that loses the race discards its copy and uses the winner's.
    """
    target = builtin_model_dir()
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        make_checkpoint(tmp, preset="tiny", seed=0, dtype="bfloat16")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
