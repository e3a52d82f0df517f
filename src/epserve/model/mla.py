"""Multi-head Latent Attention on the paged latent KV cache.

The cache holds, per token and layer, the normalised latent ``c_kv`` (``kv_lora_rank``) followed by
the rotated shared key ``k_pe`` (``qk_rope_head_dim``). Prefill chunks run in MHA form (the latent of
the whole context is projected to per-head K/V by ``kv_b_proj``); decode tokens run in absorbed form
(``W_UK`` folded into the query, ``W_UV`` applied after attention, attention directly on the latent
cache as multi-query attention). The engine's batches mix both: decode sequences first, then
prefill chunks, and :meth:`MLAttention.forward` runs both forms (the ``mixed`` op list of
``parallel/stages.py``).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig
from epserve.kernels import linear
from epserve.model.batch import ForwardBatch, MicroBatch
from epserve.model.layers import RMSNorm, RopeTable
from epserve.parallel.stages import (
    APPEND_KV,
    ATTENTION_CORE,
    KV_B_PROJ,
    O_PROJ,
    Q_ABSORB,
    Q_B_PROJ,
    QKV_A_PROJ,
    V_ABSORB,
    OpHook,
    run_op,
)


class PrefillKV(NamedTuple):
    """Per-head keys and values of one prefill chunk's whole context: [L, h, qk_head], [L, h, v]."""

    k: torch.Tensor
    v: torch.Tensor


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

    def forward(
        self, h: torch.Tensor, mb: MicroBatch, layer_idx: int, hook: OpHook | None = None
    ) -> Generator[None, None, torch.Tensor]:
        """h [T, H] (normed) -> o_proj output [T, H] (partial sums over this rank's heads when TP > 1),
        writing the tokens' latent KV to layer ``layer_idx``'s cache. Yields once, between the
        projections and the attention itself: the end of the micro-batch schedule's first stage."""
        batch, rope, kv_cache = mb.batch, mb.rope, mb.kv_caches[layer_idx]
        q_a, latent = run_op(hook, QKV_A_PROJ, self.project_qkv_a, h)
        q = run_op(hook, Q_B_PROJ, self.project_q, h, q_a, rope)
        run_op(hook, APPEND_KV, self.append_kv, latent, batch, kv_cache, rope)
        q_latent = run_op(hook, Q_ABSORB, self.absorb_q, q, batch)  # decode rows: into the latent space
        prefill_kv = run_op(hook, KV_B_PROJ, self.expand_kv, batch, kv_cache, q.dtype)  # prefill rows: MHA form
        yield
        o_latent, out = run_op(hook, ATTENTION_CORE, self.attention_core, q, q_latent, prefill_kv, batch, kv_cache)
        out = run_op(hook, V_ABSORB, self.absorb_v, o_latent, out)
        return run_op(hook, O_PROJ, self.project_out, out)

    # ---- the attention ops of parallel/stages.py ---------------------------------------------
    def project_qkv_a(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x: [T, H] -> (q_a [T, q_lora] or None without q LoRA, raw latent [T, kv_lora + rope])."""
        if self.q_lora_rank is None:
            return None, linear(x, self.kv_a_proj_with_mqa)
        q_a, latent = linear(x, self.fused_qkv_a_proj).split(
            [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
        )
        return q_a, latent

    def project_q(self, x: torch.Tensor, q_a: torch.Tensor | None, rope: RopeTable) -> torch.Tensor:
        """-> q [T, h, qk_head] with the rotary part rotated."""
        q = linear(x, self.q_proj) if q_a is None else linear(self.q_a_layernorm(q_a), self.q_b_proj)
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, rope.apply(q_pe)], dim=-1)

    def append_kv(self, latent: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, rope: RopeTable) -> None:
        """Normalise ``c_kv``, rotate ``k_pe`` and write them to the paged latent cache."""
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), rope.apply(k_pe)], dim=-1)
        kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, batch.slot_mapping, latent.to(kv_cache.dtype))

    def prepare(self) -> None:
        """After loading: split ``kv_b_proj`` per head into the absorbed decode weights, kept in fp32
        (small: heads x nope x kv_lora_rank) so the decode attention math runs in fp32.
        W_UK [h, nope, r] and W_UV^T [h, r, v]."""
        w = self.kv_b_proj.detach().float().view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        self.register_buffer("w_uk", w[:, : self.qk_nope_head_dim].contiguous(), persistent=False)
        self.register_buffer("w_uv_t", w[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous(), persistent=False)

    def absorb_q(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Decode queries into the latent space (fp32): [B, h, qk_head] -> [B, h, kv_lora + rope]."""
        q_nope, q_pe = q[: batch.num_decode_seqs].float().split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [B, h, r]
        return torch.cat([q_latent, q_pe], dim=-1)

    def expand_kv(self, batch: ForwardBatch, kv_cache: torch.Tensor, dtype: torch.dtype) -> list[PrefillKV]:
        """Prefill chunks: the whole cached context of each projected to per-head K and V."""
        bs = batch.block_size
        out = []
        for i in range(batch.num_decode_seqs, batch.num_seqs):
            seq_len = batch.seq_lens_cpu[i]
            num_blocks = -(-seq_len // bs)
            latent = kv_cache[batch.block_tables[i, :num_blocks]].view(-1, kv_cache.shape[-1])[:seq_len].to(dtype)
            c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            kv = linear(c_kv, self.kv_b_proj).view(seq_len, self.num_heads, -1)
            k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, self.num_heads, -1)], dim=-1)
            out.append(PrefillKV(k, v))
        return out

    def attention_core(
        self,
        q: torch.Tensor,
        q_latent: torch.Tensor,
        prefill_kv: list[PrefillKV],
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (decode outputs in the latent space [B, h, r] fp32, per-head outputs [T, h, v] whose
        prefill rows are filled)."""
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        o_latent = self._decode_mqa(q_latent, batch, kv_cache)
        starts = batch.query_start_loc_cpu
        for i, kv in zip(range(batch.num_decode_seqs, batch.num_seqs), prefill_kv):
            lo, hi = starts[i], starts[i + 1]
            seq_len, q_len = batch.seq_lens_cpu[i], hi - lo
            if q_len == seq_len:  # no cached context: plain causal attention
                mask, is_causal = None, True
            else:  # query i sits at position seq_len - q_len + i and sees keys up to it
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
                is_causal = False
            o = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), kv.k.transpose(0, 1), kv.v.transpose(0, 1),
                attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
            )  # [h, q_len, v]
            out[lo:hi] = o.transpose(0, 1)
        return o_latent, out

    def absorb_v(self, o_latent: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode outputs back from the latent space into ``out``'s first rows; returns ``out``."""
        out[: o_latent.shape[0]] = torch.bmm(o_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1).to(out.dtype)
        return out

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, h, v] -> [T, H] (partial sums over this rank's heads when TP > 1)."""
        return linear(out.flatten(1), self.o_proj)

    def _decode_mqa(self, q_latent: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Absorbed decode attention: MQA of [B, h, r + rope] queries over the latent cache -> [B, h, r]."""
        num_seqs = q_latent.shape[0]
        if not num_seqs:
            return q_latent.new_empty(0, self.num_heads, self.kv_lora_rank)
        seq_lens = batch.seq_lens[:num_seqs]
        max_len = max(batch.seq_lens_cpu[:num_seqs])
        num_blocks = -(-max_len // batch.block_size)
        tables = batch.block_tables[:num_seqs, :num_blocks]
        kv = kv_cache[tables].view(num_seqs, num_blocks * batch.block_size, -1)[:, :max_len].float()  # [B, L, r+rope]
        scores = torch.bmm(q_latent, kv.transpose(1, 2)) * self.softmax_scale  # [B, h, L]
        pad = torch.arange(max_len, device=q_latent.device)[None, :] >= seq_lens[:, None]  # [B, L]
        scores.masked_fill_(pad[:, None, :], float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), kv[..., : self.kv_lora_rank])  # [B, h, r]

    def decode_attention(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """W_UK, MQA over the latent cache, W_UV for decode queries [B, h, qk_head] -> [B, h, v]."""
        o_latent = self._decode_mqa(self.absorb_q(q, batch), batch, kv_cache)
        return self.absorb_v(o_latent, q.new_empty(q.shape[0], self.num_heads, self.v_head_dim))
