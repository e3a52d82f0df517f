"""Memory model: weights per GPU, KV bytes per token, and the batch the rest of HBM holds.

Layout (BRIEF.md, "Parallelism"): every GPU holds the attention of its DP group (the head-sharded
projections split by TP, the latent projections ``q_a``/``kv_a`` replicated), the dense MLPs and the
shared expert whole, ``slots / EP`` routed experts, and a vocabulary-parallel embedding and LM head.
The latent KV cache is replicated on every TP rank, so one GPU stores the cache of all
``batch * tp`` requests of its DP group.
"""

from __future__ import annotations

from dataclasses import dataclass

from epserve.config import ModelConfig
from epserve.planner.deployment import KV_BYTES, WEIGHT_BYTES, Deployment, num_expert_slots
from epserve.planner.hardware import HardwareSpec


@dataclass(frozen=True)
class WeightCounts:
    """Parameters per GPU, split by how they are stored."""

    quantized: int  # linear layers in the deployment's weight dtype
    bf16: int  # embedding, LM head, router gate, norms

    def bytes(self, weight_dtype: str) -> int:
        return int(self.quantized * WEIGHT_BYTES[weight_dtype] + self.bf16 * 2)


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int  # for the deployment's batch at its KV length
    reserved_bytes: int  # CUDA context, activations, graphs, communication buffers
    capacity_bytes: int
    kv_bytes_per_token: int  # per request, all layers, on one GPU
    max_batch_per_gpu: int  # requests per GPU the KV capacity holds at this KV length (0: weights do not fit)

    @property
    def weights_fit(self) -> bool:
        return self.weights_bytes + self.reserved_bytes <= self.capacity_bytes


def attention_params(model: ModelConfig, tp: int) -> int:
    """One layer's MLA weights on one TP rank."""
    heads = model.num_attention_heads // tp
    h = model.hidden_size
    if model.q_lora_rank:
        q = h * model.q_lora_rank + model.q_lora_rank + model.q_lora_rank * heads * model.qk_head_dim
    else:
        q = h * heads * model.qk_head_dim
    kv_a = h * model.kv_cache_dim + model.kv_lora_rank
    kv_b = model.kv_lora_rank * heads * (model.qk_nope_head_dim + model.v_head_dim)
    o = heads * model.v_head_dim * h
    return q + kv_a + kv_b + o


def expert_params(model: ModelConfig) -> int:
    """One routed expert (SwiGLU gate, up, down)."""
    return 3 * model.hidden_size * model.moe_intermediate_size


def weight_counts(model: ModelConfig, d: Deployment) -> WeightCounts:
    h = model.hidden_size
    attn = attention_params(model, d.tp)
    moe_layer = model.n_shared_experts * expert_params(model) + num_expert_slots(model, d) // d.ep * expert_params(model)
    router = model.n_routed_experts * h + model.n_routed_experts  # gate weight + correction bias
    num_moe = len(model.moe_layer_ids)
    num_dense = model.num_hidden_layers - num_moe
    quantized = model.num_hidden_layers * attn + num_dense * 3 * h * model.intermediate_size + num_moe * moe_layer
    bf16 = model.num_hidden_layers * 2 * h + num_moe * router
    vocab = model.vocab_size * h // d.tp
    bf16 += vocab if model.tie_word_embeddings else 2 * vocab
    if d.mtp_draft:  # the MTP layer: enorm, hnorm, eh_proj and one MoE decoder layer; embedding and head shared
        quantized += 2 * h * h + attn + moe_layer
        bf16 += 2 * h + 2 * h + router
    return WeightCounts(quantized=quantized, bf16=bf16 + h)


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "bf16", mtp_draft: int = 0) -> int:
    """Latent cache per token: ``kv_lora_rank + qk_rope_head_dim`` values per layer (plus the MTP layer)."""
    layers = model.num_hidden_layers + (1 if mtp_draft and model.num_nextn_predict_layers else 0)
    return layers * model.kv_cache_dim * KV_BYTES[kv_dtype]


def estimate_memory(model: ModelConfig, hw: HardwareSpec, d: Deployment) -> MemoryEstimate:
    weights = weight_counts(model, d).bytes(d.weight_dtype)
    per_token = kv_bytes_per_token(model, d.kv_dtype, d.mtp_draft)
    per_request_on_gpu = d.tp * d.kv_len * per_token  # TP ranks replicate the latent cache
    reserved = int(hw.memory_bytes * hw.reserved_memory_fraction)
    free = hw.memory_bytes - reserved - weights
    return MemoryEstimate(
        weights_bytes=weights,
        kv_bytes=d.batch * per_request_on_gpu,
        reserved_bytes=reserved,
        capacity_bytes=hw.memory_bytes,
        kv_bytes_per_token=per_token,
        max_batch_per_gpu=max(0, free // per_request_on_gpu),
    )
