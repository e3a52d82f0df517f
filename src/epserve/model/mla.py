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

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig
from epserve.kernels import append_latent, copy_, head_matmul, rope_heads
from epserve.kernels.fp8 import FP8_DTYPE, FP8_MAX
from epserve.kernels.ops import mla_decode
from epserve.model.batch import ForwardBatch, MicroBatch
from epserve.model.layers import Linear, RMSNorm, RopeTable
from epserve.parallel.overlap import Result, Stages
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
    """Absorbed weights (``w_uk``, ``w_uv_t``, from ``kv_b_proj`` by :meth:`prepare`) are fp32 so the
    decode math runs in fp32, or the model dtype when the projections run in FP8 (half the memory).
    ``kv_scale``: the latent cache's per-layer scale when the cache is FP8 (stored = latent / scale)."""

    def __init__(self, config: ModelConfig, num_local_heads: int | None = None, fp8: bool = False) -> None:
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
            self.q_proj = Linear(c.hidden_size, h * c.qk_head_dim, fp8)
            self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_cache_dim, fp8)
        else:
            # q_a_proj and kv_a_proj_with_mqa fused into one GEMM: [q_lora + kv_lora + rope, H]
            self.fused_qkv_a_proj = Linear(c.hidden_size, c.q_lora_rank + c.kv_cache_dim, fp8)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = Linear(c.q_lora_rank, h * c.qk_head_dim, fp8)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = Linear(c.kv_lora_rank, h * (c.qk_nope_head_dim + c.v_head_dim), fp8)
        self.o_proj = Linear(h * c.v_head_dim, c.hidden_size, fp8)
        self.register_buffer("w_uk", torch.empty(h, c.qk_nope_head_dim, c.kv_lora_rank), persistent=False)
        self.register_buffer("w_uv_t", torch.empty(h, c.kv_lora_rank, c.v_head_dim), persistent=False)
        self.register_buffer("kv_scale", torch.ones((), dtype=torch.float32))

    def forward(
        self, h: torch.Tensor, mb: MicroBatch, layer_idx: int, result: Result[torch.Tensor],
        hook: OpHook | None = None,
    ) -> Stages:
        """h [T, H] (normed) -> ``result.value``: the o_proj output [T, H] (partial sums over this rank's
        heads when TP > 1), writing the tokens' latent KV to layer ``layer_idx``'s cache. Yields once,
        between the projections and the attention itself: the end of the micro-batch schedule's first
        stage (``parallel/overlap.py``)."""
        batch, rope, kv_cache = mb.batch, mb.rope, mb.kv_caches[layer_idx]
        q_a, latent = run_op(hook, QKV_A_PROJ, self.project_qkv_a, h)
        q = run_op(hook, Q_B_PROJ, self.project_q, h, q_a, rope)
        run_op(hook, APPEND_KV, self.append_kv, latent, batch, kv_cache, rope)
        q_latent = run_op(hook, Q_ABSORB, self.absorb_q, q, batch)  # decode rows: into the latent space
        prefill_kv = run_op(hook, KV_B_PROJ, self.expand_kv, batch, kv_cache, q.dtype)  # prefill rows: MHA form
        yield
        o_latent, out = run_op(hook, ATTENTION_CORE, self.attention_core, q, q_latent, prefill_kv, batch, kv_cache)
        out = run_op(hook, V_ABSORB, self.absorb_v, o_latent, out)
        result.value = run_op(hook, O_PROJ, self.project_out, out)

    # ---- the attention ops of parallel/stages.py ---------------------------------------------
    def project_qkv_a(self, x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """x: [T, H] -> (q_a [T, q_lora] or None without q LoRA, raw latent [T, kv_lora + rope])."""
        if self.q_lora_rank is None:
            return None, self.kv_a_proj_with_mqa(x)
        q_a, latent = self.fused_qkv_a_proj(x).split(
            [self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
        )
        return q_a, latent

    def project_q(self, x: torch.Tensor, q_a: torch.Tensor | None, rope: RopeTable) -> torch.Tensor:
        """-> q [T, h, qk_head] with the rotary part rotated."""
        q = self.q_proj(x) if q_a is None else self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(-1, self.num_heads, self.qk_head_dim)
        return rope_heads(q, rope.cos, rope.sin, rope.interleave, self.qk_rope_head_dim)

    def append_kv(self, latent: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor, rope: RopeTable) -> None:
        """Normalise ``c_kv``, rotate ``k_pe`` and write them to the paged latent cache."""
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        norm = self.kv_a_layernorm
        if kv_cache.dtype != FP8_DTYPE:
            append_latent(latent, norm.weight, norm.eps, rope.cos, rope.sin, rope.interleave, batch.slot_mapping, flat,
                          self.kv_lora_rank)
            return
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = torch.cat([norm(c_kv), rope.apply(k_pe)], dim=-1)
        # stored = latent / scale, saturated; copied as bytes (index ops lack float8 kernels)
        q = (latent.float() / self.kv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        flat.view(torch.uint8).index_copy_(0, batch.slot_mapping, q.view(torch.uint8))

    @staticmethod
    def _gather(kv_cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The cache blocks ``tables`` (gathered as bytes when FP8: index ops lack float8 kernels)."""
        if kv_cache.dtype != FP8_DTYPE:
            return kv_cache[tables]
        return kv_cache.view(torch.uint8)[tables].view(FP8_DTYPE)

    def _from_cache(self, latent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cached latents in ``dtype``, dequantized when the cache is FP8."""
        if latent.dtype != FP8_DTYPE:
            return latent.to(dtype)
        return (latent.float() * self.kv_scale).to(dtype)

    def prepare(self) -> None:
        """After loading: split ``kv_b_proj`` per head into the absorbed decode weights
        W_UK [h, nope, r] and W_UV^T [h, r, v] (in the dtype the loader gave these buffers)."""
        w = self.kv_b_proj.dequantized().view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                              self.kv_lora_rank)
        with torch.no_grad():
            self.w_uk.copy_(w[:, : self.qk_nope_head_dim])
            self.w_uv_t.copy_(w[:, self.qk_nope_head_dim :].transpose(1, 2))

    def absorb_q(self, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Decode queries into the latent space (fp32): [B, h, qk_head] -> [B, h, kv_lora + rope]."""
        q_nope, q_pe = q[: batch.num_decode_seqs].split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        r = self.kv_lora_rank
        q_latent = q.new_empty(q_nope.shape[0], self.num_heads, r + self.qk_rope_head_dim, dtype=torch.float32)
        head_matmul(q_nope, self.w_uk, out=q_latent[..., :r])  # [B, h, r]
        copy_(q_latent[..., r:], q_pe)
        return q_latent

    def expand_kv(self, batch: ForwardBatch, kv_cache: torch.Tensor, dtype: torch.dtype) -> list[PrefillKV]:
        """Prefill chunks: the whole cached context of each projected to per-head K and V."""
        bs = batch.block_size
        out = []
        for i in range(batch.num_decode_seqs, batch.num_seqs):
            seq_len = batch.seq_lens_cpu[i]
            num_blocks = -(-seq_len // bs)
            latent = self._gather(kv_cache, batch.block_tables[i, :num_blocks]).view(-1, kv_cache.shape[-1])[:seq_len]
            c_kv, k_pe = self._from_cache(latent, dtype).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(c_kv).view(seq_len, self.num_heads, -1)
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
        # torch's fused CPU attention takes only V as wide as Q and K: V padded with zero columns (which
        # give zero outputs, cut off) runs there, 1.4-3.4x the unfused path it fell to (MLA's V is narrower)
        pad = q.shape[-1] - self.v_head_dim if q.device.type == "cpu" else 0
        for i, kv in zip(range(batch.num_decode_seqs, batch.num_seqs), prefill_kv):
            lo, hi = starts[i], starts[i + 1]
            seq_len, q_len = batch.seq_lens_cpu[i], hi - lo
            if q_len == seq_len:  # no cached context: plain causal attention
                mask, is_causal = None, True
            else:  # query i sits at position seq_len - q_len + i and sees keys up to it
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
                is_causal = False
            v = F.pad(kv.v, (0, pad)) if pad > 0 else kv.v
            o = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1)[None], kv.k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
            )[0]  # [h, q_len, v (+ pad)]
            out[lo:hi] = o[..., : self.v_head_dim].transpose(0, 1)
        return o_latent, out

    def absorb_v(self, o_latent: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode outputs back from the latent space into ``out``'s first rows; returns ``out``."""
        head_matmul(o_latent, self.w_uv_t, out=out[: o_latent.shape[0]])
        return out

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, h, v] -> [T, H] (partial sums over this rank's heads when TP > 1)."""
        return self.o_proj(out.flatten(1))

    def _decode_mqa(self, q_latent: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Absorbed decode attention: MQA of [B, h, r + rope] queries over the paged latent cache, read in
        place through the block tables (``kernels/mla_decode.py``) -> [B, h, r] fp32."""
        num_seqs = q_latent.shape[0]
        if not num_seqs:
            return q_latent.new_empty(0, self.num_heads, self.kv_lora_rank)
        scale = self.kv_scale if kv_cache.dtype == FP8_DTYPE else None
        return mla_decode(q_latent, kv_cache, batch.block_tables[:num_seqs], batch.seq_lens[:num_seqs],
                          self.softmax_scale, self.kv_lora_rank, scale)

    def decode_attention(self, q: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """W_UK, MQA over the latent cache, W_UV for decode queries [B, h, qk_head] -> [B, h, v]."""
        o_latent = self._decode_mqa(self.absorb_q(q, batch), batch, kv_cache)
        return self.absorb_v(o_latent, q.new_empty(q.shape[0], self.num_heads, self.v_head_dim))
