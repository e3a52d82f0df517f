"""DeepSeek-V3 (and V2) decoder: embed -> [MLA + dense MLP | MoE] x L -> norm -> lm_head.

A decoder layer's forward is one generator, read top to bottom (``DecoderLayer.forward`` delegating
to ``MLAttention.forward`` and ``MoE.forward``), that runs each named op of ``parallel/stages.py`` and
yields at the micro-batch stage boundaries; ``parallel/overlap.py`` drains one such forward (one
micro-batch, eager or traced by ``torch.compile``), or alternates two micro-batches'.
The model holds no distributed code of its own: the dispatcher, the expert placement and the
tensor-parallel collectives are handed in at build time, so the same module runs for every parallel
layout and dispatch backend.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from epserve.config import OVERLAP_MODES, ModelConfig, OverlapMode
from epserve.kernels import add, cast, copy_, gather_rows, linear
from epserve.model.batch import ForwardBatch, MicroBatch
from epserve.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from epserve.model.mla import MLAttention
from epserve.model.moe import MoE
from epserve.model.quantization import nvfp4_quantized
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.comm import TensorParallel
from epserve.parallel.context import ParallelContext
from epserve.parallel.overlap import Result, Stages, run_in_order, run_interleaved
from epserve.parallel.stages import (
    ATTN_REDUCE_SCATTER,
    DISPATCH_RECV,
    FFN_ALL_GATHER,
    INPUT_NORM,
    MLP,
    POST_NORM,
    SHARED_EXPERT,
    OpHook,
    Schedule,
    dense_layer_schedule,
    moe_layer_schedule,
    run_op,
)


class DecoderLayer(nn.Module):
    """MLA attention + dense MLP or MoE, with the tensor-parallel hand-over between the two halves
    (``parallel/comm.py``): attention on every token of the DP group with this rank's heads, the FFN
    on the tokens this TP rank owns."""

    def __init__(
        self, config: ModelConfig, layer_idx: int, mlp: nn.Module, tp: TensorParallel, fp8: bool = False
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, config.num_attention_heads // tp.size, fp8)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp
        self.is_moe = isinstance(mlp, MoE)
        self.op_hook: OpHook | None = None  # wraps every op (the per-op profiler)
        # Where each mode's schedule runs the shared expert, read once (the forward only looks it up).
        self.shared_during_dispatch = {
            mode: self.is_moe and _schedule(True, mode).runs_before(SHARED_EXPERT, DISPATCH_RECV)
            for mode in OVERLAP_MODES
        }

    def schedule(self, mode: OverlapMode) -> Schedule:
        """The stage list this layer runs under ``mode`` (dense layers: one stage whatever the mode)."""
        return _schedule(self.is_moe, mode)

    def forward(
        self, x: torch.Tensor, mb: MicroBatch, result: Result[torch.Tensor], mode: OverlapMode = "dispatch"
    ) -> Stages:
        """x [T, H] (the residual stream, the same on every TP rank) -> ``result.value``: the next
        layer's [T, H]. Yields at the end of each stage of the micro-batch schedule
        (``parallel/overlap.py``); the ops run in the order of ``self.schedule(mode)``."""
        hook = self.op_hook
        h = run_op(hook, INPUT_NORM, self.input_layernorm, x)
        partial: Result[torch.Tensor] = Result()
        yield from self.self_attn.forward(h, mb, self.layer_idx, partial, hook)
        own = run_op(hook, ATTN_REDUCE_SCATTER, self._reduce_scatter, x, partial.value)  # [T / TP, H]
        h = run_op(hook, POST_NORM, self.post_attention_layernorm, own)
        if self.is_moe:
            routed: Result[torch.Tensor] = Result()
            real = mb.batch.real_rows
            real = None if real is None else self.tp.own_rows(real)  # (the rows of ``own``)
            yield from self.mlp.forward(h, routed, self.shared_during_dispatch[mode], hook, real)
            out = routed.value
        else:
            out = run_op(hook, MLP, self.mlp, h)
        result.value = run_op(hook, FFN_ALL_GATHER, self.tp.all_gather, add(own, out), x.shape[0])
        yield

    def _reduce_scatter(self, x: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """The residual of the tokens this TP rank owns plus the o_proj partials summed over TP."""
        return add(self.tp.own_rows(x), self.tp.reduce_scatter(partial))


@cache
def _schedule(is_moe: bool, mode: OverlapMode) -> Schedule:
    """The engine's batches mix decodes and prefill chunks: the ``mixed`` attention op list."""
    return moe_layer_schedule(mode, "mixed") if is_moe else dense_layer_schedule("mixed")


class SharedHead(nn.Module):
    """The MTP layer's output head: its own norm, then the vocabulary projection (held by a DP group's
    leader only; the main model's ``lm_head`` itself when the checkpoint's copies are equal)."""

    def __init__(self, config: ModelConfig, vocab_rows: int) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Parameter(torch.empty(vocab_rows, config.hidden_size))


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token prediction module, as published (``model.layers.{L}`` in the
    checkpoint): ``eh_proj(concat(enorm(embed(t[i+1])), hnorm(h[i])))`` through one full decoder layer
    (MLA on its own cache layer, MoE through the same dispatcher and expert layout), predicting token
    ``i + 2`` with ``shared_head``. ``embed_tokens`` is the main model's when the checkpoint's copies
    are equal (the loader decides)."""

    def __init__(self, config: ModelConfig, layer_idx: int, mlp: nn.Module, tp: TensorParallel, fp8: bool,
                 vocab_rows: int) -> None:
        super().__init__(config, layer_idx, mlp, tp, fp8)
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, h))
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)  # published unquantized (FP8 checkpoints keep it in bf16)
        self.shared_head = SharedHead(config, vocab_rows)

    def combine(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's input for tokens ``input_ids`` [T] (each the token after its position) and the
        previous depth's hidden states [T, H] (the main model's final, normed ones at depth 1)."""
        h = hidden.shape[1]
        both = hidden.new_empty(hidden.shape[0], 2 * h)  # [enorm(e) | hnorm(h)], one C copy each on the CPU
        copy_(both[:, :h], self.enorm(gather_rows(self.embed_tokens, input_ids)))
        copy_(both[:, h:], self.hnorm(hidden))
        return self.eh_proj(both)


def _run_layers(
    layers: list[DecoderLayer], x: torch.Tensor, mb: MicroBatch, mode: OverlapMode, result: Result[torch.Tensor]
) -> Stages:
    """The layers' forwards one after another, as one stage generator; the last one's output in ``result``."""
    for layer in layers:
        yield from layer.forward(x, mb, result, mode)
        x = result.value


def _run_segment(layers: list[DecoderLayer], x: torch.Tensor, mb: MicroBatch, overlap: OverlapMode) -> torch.Tensor:
    """Consecutive layers of one kind: MoE layers as two interleaved micro-batches under ``microbatch``,
    everything else in order (the same layer forwards, drained)."""
    if layers[0].is_moe and overlap == "microbatch":
        a, b = mb.split()
        cut = a.batch.num_tokens
        offset = layers[0].schedule(overlap).micro_batch_offset
        xa: Result[torch.Tensor] = Result()
        xb: Result[torch.Tensor] = Result()
        run_interleaved(_run_layers(layers, x[:cut], a, overlap, xa), _run_layers(layers, x[cut:], b, overlap, xb),
                        offset)
        return torch.cat([xa.value, xb.value])
    out: Result[torch.Tensor] = Result()
    run_in_order(_run_layers(layers, x, mb, overlap, out))
    return out.value


class DeepseekV3ForCausalLM(nn.Module):
    """``fp8``: the linear layers and routed experts hold FP8 block-scaled weights (embedding, LM head,
    norms and the expert gate stay in higher precision, as published). An NVFP4 checkpoint's MLPs and experts
    hold its four-bit weights where it stores them so (``model.quantization.nvfp4_quantized``). Only a DP
    group's leader computes logits, so other ranks hold an empty ``lm_head``."""

    def __init__(
        self,
        config: ModelConfig,
        dispatcher: Dispatcher,
        placement: ExpertPlacement,
        ctx: ParallelContext,
        fp8: bool = False,
        mtp: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.fp8 = fp8
        tp = TensorParallel(ctx)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.rotary = RotaryEmbedding(config)
        layers = []
        for i in range(config.num_hidden_layers):
            if config.is_moe_layer(i):
                mlp: nn.Module = MoE(config, dispatcher, placement, ctx.rank, fp8, i)
            else:
                nvfp4 = nvfp4_quantized(config, f"model.layers.{i}.mlp.gate_proj")
                mlp = GatedMLP(config.hidden_size, config.intermediate_size, fp8, nvfp4)
            layers.append(DecoderLayer(config, i, mlp, tp, fp8))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_rows = config.vocab_size if ctx.is_leader else 0
        self.lm_head = nn.Parameter(torch.empty(head_rows, config.hidden_size))
        # The MTP layer (speculative decoding only): layer index L, so its latent cache is kv_caches[L].
        self.mtp = nn.ModuleList()
        if mtp:
            n = config.num_hidden_layers
            nvfp4 = nvfp4_quantized(config, f"model.layers.{n}.mlp.gate_proj")
            mlp = (MoE(config, dispatcher, placement, ctx.rank, fp8, n) if config.n_routed_experts
                   else GatedMLP(config.hidden_size, config.intermediate_size, fp8, nvfp4))
            self.mtp.append(MTPLayer(config, n, mlp, tp, fp8, head_rows))
        # Runs of consecutive layers of one kind: micro-batching applies to MoE runs only.
        self.segments: list[tuple[bool, list[DecoderLayer]]] = []
        for layer in self.layers:
            if self.segments and self.segments[-1][0] == layer.is_moe:
                self.segments[-1][1].append(layer)
            else:
                self.segments.append((layer.is_moe, [layer]))

    def forward(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor], overlap: OverlapMode = "dispatch"
    ) -> torch.Tensor:
        """Run every layer over the flat batch, writing its latent KV; returns final hidden [T, H].
        ``overlap``: ``none``, ``dispatch`` or ``microbatch`` (two micro-batches over MoE layers;
        dense layers run the whole batch)."""
        x = gather_rows(self.embed_tokens, batch.input_ids)
        mb = MicroBatch(batch, self.rotary.lookup(batch.positions, x.dtype), kv_caches)
        for _, layers in self.segments:
            x = _run_segment(layers, x, mb, overlap)
        return self.norm(x)

    def forward_mtp(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor], hidden: torch.Tensor,
        overlap: OverlapMode = "dispatch",
    ) -> torch.Tensor:
        """One pass of the MTP layer over the flat batch, writing its latent KV to ``kv_caches[L]``:
        ``batch.input_ids`` holds, at each position, the token after it; ``hidden`` [T, H] the previous
        depth's hidden states at those positions (this model's ``forward`` output at depth 1, this
        method's own output when chained). Returns the layer's output [T, H] (before the head's norm)."""
        layer = self.mtp[0]
        x = layer.combine(batch.input_ids, hidden)
        mb = MicroBatch(batch, self.rotary.lookup(batch.positions, x.dtype), kv_caches)
        return _run_segment([layer], x, mb, overlap)

    def compute_mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """MTP output [S, H] -> draft logits [S, V] in fp32: the MTP head's norm, GEMM and cast, kernel ops all
        (a recorded draft pass holds them, as :meth:`compute_logits`)."""
        head = self.mtp[0].shared_head
        return cast(linear(head.norm(hidden), head.head), torch.float32)

    def init_buffers(self, device: torch.device) -> None:
        """Compute the buffers that are derived, not loaded (the rotary tables, the expert slot
        tables), on ``device``: after building the model on the meta device."""
        with torch.device(device):
            self.rotary = RotaryEmbedding(self.config)
        for layer in [*self.layers, *self.mtp]:
            if layer.is_moe:
                layer.mlp.init_buffers()

    def moe_layers(self) -> dict[int, MoE]:
        """The MoE of every layer that has one (the MTP layer's too), by layer index, in order."""
        return {layer.layer_idx: layer.mlp for layer in [*self.layers, *self.mtp] if layer.is_moe}

    def set_op_hook(self, hook: OpHook | None) -> None:
        """Run every layer op through ``hook`` (e.g. the per-op profiler), or stop (None)."""
        for layer in [*self.layers, *self.mtp]:
            layer.op_hook = hook

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] -> logits [S, V] in fp32: the head's GEMM and the cast, kernel ops both (on the CPU C
        calls alone, so a recorded decode step holds them: ``engine/graphs.py``)."""
        return cast(linear(hidden, self.lm_head), torch.float32)
