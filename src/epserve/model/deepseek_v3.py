"""DeepSeek-V3 (and V2) decoder: embed -> [MLA + dense MLP | MoE] x L -> norm -> lm_head.

The model holds no distributed code: the dispatcher and the expert placement are handed in at build
time, so the same module runs for every parallel layout and dispatch backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig
from epserve.kernels import linear
from epserve.model.batch import ForwardBatch
from epserve.model.layers import GatedMLP, RMSNorm, RopeTable, RotaryEmbedding
from epserve.model.mla import MLAttention
from epserve.model.moe import MoE
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.placement import ExpertPlacement


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """x: [T, H] -> [T, H]"""
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, dispatcher: Dispatcher, placement: ExpertPlacement, ep_rank: int = 0
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config)
        layers = []
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                mlp: nn.Module = MoE(config, dispatcher, placement, ep_rank)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size)
            layers.append(DecoderLayer(config, i, mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Run every layer over the flat batch, writing its latent KV; returns final hidden [T, H]."""
        x = F.embedding(batch.input_ids, self.embed_tokens)
        rope = self.rotary.lookup(batch.positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, batch, kv_cache, rope)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in fp32."""
        return linear(hidden, self.lm_head).float()
