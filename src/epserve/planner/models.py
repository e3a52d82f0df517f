"""Model configurations the planner can price: built-ins and Hugging Face ``config.json`` files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epserve.config import ConfigError, ModelConfig
from epserve.planner.errors import PlanError

# Published DeepSeek-V3 config.json values (the fields ModelConfig reads).
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
}
BUILTIN_MODELS: dict[str, dict[str, Any]] = {"deepseek-v3": DEEPSEEK_V3}


def resolve_model(spec: str | Path) -> tuple[str, ModelConfig]:
    """A planner model spec -> (display name, its ``ModelConfig``): a built-in (``deepseek-v3``), a
    checkpoint directory or a ``config.json`` path. Reads the configuration only; building and loading
    the network is ``model.loader.load_model``."""
    key = str(spec)
    try:
        if key.lower() in BUILTIN_MODELS:
            return key.lower(), ModelConfig.from_dict(BUILTIN_MODELS[key.lower()])
        path = Path(key)
        if not path.exists():
            raise PlanError(
                f"model {key!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor an existing path"
            )
        name = path.name if path.is_dir() else path.parent.name if path.name == "config.json" else path.stem
        return name, ModelConfig.from_hf(path)
    except ConfigError as e:
        raise PlanError(str(e)) from None
