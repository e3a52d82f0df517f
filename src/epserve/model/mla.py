"""Multi-head Latent Attention on the paged latent KV cache.

The cache holds, per token and layer, the normalised latent ``c_kv`` (``kv_lora_rank``) followed by
the rotated shared key ``k_pe`` (``qk_rope_head_dim``). Prefill chunks run in MHA form (the latent of
the whole context is projected to per-head K/V by ``kv_b_proj``); decode tokens run in absorbed form
(``W_UK`` folded into the query, ``W_UV`` applied after attention, attention directly on the latent
cache as multi-query attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig
from epserve.kernels import linear
from epserve.model.batch import ForwardBatch
from epserve.model.layers import RMSNorm, RopeTable


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, num_local_heads: int | None = None) -> None:
        super().__init__()
        c = config
        self.num_heads = num_local_heads or c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_head_dim
        self.v_head_dim = c.v_head_dim
        self.softmax_scale = c.softmax_scale
        h = self.num_heads
        if c.q_lora_rank is None:
            self.q_proj = nn.Parameter(torch.empty(h * c.qk_head_dim, c.hidden_size))
            self.kv_a_proj_with_mqa = nn.Parameter(torch.empty(c.kv_cache_dim, c.hidden_size))
        else:
            # q_a_proj and kv_a_proj_with_mqa fused into one GEMM: [q_lora + kv_lora + rope, H]
            self.fused_qkv_a_proj = nn.Parameter(torch.empty(c.q_lora_rank + c.kv_cache_dim, c.hidden_size))
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = nn.Parameter(torch.empty(h * c.qk_head_dim, c.q_lora_rank))
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Parameter(torch.empty(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank))
        self.o_proj = nn.Parameter(torch.empty(c.hidden_size, h * c.v_head_dim))

    # ---- projections ------------------------------------------------------------------------
    def _project(self, x: torch.Tensor, rope: RopeTable) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> q [T, h, qk_head] (rope applied), latent [T, kv_lora + rope] (normed, rope applied)."""
        if self.q_lora_rank is None:
            q = linear(x, self.q_proj)
            latent = linear(x, self.kv_a_proj_with_mqa)
        else:
            q_a, latent = linear(x, self.fused_qkv_a_proj).split(
                [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
            )
            q = linear(self.q_a_layernorm(q_a), self.q_b_proj)
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, rope.apply(q_pe)], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), rope.apply(k_pe)], dim=-1)
        return q, latent

    def prepare(self) -> None:
        """After loading: split ``kv_b_proj`` per head into the absorbed decode weights, kept in fp32
        (small: heads x nope x kv_lora_rank) so the decode attention math runs in fp32.
        W_UK [h, nope, r] and W_UV^T [h, r, v]."""
        w = self.kv_b_proj.detach().float().view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        self.register_buffer("w_uk", w[:, : self.qk_nope_head_dim].contiguous(), persistent=False)
        self.register_buffer("w_uv_t", w[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous(), persistent=False)

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """x: [T, H]; kv_cache: [num_blocks, block_size, kv_lora + rope] -> [T, H]"""
        q, latent = self._project(x, rope)
        flat_cache = kv_cache.view(-1, kv_cache.shape[-1])
        flat_cache.index_copy_(0, batch.slot_mapping, latent.to(kv_cache.dtype))
        out = x.new_empty(x.shape[0], self.num_heads, self.v_head_dim)
        num_decode = batch.num_decode_seqs
        if num_decode:
            out[:num_decode] = self._decode_absorbed(q[:num_decode], batch, kv_cache)
        if batch.num_prefill_seqs:
            self._prefill_mha(q, batch, kv_cache, out)
        return linear(out.flatten(1), self.o_proj)

    def _decode_absorbed(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """One query token per sequence, attention in fp32 on the latent cache. q: [B, h, qk_head] -> [B, h, v]"""
        num_seqs = q.shape[0]
        q_nope, q_pe = q.float().split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, h, r]
        q_full = torch.cat([q_latent, q_pe], dim=-1)  # [B, h, r + rope]
        seq_lens = batch.seq_lens[:num_seqs]
        max_len = max(batch.seq_lens_cpu[:num_seqs])
        num_blocks = -(-max_len // batch.block_size)
        tables = batch.block_tables[:num_seqs, :num_blocks]
        kv = kv_cache[tables].view(num_seqs, num_blocks * batch.block_size, -1)[:, :max_len].float()  # [B, L, r+rope]
        scores = torch.bmm(q_full, kv.transpose(1, 2)) * self.softmax_scale  # [B, h, L]
        pad = torch.arange(max_len, device=q.device)[None, :] >= seq_lens[:, None]  # [B, L]
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        o_latent = torch.bmm(torch.softmax(scores, dim=-1), kv[..., : self.kv_lora_rank])  # [B, h, r]
        out = torch.bmm(o_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)  # [B, h, v]
        return out.to(q.dtype)

    def _prefill_mha(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
        """Chunks that may continue from cached blocks: attend over the whole cached context in MHA form."""
        starts = batch.query_start_loc_cpu
        bs = batch.block_size
        for i in range(batch.num_decode_seqs, batch.num_seqs):
            lo, hi = starts[i], starts[i + 1]
            seq_len = batch.seq_lens_cpu[i]
            num_blocks = -(-seq_len // bs)
            latent = kv_cache[batch.block_tables[i, :num_blocks]].view(-1, kv_cache.shape[-1])[:seq_len]
            latent = latent.to(q.dtype)
            c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            kv = linear(c_kv, self.kv_b_proj).view(seq_len, self.num_heads, -1)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
            q_len = hi - lo
            if q_len == seq_len:  # no cached context: plain causal attention
                mask, is_causal = None, True
            else:  # query i sits at position seq_len - q_len + i and sees keys up to it
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
                is_causal = False
            o = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
            )  # [h, q_len, v]
            out[lo:hi] = o.transpose(0, 1)
