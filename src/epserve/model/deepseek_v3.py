"""DeepSeek-V3 (and V2) decoder: embed -> [MLA + dense MLP | MoE] x L -> norm -> lm_head.

A decoder layer is a set of named ops (``parallel/stages.py``) run by an overlap schedule: in order,
or two micro-batches interleaved. The model holds no distributed code of its own: the dispatcher,
the expert placement and the tensor-parallel collectives are handed in at build time, so the same
module runs for every parallel layout and dispatch backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from epserve.config import ModelConfig
from epserve.engine.profiler import OpProfiler
from epserve.kernels import linear
from epserve.model.batch import ForwardBatch
from epserve.model.layers import GatedMLP, RMSNorm, RopeTable, RotaryEmbedding
from epserve.model.mla import MLAttention, PrefillKV
from epserve.model.moe import MoE
from epserve.moe.dispatch.base import Dispatcher, DispatchHandle, ExpertInput
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.comm import TensorParallel
from epserve.parallel.context import ParallelContext
from epserve.parallel.overlap import run_in_order, run_interleaved
from epserve.parallel.stages import Schedule, dense_layer_schedule, moe_layer_schedule


@dataclass(eq=False)
class LayerState:
    """One micro-batch on its way through the layers: its batch, its residual stream ``x`` (the
    whole batch, the same on every TP rank between layers) and what each op hands the next."""

    batch: ForwardBatch
    rope: RopeTable
    kv_caches: list[torch.Tensor]
    x: torch.Tensor  # [T, H]
    h: torch.Tensor | None = None  # normed attention input
    q_a: torch.Tensor | None = None
    latent: torch.Tensor | None = None
    q: torch.Tensor | None = None
    q_latent: torch.Tensor | None = None
    prefill_kv: list[PrefillKV] | None = None
    o_latent: torch.Tensor | None = None
    attn_out: torch.Tensor | None = None
    partial: torch.Tensor | None = None  # o_proj output (partial sums over this rank's heads)
    own: torch.Tensor | None = None  # residual of the tokens this TP rank owns in the FFN half
    ffn_in: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    in_flight: DispatchHandle | None = None
    shared: torch.Tensor | None = None
    expert_input: ExpertInput | None = None
    route: DispatchHandle | None = None
    experts_out: torch.Tensor | None = None
    combining: DispatchHandle | None = None
    ffn_out: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def split(self) -> tuple[LayerState, LayerState]:
        """Two micro-batches of whole sequences with about half the tokens each."""
        cut_seq = self.batch.split_point()
        cut = self.batch.query_start_loc_cpu[cut_seq]
        halves = []
        for (s0, s1), (t0, t1) in (((0, cut_seq), (0, cut)), ((cut_seq, self.batch.num_seqs), (cut, self.num_tokens))):
            rope = RopeTable(self.rope.cos[t0:t1], self.rope.sin[t0:t1], self.rope.interleave)
            halves.append(LayerState(self.batch.select(s0, s1), rope, self.kv_caches, self.x[t0:t1]))
        return halves[0], halves[1]


class DecoderLayer(nn.Module):
    """MLA attention + dense MLP or MoE, exposed as the ops of its stage list (``run_op``)."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, config.num_attention_heads // tp.size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.is_moe = isinstance(mlp, MoE)
        self.profiler: OpProfiler | None = None  # set to time every op (benchmarks)

    def schedule(self, mode: str) -> Schedule:
        return _schedule(self.is_moe, mode)

    def run_op(self, name: str, s: LayerState) -> None:
        op = getattr(self, "op_" + name)
        if self.profiler is None:
            op(s)
        else:
            self.profiler.timed(name, op, s)

    # ---- attention half: every token of the DP group, this rank's heads -----------------------
    def op_input_norm(self, s: LayerState) -> None:
        s.h = self.input_layernorm(s.x)

    def op_qkv_a_proj(self, s: LayerState) -> None:
        s.q_a, s.latent = self.self_attn.project_qkv_a(s.h)

    def op_q_b_proj(self, s: LayerState) -> None:
        s.q = self.self_attn.project_q(s.h, s.q_a, s.rope)

    def op_append_kv(self, s: LayerState) -> None:
        self.self_attn.append_kv(s.latent, s.batch, s.kv_caches[self.layer_idx], s.rope)

    def op_q_absorb(self, s: LayerState) -> None:
        s.q_latent = self.self_attn.absorb_q(s.q, s.batch)

    def op_kv_b_proj(self, s: LayerState) -> None:
        s.prefill_kv = self.self_attn.expand_kv(s.batch, s.kv_caches[self.layer_idx], s.q.dtype)

    def op_attention_core(self, s: LayerState) -> None:
        s.o_latent, s.attn_out = self.self_attn.attention_core(
            s.q, s.q_latent, s.prefill_kv, s.batch, s.kv_caches[self.layer_idx]
        )

    def op_v_absorb(self, s: LayerState) -> None:
        s.attn_out = self.self_attn.absorb_v(s.o_latent, s.attn_out)

    def op_o_proj(self, s: LayerState) -> None:
        s.partial = self.self_attn.project_out(s.attn_out)

    def op_attn_reduce_scatter(self, s: LayerState) -> None:
        s.own = self.tp.own_rows(s.x) + self.tp.reduce_scatter(s.partial)

    # ---- FFN half: the tokens this TP rank owns ------------------------------------------------
    def op_post_norm(self, s: LayerState) -> None:
        s.ffn_in = self.post_attention_layernorm(s.own)

    def op_mlp(self, s: LayerState) -> None:
        s.ffn_out = self.mlp(s.ffn_in)

    def op_gate(self, s: LayerState) -> None:
        s.topk_ids, s.topk_weights = self.mlp.gate(s.ffn_in)

    def op_dispatch_send(self, s: LayerState) -> None:
        s.in_flight = self.mlp.dispatcher.dispatch_send(s.ffn_in, s.topk_ids, s.topk_weights)

    def op_shared_expert(self, s: LayerState) -> None:
        s.shared = self.mlp.shared_expert(s.ffn_in)

    def op_dispatch_recv(self, s: LayerState) -> None:
        s.expert_input, s.route = self.mlp.dispatcher.dispatch_recv(s.in_flight)
        self.mlp.expert_load += s.expert_input.num_tokens_per_expert

    def op_experts(self, s: LayerState) -> None:
        s.experts_out = self.mlp.experts(s.expert_input)

    def op_combine_send(self, s: LayerState) -> None:
        s.combining = self.mlp.dispatcher.combine_send(s.experts_out, s.route)

    def op_combine_recv(self, s: LayerState) -> None:
        s.ffn_out = self.mlp.dispatcher.combine_recv(s.combining)

    def op_ffn_all_gather(self, s: LayerState) -> None:
        out = s.ffn_out if s.shared is None else s.ffn_out + s.shared
        s.x = self.tp.all_gather(s.own + out, s.num_tokens)
        s.shared = None


@cache
def _schedule(is_moe: bool, mode: str) -> Schedule:
    """The engine's batches mix decodes and prefill chunks: the ``mixed`` attention op list."""
    return moe_layer_schedule(mode, "mixed") if is_moe else dense_layer_schedule("mixed")  # type: ignore[arg-type]


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, dispatcher: Dispatcher, placement: ExpertPlacement, ctx: ParallelContext
    ) -> None:
        super().__init__()
        self.config = config
        tp = TensorParallel(ctx)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config)
        layers = []
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                mlp: nn.Module = MoE(config, dispatcher, placement, ctx.rank)
            else:
                mlp = GatedMLP(config.hidden_size, config.intermediate_size)
            layers.append(DecoderLayer(config, i, mlp, tp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        # Runs of consecutive layers of one kind: micro-batching applies to MoE runs only.
        self.segments: list[tuple[bool, list[DecoderLayer]]] = []
        for layer in self.layers:
            if self.segments and self.segments[-1][0] == layer.is_moe:
                self.segments[-1][1].append(layer)
            else:
                self.segments.append((layer.is_moe, [layer]))

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], overlap: str = "dispatch") -> torch.Tensor:
        """Run every layer over the flat batch, writing its latent KV; returns final hidden [T, H].
        ``overlap``: ``none``, ``dispatch`` or ``microbatch`` (two micro-batches over MoE layers;
        dense layers run the whole batch)."""
        x = F.embedding(batch.input_ids, self.embed_tokens)
        state = LayerState(batch, self.rotary.lookup(batch.positions, x.dtype), kv_caches, x)
        for is_moe, layers in self.segments:
            if is_moe and overlap == "microbatch":
                a, b = state.split()
                run_interleaved(layers, a, b)
                state.x = torch.cat([a.x, b.x])
            else:
                run_in_order(layers, state, overlap)
        return self.norm(state.x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in fp32."""
        return linear(hidden, self.lm_head).float()
