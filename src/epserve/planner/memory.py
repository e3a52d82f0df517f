"""Memory model: weights per GPU, KV bytes per token, and the batch the rest of HBM holds.

Weights follow the engine's own layout tensor for tensor (``model/load_plan.py``, ``build_on_meta``) on
the GPU that holds the most, a DP group's leader: the attention of its DP group (the head-sharded
``q_b``/``q_proj``, ``kv_b`` and ``o_proj`` split by TP, the fused latent ``q_a`` + ``kv_a``
replicated) with MLA's absorbed decode weights, the dense MLPs and the shared expert whole,
``slots / EP`` routed experts, the expert gate, the full embedding (replicated, not vocabulary-parallel)
and the full LM head (a DP group's leader only). The MLPs and experts are priced in the deployment's
weight dtype, the other linears in its attention dtype (an NVFP4 checkpoint's: FP4 MLPs and experts,
attention as stored). ``tests/planner/test_planner_memory.py`` and ``test_nvfp4_plan.py`` check the figure
against the engine's plan byte for byte. The MTP layer (``mtp_draft > 0``) is an addition on top,
laid out like the other layers: the engine does not load it yet.

The latent KV cache is replicated on every TP rank, so one GPU stores the cache of all
``batch * tp`` requests of its DP group.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

from epserve.config import ModelConfig
from epserve.planner.deployment import KV_BYTES, WEIGHT_BYTES, Deployment, num_expert_slots
from epserve.planner.hardware import HardwareSpec

GIB = 2**30
TILE = 128  # FP8 weights carry one fp32 scale per TILE x TILE tile of each matrix (edge tiles whole)
RUNTIME_BYTES = 2  # the engine's runtime dtype (bf16): embedding, LM head, norms
# Per element of a linear layer's weight, and per tile of its scales. FP4 (NVFP4, as ModelOpt stores it and
# the engine holds it) is priced per element, its one e4m3 scale per 16 values included, and per part (each
# of the linears a fused weight holds: gate and up) an fp32 global scale and an fp32 input scale. The engine
# holds NVFP4 MLPs and experts only; FP4 attention (the whole model in FP4) is priced without part scales.
LINEAR_BYTES = {"fp8": 1.0, "bf16": 2.0, "fp4": WEIGHT_BYTES["fp4"]}
TILE_SCALE_BYTES = {"fp8": 4, "bf16": 0, "fp4": 0}
PART_BYTES = {"fp8": 0, "bf16": 0, "fp4": 8}


@dataclass(frozen=True)
class WeightCounts:
    """What one GPU holds, by how it is stored: elements, and tiles of FP8 scales. The linear layers are two
    groups, each in its own dtype (``Deployment.weight_dtype``, ``attention_dtype``): the MLPs' and experts'
    (``ffn``) and the others (``linear``: attention's projections, MTP's ``eh_proj``)."""

    linear: int = 0  # attention's (and eh_proj's) linear weights, in the deployment's attention dtype
    tiles: int = 0  # their TILE x TILE tiles, per matrix: one fp32 scale each if FP8
    runtime: int = 0  # embedding, LM head, norms: the runtime dtype (bf16)
    absorbed: int = 0  # MLA's absorbed w_uk and w_uv_t: bf16 next to quantized weights, fp32 next to bf16 ones
    gate: int = 0  # the expert gate's weight and correction bias: fp32
    fp32: int = 0  # derived fp32 tensors: the rotary cos/sin tables, each layer's KV scale
    int64: int = 0  # the MoE layers' routing tables (each expert's replica slots and count, each slot's expert)
    ffn: int = 0  # the MLPs' and experts' linear weights (dense MLPs, shared and routed experts), weight dtype
    ffn_tiles: int = 0  # their tiles, per matrix (per expert when stacked)
    ffn_parts: int = 0  # their parts (gate and up of a fused weight are two; per expert): NVFP4's scalar scales

    def __add__(self, other: WeightCounts) -> WeightCounts:
        return WeightCounts(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, n: int) -> WeightCounts:
        return WeightCounts(*(a * n for a in astuple(self)))

    __rmul__ = __mul__

    @property
    def parameters(self) -> int:
        """Checkpoint parameters held (scales and derived tensors not counted)."""
        return self.linear + self.ffn + self.runtime + self.gate

    def ffn_bytes(self, weight_dtype: str) -> int:
        """The MLPs' and experts' weights with their scales."""
        return int(self.ffn * LINEAR_BYTES[weight_dtype] + self.ffn_tiles * TILE_SCALE_BYTES[weight_dtype]
                   + self.ffn_parts * PART_BYTES[weight_dtype])

    def linear_bytes(self, attention_dtype: str) -> int:
        """The other linear layers' weights with their scales."""
        return int(self.linear * LINEAR_BYTES[attention_dtype] + self.tiles * TILE_SCALE_BYTES[attention_dtype])

    def bytes(self, weight_dtype: str, attention_dtype: str | None = None) -> int:
        attention = attention_dtype or weight_dtype
        absorbed = 4 if attention == "bf16" else RUNTIME_BYTES
        return (self.ffn_bytes(weight_dtype) + self.linear_bytes(attention) + self.runtime * RUNTIME_BYTES
                + self.absorbed * absorbed + (self.gate + self.fp32) * 4 + self.int64 * 8)


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int  # for the deployment's batch at its KV length
    reserved_bytes: int  # CUDA context, activations, graphs, communication buffers
    capacity_bytes: int
    kv_bytes_per_token: int  # per request, all layers, on one GPU
    max_batch_per_gpu: int  # requests per GPU the KV capacity holds at this KV length (0: weights do not fit)
    max_requests_per_dp_group: int = 0  # the same for a DP group (each of its GPUs holds all its requests' KV)

    @property
    def weights_fit(self) -> bool:
        return self.weights_bytes + self.reserved_bytes <= self.capacity_bytes

    @property
    def fits(self) -> bool:
        return self.weights_bytes + self.kv_bytes + self.reserved_bytes <= self.capacity_bytes

    def shortfall(self) -> str | None:
        """What does not fit in one GPU's memory and by how much (None: everything fits)."""
        usable = self.capacity_bytes - self.reserved_bytes
        if not self.weights_fit:
            return (f"weights need {self.weights_bytes / GIB:.1f} GiB per GPU, more than the {usable / GIB:.1f} GiB "
                    f"usable ({(self.weights_bytes - usable) / GIB:.1f} GiB short)")
        if not self.fits:
            free = usable - self.weights_bytes
            return (f"KV needs {self.kv_bytes / GIB:.1f} GiB per GPU, {free / GIB:.1f} GiB free after "
                    f"{self.weights_bytes / GIB:.1f} GiB of weights ({(self.kv_bytes - free) / GIB:.1f} GiB short); "
                    f"at most {self.max_requests_per_dp_group} requests per DP group fit")
        return None


def linear_counts(in_features: int, out_features: int, count: int = 1) -> WeightCounts:
    """``count`` weights ``[out, in]`` (a fused weight is one matrix: its tiles are counted whole)."""
    tiles = -(-out_features // TILE) * -(-in_features // TILE)
    return WeightCounts(linear=count * out_features * in_features, tiles=count * tiles)


def gated_mlp_counts(hidden: int, intermediate: int, count: int = 1) -> WeightCounts:
    """SwiGLU with gate and up fused: ``gate_up [2I, H]`` (two parts) and ``down [H, I]``, in the MLPs' dtype."""
    gate_up, down = linear_counts(hidden, 2 * intermediate, count), linear_counts(intermediate, hidden, count)
    return WeightCounts(ffn=gate_up.linear + down.linear, ffn_tiles=gate_up.tiles + down.tiles, ffn_parts=3 * count)


def attention_counts(model: ModelConfig, tp: int) -> WeightCounts:
    """One layer's MLA on one TP rank (``model/mla.py``): projections, norms, absorbed weights, KV scale."""
    heads = model.num_attention_heads // tp
    h, r = model.hidden_size, model.kv_lora_rank
    if model.q_lora_rank:  # q_a and kv_a fused, replicated; q_b split by heads
        q = (linear_counts(h, model.q_lora_rank + model.kv_cache_dim)
             + linear_counts(model.q_lora_rank, heads * model.qk_head_dim) + WeightCounts(runtime=model.q_lora_rank))
    else:
        q = linear_counts(h, heads * model.qk_head_dim) + linear_counts(h, model.kv_cache_dim)
    return (q + linear_counts(r, heads * (model.qk_nope_head_dim + model.v_head_dim))  # kv_b
            + linear_counts(heads * model.v_head_dim, h)  # o_proj
            + WeightCounts(runtime=r, absorbed=heads * r * (model.qk_nope_head_dim + model.v_head_dim), fp32=1))


def expert_counts(model: ModelConfig) -> WeightCounts:
    """One routed expert (``w13`` gate and up, ``w2`` down)."""
    return gated_mlp_counts(model.hidden_size, model.moe_intermediate_size)


def moe_counts(model: ModelConfig, slots_per_rank: int, num_slots: int) -> WeightCounts:
    """One MoE layer on one rank (``model/moe.py``): gate, routing tables (``replica_table [E, R + 1]``,
    ``replica_count [E]``, ``slot_experts [slots per rank]``), local experts, shared expert."""
    n = model.n_routed_experts
    bias = n if model.topk_method == "noaux_tc" else 0  # the gate registers it for noaux_tc only
    shared = gated_mlp_counts(model.hidden_size, model.moe_intermediate_size * model.n_shared_experts)
    tables = n * (num_slots - n + 1) + n + slots_per_rank
    return (WeightCounts(gate=n * model.hidden_size + bias, int64=tables) + slots_per_rank * expert_counts(model)
            + (shared if model.n_shared_experts else WeightCounts()))


def weight_counts(model: ModelConfig, d: Deployment) -> WeightCounts:
    """What the most loaded GPU (a DP group's leader) holds."""
    h = model.hidden_size
    attn = attention_counts(model, d.tp) + WeightCounts(runtime=2 * h)  # with the layer's two norms
    slots = num_expert_slots(model, d)
    moe = moe_counts(model, slots // d.ep, slots)
    num_moe = len(model.moe_layer_ids)
    num_dense = model.num_hidden_layers - num_moe
    total = (model.num_hidden_layers * attn + num_moe * moe + num_dense * gated_mlp_counts(h, model.intermediate_size)
             + WeightCounts(runtime=2 * model.vocab_size * h + h,  # embedding and LM head (both, even if tied), norm
                            fp32=2 * model.max_position_embeddings * (model.qk_rope_head_dim // 2)))  # rotary
    if d.mtp_draft:  # the MTP layer: enorm, hnorm, eh_proj, one MoE decoder layer, the head's norm
        total += linear_counts(2 * h, h) + WeightCounts(runtime=3 * h) + attn + moe
    return total


def planned_kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "bf16", mtp_draft: int = 0) -> int:
    """Latent cache per token of a deployment's KV dtype name (``bf16``, ``fp8``): ``kv_lora_rank +
    qk_rope_head_dim`` values per layer, plus the MTP layer's with ``mtp_draft``. The engine's
    allocation for a torch dtype and cached layers is ``engine.memory.kv_bytes_per_token``; the two
    agree (``tests/engine/test_config.py``), the planner staying torch-free."""
    layers = model.num_hidden_layers + (1 if mtp_draft and model.num_nextn_predict_layers else 0)
    return layers * model.kv_cache_dim * KV_BYTES[kv_dtype]


def estimate_memory(model: ModelConfig, hw: HardwareSpec, d: Deployment) -> MemoryEstimate:
    weights = weight_counts(model, d).bytes(d.weight_dtype, d.attn_dtype)
    per_token = planned_kv_bytes_per_token(model, d.kv_dtype, d.mtp_draft)
    per_request_on_gpu = d.tp * d.kv_len * per_token  # TP ranks replicate the latent cache
    reserved = int(hw.memory_bytes * hw.reserved_memory_fraction)
    free = hw.memory_bytes - reserved - weights
    return MemoryEstimate(
        weights_bytes=weights,
        kv_bytes=d.requests_per_dp_group * d.kv_len * per_token,  # every request of the DP group, on each GPU
        reserved_bytes=reserved,
        capacity_bytes=hw.memory_bytes,
        kv_bytes_per_token=per_token,
        max_batch_per_gpu=max(0, free // per_request_on_gpu),
        max_requests_per_dp_group=max(0, free // (d.kv_len * per_token)),
    )
