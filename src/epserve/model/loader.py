"""Build the model and fill it from a Hugging Face checkpoint (FP8 weights arrive dequantized).

Our parameter layout differs from the checkpoint's in three places, all resolved here: q_a_proj and
kv_a_proj_with_mqa are fused into one GEMM, gate/up projections are fused, and routed experts are
stacked per rank in the order of the expert placement (a rank reads only its own experts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from epserve.checkpoint import CheckpointReader, iter_with_progress
from epserve.config import ModelConfig
from epserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from epserve.model.mla import MLAttention
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.context import ParallelContext

logger = logging.getLogger(__name__)

Getter = Callable[[str], torch.Tensor]


def _sources(config: ModelConfig, name: str, local_experts: tuple[int, ...], get: Getter) -> torch.Tensor:
    """The checkpoint tensor(s) for one of our parameter names, combined into our layout."""
    if name == "embed_tokens":
        return get("model.embed_tokens.weight")
    if name == "lm_head":
        return get("model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight")
    if name == "norm.weight":
        return get("model.norm.weight")
    prefix, _, rest = name.partition(".")
    assert prefix == "layers", name
    idx, _, rest = rest.partition(".")
    p = f"model.layers.{idx}."
    if rest == "self_attn.fused_qkv_a_proj":
        return torch.cat([get(p + "self_attn.q_a_proj.weight"), get(p + "self_attn.kv_a_proj_with_mqa.weight")])
    if rest.startswith("mlp.router."):
        return get(p + "mlp.gate." + rest.removeprefix("mlp.router."))
    if rest in ("mlp.gate_up_proj", "mlp.shared_experts.gate_up_proj"):
        q = p + rest.removesuffix("gate_up_proj")
        return torch.cat([get(q + "gate_proj.weight"), get(q + "up_proj.weight")])
    if rest in ("mlp.down_proj", "mlp.shared_experts.down_proj"):
        return get(p + rest + ".weight")
    if rest == "mlp.experts.w13":
        return torch.stack(
            [
                torch.cat([get(f"{p}mlp.experts.{e}.gate_proj.weight"), get(f"{p}mlp.experts.{e}.up_proj.weight")])
                for e in local_experts
            ]
        )
    if rest == "mlp.experts.w2":
        return torch.stack([get(f"{p}mlp.experts.{e}.down_proj.weight") for e in local_experts])
    if rest.endswith(".weight"):  # norms
        return get(p + rest)
    return get(p + rest + ".weight")  # plain projections: q_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj


_HEAD_ROWS = ("self_attn.q_b_proj", "self_attn.q_proj", "self_attn.kv_b_proj")


def _shard_heads(config: ModelConfig, name: str, t: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """This TP rank's heads of a per-head projection: rows of q_b/q/kv_b_proj, columns of o_proj.
    Everything else (kv_a_proj, norms, embeddings, lm_head, dense MLPs, shared experts) is replicated."""
    if ctx.tp == 1:
        return t
    heads = config.num_attention_heads
    per_rank = heads // ctx.tp
    lo, hi = ctx.tp_rank * per_rank, (ctx.tp_rank + 1) * per_rank
    if name.endswith(_HEAD_ROWS):
        return t.view(heads, -1, t.shape[-1])[lo:hi].reshape(-1, t.shape[-1])
    if name.endswith("self_attn.o_proj"):
        return t.view(t.shape[0], heads, -1)[:, lo:hi].reshape(t.shape[0], -1)
    return t


def load_model(
    config: ModelConfig,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    dispatcher: Dispatcher,
    placement: ExpertPlacement,
    ctx: ParallelContext,
) -> DeepseekV3ForCausalLM:
    """Each rank reads its own routed experts (through ``placement``) and, with TP > 1, keeps its
    heads of the per-head attention projections; only leaders read ``lm_head``."""
    reader = CheckpointReader(path)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config, dispatcher, placement, ctx)
    if config.num_nextn_predict_layers and reader.has(f"model.layers.{config.num_hidden_layers}.eh_proj.weight"):
        logger.info("checkpoint has %d MTP layer(s); not used by this engine yet", config.num_nextn_predict_layers)
    local_experts = placement.local_logical_experts(ctx.rank)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name in iter_with_progress(list(params), desc="Loading weights", disable=ctx.rank != 0):
        target = params[name]
        if name == "lm_head" and not ctx.is_leader:  # only a DP group's leader computes logits
            target.data = torch.empty(0, config.hidden_size, device=device, dtype=dtype)
            continue
        keep_fp32 = ".router." in name
        src = _sources(config, name, local_experts, lambda n: reader.get(n, dtype=torch.float32))
        src = _shard_heads(config, name, src, ctx)
        if tuple(src.shape) != tuple(target.shape):
            raise ValueError(f"checkpoint tensor for {name} has shape {tuple(src.shape)}, expected {tuple(target.shape)}")
        with torch.no_grad():
            if isinstance(target, nn.Parameter):
                target.data = src.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
            else:
                target.copy_(src)
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.prepare()
    return model.eval()
