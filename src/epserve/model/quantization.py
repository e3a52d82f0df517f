"""Whether the weights run in FP8: ``quantization`` resolved for a checkpoint, a device and a layout.

``"fp8"`` keeps DeepSeek's FP8 block-scaled weights (or quantizes a bf16 checkpoint at load) and runs
block-scaled FP8 GEMMs; ``None`` dequantizes at load; ``"auto"`` keeps FP8 on CUDA and dequantizes on
the CPU (whose FP8 path is a correct but slow reference). The FP8 runtime fuses and shards weights
along whole 128x128 tiles, so the dimensions it fuses or splits must be multiples of 128.

An NVFP4 checkpoint (ModelOpt's, ``ModelConfig.is_nvfp4``) keeps its four-bit modules as stored under
``"auto"`` on every device (:func:`nvfp4_quantized` says which: those not in ``exclude_modules``); asking it
for ``"fp8"`` or ``None`` is refused (neither re-quantizing nor dequantizing it at load is built yet).
"""

from __future__ import annotations

import logging

from epserve.checkpoint.nvfp4 import is_excluded
from epserve.config import ConfigError, ModelConfig, Quantization
from epserve.kernels.fp8 import BLOCK

logger = logging.getLogger(__name__)


def fp8_runtime_problems(model: ModelConfig, tp: int = 1) -> list[str]:
    """What keeps this checkpoint from running with FP8 weights at tensor parallelism ``tp``; empty if nothing."""
    problems = []
    if model.fp8_block_size not in (None, (BLOCK, BLOCK)):
        problems.append(f"weight_block_size {list(model.fp8_block_size)} (the FP8 kernels take {BLOCK}x{BLOCK} tiles)")
    if model.fp8_scale_fmt is not None:
        problems.append(f"scale_fmt {model.fp8_scale_fmt!r} (only plain float32 block scales are supported)")
    fused = {"q_lora_rank (q_a_proj fused with kv_a_proj_with_mqa)": model.q_lora_rank or 0}
    has_dense = model.n_routed_experts == 0 or model.first_k_dense_replace > 0 or model.moe_layer_freq > 1
    if has_dense:
        fused["intermediate_size (gate_proj fused with up_proj)"] = model.intermediate_size
    if model.n_routed_experts:
        fused["moe_intermediate_size (expert gate_proj fused with up_proj)"] = model.moe_intermediate_size
    heads = model.num_attention_heads // tp
    if tp > 1:
        fused[f"the {heads} heads' q rows per TP rank"] = heads * model.qk_head_dim
        fused[f"the {heads} heads' kv_b_proj rows per TP rank"] = heads * (model.qk_nope_head_dim + model.v_head_dim)
        fused[f"the {heads} heads' o_proj columns per TP rank"] = heads * model.v_head_dim
    problems += [f"{what} = {n} is not a multiple of {BLOCK}" for what, n in fused.items() if n % BLOCK]
    return problems


def resolve_fp8_weights(quantization: Quantization, model: ModelConfig, tp: int, device_type: str) -> bool:
    """Whether to keep (or make) FP8 weights; ConfigError when ``"fp8"`` is asked of a checkpoint it cannot run,
    and when an NVFP4 checkpoint is asked for anything but ``"auto"``."""
    if model.is_nvfp4:
        if quantization != "auto":
            raise ConfigError(f"quantization={quantization!r} cannot run an NVFP4 checkpoint: its quantized modules "
                              "are kept as four-bit weights (use quantization='auto', --quantization auto)")
        return False
    if quantization is None:
        return False
    problems = fp8_runtime_problems(model, tp)
    if quantization == "fp8":
        if problems:
            raise ConfigError(
                "quantization='fp8' cannot run this checkpoint: " + "; ".join(problems)
                + ". Use quantization=None (--quantization none) to dequantize the weights at load."
            )
        return True
    if device_type != "cuda" or not model.is_fp8:
        return False
    if problems:
        logger.warning("FP8 checkpoint dequantized at load: %s", "; ".join(problems))
        return False
    return True


def nvfp4_quantized(model: ModelConfig, module: str) -> bool:
    """Whether the checkpoint stores the linear ``module`` (its checkpoint name, ``model.layers.3.mlp.gate_proj``)
    in NVFP4: an NVFP4 checkpoint's module that ``exclude_modules`` does not name."""
    return model.is_nvfp4 and not is_excluded(module, model.nvfp4_exclude)
