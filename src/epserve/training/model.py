"""The training network: DeepSeek-V3 (MLA, sigmoid-routed MoE with a shared expert, one MTP module)
in plain torch, with the same semantics as transformers' ``DeepseekV3ForCausalLM`` and the engine.

Differences from the serving model are in form only: tokens are ``[batch, seq]`` with causal
attention over each row (no paged cache), the routed experts of a layer are stacked parameters
(``w_gate_up`` [E, 2I, H], ``w_down`` [E, H, I]; ``named_checkpoint_tensors`` splits them into the
published per-expert names), and the MTP module's ``embed_tokens`` / ``shared_head.head`` *are* the
main model's ``embed_tokens`` / ``lm_head`` (one parameter each).

MTP semantics (depth 1): ``h_i`` is the main model's final hidden state at position ``i`` after
``model.norm``; the MTP input at ``i`` is ``eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])``, then one
decoder layer (rotary position ``i``, causal), then ``shared_head.head(shared_head.norm(.))``
predicts ``t_{i+2}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig
from epserve.model.layers import RMSNorm  # the engine's: the same normalisation, trainable


def rotary_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_position_embeddings, rope_dim / 2] (plain RoPE; YaRN is not supported here)."""
    if cfg.rope_scaling is not None:
        raise ValueError("the training model supports rope_scaling=None only")
    dim = cfg.qk_rope_head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [B, heads, T, rope_dim], cos/sin [T, rope_dim/2] -> rotated, laid out ``[evens', odds']``
    when ``interleave`` (DeepSeek's pairs, exactly as transformers applies them)."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TrainMLA(nn.Module):
    """Multi-head latent attention, MHA form (keys and values expanded from the latent)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * cfg.v_head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        nope, rope, vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, -1, cfg.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(b, t, -1, nope + vdim).transpose(1, 2)
        k_nope, v = kv.split([nope, vdim], dim=-1)
        q_rot = apply_rotary(q_rot, cos, sin, cfg.rope_interleave)
        k_rot = apply_rotary(k_rot.view(b, 1, t, rope), cos, sin, cfg.rope_interleave)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class TrainMLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TrainMoE(nn.Module):
    """Sigmoid router with group-limited top-k on ``scores + e_score_correction_bias``, weights the
    chosen experts' un-biased scores (normalised, times ``routed_scaling_factor``), plus the shared
    expert. ``load`` holds the last forward's tokens per expert (for the bias update)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.scoring_func != "sigmoid" or cfg.topk_method != "noaux_tc":
            raise ValueError("the training model supports DeepSeek-V3 routing (sigmoid, noaux_tc) only")
        self.cfg = cfg
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(e, h))
        self.register_buffer("e_score_correction_bias", torch.zeros(e))
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w_down = nn.Parameter(torch.empty(e, h, i))
        self.shared_experts = TrainMLP(h, i * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.register_buffer("load", torch.zeros(e), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> weights [N, k] (fp32), expert ids [N, k]."""
        cfg = self.cfg
        e, groups = cfg.n_routed_experts, cfg.n_group
        scores = F.linear(x.float(), self.gate_weight.float()).sigmoid()
        choice = scores.detach() + self.e_score_correction_bias
        group_scores = choice.view(-1, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, groups, e // groups).reshape(-1, e)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=self.cfg.n_routed_experts)
        self.load = counts.detach().float()
        token = order // k
        routed = flat[token]
        outs = []
        for ex, chunk in enumerate(routed.split(counts.tolist())):
            if chunk.shape[0]:
                gate, up = F.linear(chunk, self.w_gate_up[ex]).chunk(2, dim=-1)
                outs.append(F.linear(F.silu(gate) * up, self.w_down[ex]))
        y = torch.cat(outs) * weights.flatten()[order].unsqueeze(1).to(x.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class TrainDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, is_moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TrainMLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = TrainMoE(cfg) if is_moe else TrainMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TrainMTP(nn.Module):
    """One multi-token-prediction module (its embedding and head are the main model's)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = TrainDecoderLayer(cfg, cfg.n_routed_experts > 0)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps)


class TrainModel(nn.Module):
    """DeepSeek-V3 for training: ``forward(ids)`` gives next-token logits and the MTP's logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.num_nextn_predict_layers > 1:
            raise ValueError("the training model supports at most one MTP module")
        if cfg.tie_word_embeddings:
            raise ValueError("the training model keeps embed_tokens and lm_head separate")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TrainDecoderLayer(cfg, cfg.is_moe_layer(i)) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = TrainMTP(cfg) if cfg.num_nextn_predict_layers else None
        cos, sin = rotary_tables(cfg)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Normal(0, std) matrices (residual-stream outputs scaled by 1/sqrt(2 * blocks)), unit norms,
        zero correction biases; deterministic for the generator."""
        out_std = std / (2 * (self.cfg.num_hidden_layers + 1)) ** 0.5
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(("o_proj.weight", "down_proj.weight", "w_down")):
                    p.normal_(0.0, out_std, generator=generator)
                else:
                    p.normal_(0.0, std, generator=generator)
            for m in self.modules():
                if isinstance(m, TrainMoE):
                    m.e_score_correction_bias.zero_()

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> final hidden states after ``model.norm`` [B, T, H]."""
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def mtp_logits(self, h: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """h [B, T, H] (positions 0..T-1), next_ids [B, T] (the tokens at 1..T) -> logits for the
        tokens at 2..T+1 [B, T, V]."""
        assert self.mtp is not None
        m = self.mtp
        t = h.shape[1]
        x = m.eh_proj(torch.cat([m.enorm(self.embed_tokens(next_ids)), m.hnorm(h)], dim=-1))
        x = m.layer(x, self.cos[:t], self.sin[:t])
        return self.lm_head(m.shared_head_norm(x))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [B, T] -> (logits [B, T, V] for tokens 1..T, MTP logits [B, T-1, V] for tokens
        2..T, or None without an MTP module)."""
        h = self.hidden(ids)
        logits = self.lm_head(h)
        if self.mtp is None:
            return logits, None
        return logits, self.mtp_logits(h[:, :-1], ids[:, 1:])

    def moe_layers(self) -> list[TrainMoE]:
        return [m for m in self.modules() if isinstance(m, TrainMoE)]

    @torch.no_grad()
    def update_routing_bias(self, gamma: float) -> None:
        """Aux-loss-free balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        for m in self.moe_layers():
            m.e_score_correction_bias += gamma * torch.sign(m.load.mean() - m.load)

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor under its published DeepSeek-V3 name (float32, detached; shared ones twice)."""
        return {k: v.detach().float().clone() for k, v in self._published().items()}

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of :meth:`named_checkpoint_tensors`: every parameter and routing bias read from its
        published name (a checkpoint this model's shape wrote); KeyError naming what is missing."""
        published = self._published()
        missing = sorted(set(published) - set(tensors))
        if missing:
            raise KeyError(f"the checkpoint lacks {len(missing)} tensors of the training model, e.g. {missing[:3]}")
        for name, view in published.items():
            view.copy_(tensors[name])

    def _published(self) -> dict[str, torch.Tensor]:
        """Published name -> the live tensor or view of this model's storage holding it."""
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed_tokens.weight}
        for i, layer in enumerate(self.layers):
            out |= _layer_tensors(layer, f"model.layers.{i}")
        out["model.norm.weight"] = self.norm.weight
        out["lm_head.weight"] = self.lm_head.weight
        if self.mtp is not None:
            p = f"model.layers.{self.cfg.num_hidden_layers}"
            m = self.mtp
            out[f"{p}.embed_tokens.weight"] = self.embed_tokens.weight
            out[f"{p}.enorm.weight"] = m.enorm.weight
            out[f"{p}.hnorm.weight"] = m.hnorm.weight
            out[f"{p}.eh_proj.weight"] = m.eh_proj.weight
            out |= _layer_tensors(m.layer, p)
            out[f"{p}.shared_head.norm.weight"] = m.shared_head_norm.weight
            out[f"{p}.shared_head.head.weight"] = self.lm_head.weight
        return out


def _layer_tensors(layer: TrainDecoderLayer, p: str) -> dict[str, torch.Tensor]:
    """The layer's tensors by published name (its state dict's tensors and views of the stacked experts:
    they share the parameters' storage)."""
    out = {f"{p}.{k}": v for k, v in layer.state_dict().items() if not k.startswith("mlp.")}
    mlp = layer.mlp
    if isinstance(mlp, TrainMLP):
        return out | {f"{p}.mlp.{k}": v for k, v in mlp.state_dict().items()}
    assert isinstance(mlp, TrainMoE)
    out[f"{p}.mlp.gate.weight"] = mlp.gate_weight
    out[f"{p}.mlp.gate.e_score_correction_bias"] = mlp.e_score_correction_bias
    for e in range(mlp.w_gate_up.shape[0]):
        gate, up = mlp.w_gate_up[e].chunk(2, dim=0)
        out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = gate
        out[f"{p}.mlp.experts.{e}.up_proj.weight"] = up
        out[f"{p}.mlp.experts.{e}.down_proj.weight"] = mlp.w_down[e]
    if mlp.shared_experts is not None:
        out |= {f"{p}.mlp.shared_experts.{k}": v for k, v in mlp.shared_experts.state_dict().items()}
    return out
