"""The loader's per-rank plan: which checkpoint tensors (and which of their rows and columns) make each of
our tensors (:class:`Piece`, ``pieces``), and the model of one rank built on the meta device with every
tensor in its runtime dtype (:func:`build_on_meta`), from which the bytes a rank holds are counted before
any weight is read (:func:`plan_weight_bytes`). ``model/loader.py`` materializes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from epserve.checkpoint import SCALE_SUFFIX
from epserve.config import ModelConfig
from epserve.kernels.fp8 import BLOCK
from epserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from epserve.model.moe import ROUTING_BUFFERS
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.experts import GroupedExperts
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.context import ParallelContext

Span = tuple[int, int]  # [lo, hi)

# Float tensors that stay fp32 whatever the runtime dtype: tile scales, the expert gate (its top-k must not
# flip), the KV scale and the rotary tables. MLA's absorbed weights too, unless the weights are FP8.
KEEP_FP32 = ("_scale_inv", "mlp.gate.weight", "e_score_correction_bias", "kv_scale", "rotary.cos", "rotary.sin",
             "_scale_2", "input_scale")  # (the last two: NVFP4's global scales)
ABSORBED = ("self_attn.w_uk", "self_attn.w_uv_t")
DERIVED = (*ABSORBED, "rotary.cos", "rotary.sin", *ROUTING_BUFFERS)  # computed after loading
OPTIONAL = ("kv_scale",)  # 1.0 unless the checkpoint has one
NVFP4_SCALARS = ("weight_scale_2", "input_scale")  # an NVFP4 linear's per-tensor scales (fp32 scalars, stored 0-d)
EXPERT_PARTS = {"": "weight", "_scale_inv": "weight_scale_inv", "_scale": "weight_scale", "_scale_2": "weight_scale_2",
                "_input_scale": "input_scale"}  # stacked experts' tensor suffix -> the checkpoint's
MTP_VOCAB = {"embed_tokens": "embed_tokens", "shared_head.head": "lm_head"}  # MTP tensor -> the main model's twin


class Piece(NamedTuple):
    """One checkpoint tensor's contribution to one of our tensors: ``source`` (its ``rows``/``cols``, or
    all) goes to ``target[index][dst_rows]`` (or all of ``target[index]``)."""

    source: str
    index: tuple[int, ...] = ()
    dst_rows: Span | None = None
    rows: Span | None = None
    cols: Span | None = None

    def scaled(self) -> Piece:
        """The same piece of the tile-scale tensor (spans in 128-tiles; starts are tile-aligned)."""

        def tiles(span: Span | None) -> Span | None:
            return None if span is None else (span[0] // BLOCK, -(-span[1] // BLOCK))

        return Piece(self.source + SCALE_SUFFIX, self.index, tiles(self.dst_rows), tiles(self.rows), tiles(self.cols))


def _shard(ctx: ParallelContext, n: int) -> Span | None:
    """This TP rank's span of ``n`` per-rank rows or columns."""
    return None if ctx.tp == 1 else (ctx.tp_rank * n, (ctx.tp_rank + 1) * n)


def tensor_pieces(
    config: ModelConfig, name: str, shape: tuple[int, ...], local_experts: tuple[int, ...], ctx: ParallelContext
) -> list[Piece]:
    """Where our tensor ``name`` (``shape``) comes from in the checkpoint."""
    if name.startswith("mtp."):  # MTP layer j is the checkpoint's layer L + j
        j, _, rest = name.removeprefix("mtp.").partition(".")
        layer = config.num_hidden_layers + int(j)
        if rest in MTP_VOCAB:
            return [Piece(f"model.layers.{layer}.{rest}.weight")] if shape[0] else []
        name = f"layers.{layer}.{rest}"
    if name == "embed_tokens":
        return [Piece("model.embed_tokens.weight")]
    if name == "lm_head":
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        return [Piece(head)] if shape[0] else []  # ranks that are not a DP group's leader hold none
    if name == "norm.weight":
        return [Piece("model.norm.weight")]
    prefix, _, rest = name.partition(".")
    assert prefix == "layers", name
    idx, _, rest = rest.partition(".")
    p = f"model.layers.{idx}."
    if rest == "self_attn.fused_qkv_a_proj.weight":
        q_lora = config.q_lora_rank or 0
        return [Piece(p + "self_attn.q_a_proj.weight", dst_rows=(0, q_lora)),
                Piece(p + "self_attn.kv_a_proj_with_mqa.weight", dst_rows=(q_lora, shape[0]))]
    if rest in ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight"):
        return [Piece(p + rest, rows=_shard(ctx, shape[0]))]
    if rest == "self_attn.o_proj.weight":
        return [Piece(p + rest, cols=_shard(ctx, shape[1]))]
    module, _, part = rest.rpartition(".")
    if module in ("mlp.gate_up_proj", "mlp.shared_experts.gate_up_proj"):
        q = p + module.removesuffix("gate_up_proj")
        if part in NVFP4_SCALARS:  # one per part
            return [Piece(f"{q}gate_proj.{part}", (0,)), Piece(f"{q}up_proj.{part}", (1,))]
        inter = shape[0] // 2
        return [Piece(f"{q}gate_proj.{part}", dst_rows=(0, inter)),
                Piece(f"{q}up_proj.{part}", dst_rows=(inter, shape[0]))]
    experts, _, stacked = rest.rpartition(".")
    if experts == "mlp.experts" and stacked.startswith("w13"):
        part = EXPERT_PARTS[stacked.removeprefix("w13")]
        gate, up = (0,), (1,)  # the per-part scalars
        inter = shape[1] // 2
        if part not in NVFP4_SCALARS:
            gate, up = (0, inter), (inter, shape[1])
        return [piece for j, e in enumerate(local_experts) for piece in (
            _expert_piece(f"{p}mlp.experts.{e}.gate_proj.{part}", j, gate),
            _expert_piece(f"{p}mlp.experts.{e}.up_proj.{part}", j, up))]
    if experts == "mlp.experts" and stacked.startswith("w2"):
        part = EXPERT_PARTS[stacked.removeprefix("w2")]
        index = (0,) if part in NVFP4_SCALARS else ()
        return [Piece(f"{p}mlp.experts.{e}.down_proj.{part}", (j, *index)) for j, e in enumerate(local_experts)]
    if part in NVFP4_SCALARS:  # an unfused NVFP4 linear's global scales: [1]
        return [Piece(p + rest, (0,))]
    return [Piece(p + rest)]  # norms, kv_a_proj_with_mqa, down_proj, kv_scale


def _expert_piece(source: str, j: int, span: tuple[int, ...]) -> Piece:
    """Expert ``j``'s piece of a stacked gate/up tensor: rows ``span`` (two values) or the scalar at ``span``."""
    return Piece(source, (j, span[0])) if len(span) == 1 else Piece(source, (j,), span)


# ---- building ----------------------------------------------------------------------------------


def named_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer (one the MTP layer shares with the main model appears twice)."""
    for mod_name, module in model.named_modules():
        for attr, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                yield (f"{mod_name}.{attr}" if mod_name else attr), module, attr, t


def empty_like(like: torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor shaped like ``like`` (not ``empty_like``: on meta inputs it pulls in
    torch's Python meta kernels, ~40 MB of modules)."""
    return torch.empty(like.shape, dtype=dtype or like.dtype, device=device)


def set_tensor(module: nn.Module, attr: str, t: torch.Tensor) -> None:
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[attr] = t


def build_on_meta(
    config: ModelConfig,
    dtype: torch.dtype,
    fp8: bool,
    ctx: ParallelContext,
    placement: ExpertPlacement,
    dispatcher: Dispatcher | None = None,
    mtp: bool = False,
) -> DeepseekV3ForCausalLM:
    """The model of rank ``ctx.rank`` on the meta device, every tensor in its runtime dtype: the loader's
    plan (shapes and bytes) before any weight is read. ``mtp``: with the MTP layer (its embedding and
    head counted apart: whether they are shared is known only once the checkpoint is read)."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config, dispatcher or LocalDispatcher(placement.num_local_slots), placement, ctx,
                                      fp8, mtp)
    keep = KEEP_FP32 if fp8 else (*KEEP_FP32, *ABSORBED)
    for name, module, attr, t in named_tensors(model):
        if t.dtype == torch.float32 and not name.endswith(keep):
            set_tensor(module, attr, empty_like(t, "meta", dtype))
    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        experts.act_dtype = dtype  # what FP8 experts return for an FP8 payload (its rows no longer say)
    return model.requires_grad_(False)


def model_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (what a rank holds for the model, meta or materialized); a
    materialized tensor that two modules share (the MTP layer's embedding and head) once."""
    tensors = [t for _, _, _, t in named_tensors(model)]
    unique = {(t.device, t.data_ptr()): t for t in tensors if t.device.type != "meta"}
    return sum(t.numel() * t.element_size() for t in [*unique.values(), *(t for t in tensors if t.is_meta)])


def plan_weight_bytes(
    config: ModelConfig, ctx: ParallelContext, fp8: bool, dtype: torch.dtype = torch.bfloat16,
    num_redundant_experts: int = 0,
) -> int:
    """Bytes rank ``ctx.rank`` holds for the model, from the loader's own plan on the meta device."""
    placement = ExpertPlacement.build(max(config.n_routed_experts, 1), ctx.ep_size, num_redundant_experts)
    return model_bytes(build_on_meta(config, dtype, fp8, ctx, placement))
