"""Writing an NVFP4 checkpoint in ModelOpt's unified Hugging Face layout from a bf16 (or fp32) one.

The MLP projections (``gate_proj``, ``up_proj``, ``down_proj`` of dense MLPs, routed experts and shared
experts, the MTP layer's included) become ``weight`` / ``weight_scale`` / ``weight_scale_2`` /
``input_scale`` (``checkpoint/nvfp4.py``); every other tensor is written as given. As ModelOpt exports
it, an MLP's ``gate_proj`` and ``up_proj`` (which read the same input and run as one fused GEMM) share
one ``weight_scale_2``, from the larger of their two amaxes, and one ``input_scale``.

``input_scale`` is ``activation amax / (6 * 448)``; ModelOpt takes the amax from a calibration run. A
random-weight checkpoint has no calibration data, so the writer uses one stand-in amax for every module
(``STAND_IN_INPUT_AMAX``: 16, above the largest MLP input a random batch gives the tiny and small presets in
fp32, about 5 into ``gate_proj``/``up_proj`` and 7 to 13 into ``down_proj``). Only four-bit activations read
it; four-bit weights with bf16 activations (W4A16) never do.

The module lists follow ModelOpt's export: ``exclude_modules`` names every unquantized linear and
embedding by the shortest dot-boundary prefix wildcard that matches no quantized module (``X*``),
else ``X.*``, else the exact name (``lm_head``, ``model.embed_tokens``, ``model.layers.3.self_attn*``,
``model.layers.3.mlp.gate``); ``hf_quant_config.json`` holds it under ``quantization`` and
``config.json``'s ``quantization_config`` restates it in the compressed-tensors style (``ignore``,
``config_groups``, ``quant_method: "modelopt"``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from epserve.checkpoint.nvfp4 import NVFP4_GROUP, nvfp4_global_scale, nvfp4_quantize

PRODUCER = {"name": "epserve", "version": "1"}
STAND_IN_INPUT_AMAX = 16.0

# The modules NVFP4 quantizes: every MLP projection (dense, routed expert, shared expert).
_QUANTIZED = re.compile(r"\.mlp\.(?:experts\.\d+\.|shared_experts\.)?(?:gate|up|down)_proj$")


def is_nvfp4_target(module: str) -> bool:
    """Whether the writer quantizes ``module`` (``model.layers.3.mlp.experts.7.up_proj``: yes)."""
    return _QUANTIZED.search(module) is not None


def summarize_exclusions(unquantized: Iterable[str], quantized: Iterable[str]) -> list[str]:
    """``exclude_modules`` as ModelOpt writes it: for each unquantized module, the first of ``p*``,
    ``p.*`` (for each dot-boundary prefix ``p``, shortest first) and finally its own name that matches
    no quantized module; sorted, without duplicates."""
    quantized = list(quantized)
    quantized_set = set(quantized)
    out: set[str] = set()
    for name in unquantized:
        pattern = name
        for i, ch in enumerate(name):
            if ch != ".":
                continue
            prefix = name[:i]
            if not any(q.startswith(prefix) for q in quantized):
                pattern = prefix + "*"
                break
            if prefix not in quantized_set and not any(q.startswith(prefix + ".") for q in quantized):
                pattern = prefix + ".*"
                break
        out.add(pattern)
    return sorted(out)


def nvfp4_hf_quant_config(exclude_modules: Iterable[str], group_size: int = NVFP4_GROUP) -> dict[str, Any]:
    """The contents of ``hf_quant_config.json``."""
    return {
        "producer": dict(PRODUCER),
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": group_size,
            "exclude_modules": list(exclude_modules),
        },
    }


def nvfp4_quantization_config(hf_quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json``'s ``quantization_config`` for ``hf_quant_config`` (the compressed-tensors style)."""
    q = hf_quant_config["quantization"]
    four_bits = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": q["group_size"]}
    return {
        "config_groups": {
            "group_0": {"input_activations": dict(four_bits), "weights": dict(four_bits), "targets": ["Linear"]}
        },
        "ignore": list(q["exclude_modules"]),
        "quant_algo": q["quant_algo"],
        "producer": dict(hf_quant_config["producer"]),
        "quant_method": "modelopt",
    }


def _module_of(name: str) -> str | None:
    return name.removesuffix(".weight") if name.endswith(".weight") else None


def quantize_tensors(
    tensors: Mapping[str, torch.Tensor], input_amax: float = STAND_IN_INPUT_AMAX
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A checkpoint's tensors (bf16/fp32, file order) -> (the NVFP4 checkpoint's tensors, ``exclude_modules``).

    Each quantized module's ``weight`` is replaced, in place in the order, by its four tensors; the
    other tensors are kept as they are."""
    modules = [m for m in map(_module_of, tensors) if m is not None and tensors[m + ".weight"].dim() == 2]
    quantized = [m for m in modules if is_nvfp4_target(m)]
    input_scale = nvfp4_global_scale(input_amax)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = _module_of(name)
        if module is None or not is_nvfp4_target(module):
            out[name] = t
            continue
        if t.dim() != 2 or not t.is_floating_point() or t.element_size() < 2:
            raise ValueError(f"NVFP4 quantizes bf16/fp32 [out, in] weights; {name} is {t.dtype} {list(t.shape)}")
        amax = t.detach().float().abs().amax()
        pair = re.sub(r"(gate|up)_proj$", lambda m: "up_proj" if m[1] == "gate" else "gate_proj", module)
        if pair != module:  # gate and up share one global scale, from the larger amax
            amax = torch.maximum(amax, tensors[pair + ".weight"].detach().float().abs().amax())
        q = nvfp4_quantize(t, weight_scale_2=nvfp4_global_scale(amax))
        out[module + ".weight"], out[module + ".weight_scale"] = q.weight, q.weight_scale
        out[module + ".weight_scale_2"], out[module + ".input_scale"] = q.weight_scale_2, input_scale.clone()
    exclude = summarize_exclusions([m for m in modules if not is_nvfp4_target(m)], quantized)
    return out, exclude



def nvfp4_checkpoint(
    config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], input_amax: float = STAND_IN_INPUT_AMAX
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """A bf16/fp32 checkpoint's ``config.json`` dict and tensors -> the NVFP4 checkpoint's ``config.json``
    dict (with ``quantization_config``), tensors and ``hf_quant_config.json`` dict."""
    if config.get("quantization_config"):
        raise ValueError("NVFP4 quantizes a bf16/fp32 checkpoint; this one already has a quantization_config")
    quantized, exclude = quantize_tensors(tensors, input_amax)
    hf_quant = nvfp4_hf_quant_config(exclude)
    return {**config, "quantization_config": nvfp4_quantization_config(hf_quant)}, quantized, hf_quant
