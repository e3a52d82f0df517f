"""The model's kernels as torch custom ops (``torch.ops.epserve.*``), so a trace sees each as one opaque
call with a known output (its fake implementation) instead of tracing into code that cannot be traced:
Triton launches on CUDA, and host reads (the CPU reference of paged MLA decode reads ``seq_lens``, the
FP8 grouped reference the per-expert counts). A fake-tensor trace of the CUDA decode forward (and
``torch.compile``) thus never enters Triton nor reads a value on the host; eager calls run the kernels.

Only a trace goes through an op (:func:`tracing`: under ``torch.compile`` or a fake-tensor mode): a
custom op's first eager call imports torch's compiler stack (seconds, in every rank process), and eager
callers gain nothing from it. The front ends switch themselves: ``kernels.fp8`` (activation quantization,
block and grouped GEMMs), ``kernels.gate`` (the fused gate on CUDA), ``kernels.grouped`` (the Triton
grouped SwiGLU), ``kernels.fused`` (RMSNorm, rotary embedding and the latent append on CUDA) call
``torch.ops.epserve.<name>`` when traced; this module defines those ops (importing ``epserve.kernels``
registers them). The CPU kernels' ops sit with them (``kernels.cpu``,
``moe/experts.py``).
"""

from __future__ import annotations

import torch

from epserve.kernels import fp8, fused, gate, grouped
from epserve.kernels.device import tracing
from epserve.kernels.mla_decode import paged_mla_decode

__all__ = ["mla_decode", "tracing"]


def mla_decode(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Paged MLA decode (``kernels.mla_decode``): through the custom op when traced, directly otherwise."""
    fn = paged_mla_decode_op if tracing() else paged_mla_decode
    return fn(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale)


# ``kernels.mla_decode.paged_mla_decode`` as the op: [B, h, r + rope] queries over the paged latent cache ->
# [B, h, r] fp32.
paged_mla_decode_op = torch.library.custom_op("epserve::paged_mla_decode", paged_mla_decode, mutates_args=())


@paged_mla_decode_op.register_fake
def _(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank, kv_scale=None, num_splits=None):  # noqa: ANN001
    return q_latent.new_empty(q_latent.shape[0], q_latent.shape[1], kv_lora_rank, dtype=torch.float32)


# ---- block-scaled FP8 (kernels.fp8): each op runs the front end it stands for -----------------------


def _fake_quant(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, k], fp32 scales [M, ceil(k/128)]): M-major on the CUDA kernels' route, as they return them."""
    m, groups = x.shape[0], fp8.cdiv(k, fp8.BLOCK)
    q = x.new_empty(m, k, dtype=fp8.FP8_DTYPE)
    if fp8._on_cuda(x):
        return q, x.new_empty(groups, m, dtype=torch.float32).t()
    return q, x.new_empty(m, groups, dtype=torch.float32)


@torch.library.custom_op("epserve::fp8_act_quant", mutates_args=())
def fp8_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.act_quant``: x [M, K] -> (fp8 [M, K], fp32 [M, ceil(K/128)])."""
    return fp8.act_quant(x)


@fp8_act_quant.register_fake
def _(x):  # noqa: ANN001
    fp8.check_act(x)
    return _fake_quant(x, x.shape[1])


@torch.library.custom_op("epserve::fp8_silu_mul_quant", mutates_args=())
def fp8_silu_mul_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8.silu_mul_quant``: gate_up [M, 2I] -> (fp8 [M, I], fp32 [M, ceil(I/128)])."""
    return fp8.silu_mul_quant(gate_up)


@fp8_silu_mul_quant.register_fake
def _(gate_up):  # noqa: ANN001
    fp8.check_act(gate_up, "gate_up")
    return _fake_quant(gate_up, gate_up.shape[1] // 2)


@torch.library.custom_op("epserve::fp8_block_gemm", mutates_args=())
def fp8_block_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``fp8.block_fp8_gemm``: a fp8 [M, K] x b fp8 [N, K]^T with block scales -> [M, N] out_dtype."""
    return fp8.block_fp8_gemm(a, a_scale, b, b_scale, out_dtype)


@fp8_block_gemm.register_fake
def _(a, a_scale, b, b_scale, out_dtype):  # noqa: ANN001
    fp8.check_gemm(a, a_scale, b, b_scale)
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("epserve::fp8_grouped_gemm", mutates_args=())
def fp8_grouped_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``fp8.grouped_block_fp8_gemm``: rows of a [R, K] grouped by expert (counts [E]) x b [E, N, K]^T."""
    return fp8.grouped_block_fp8_gemm(a, a_scale, b, b_scale, counts, out_dtype)


@fp8_grouped_gemm.register_fake
def _(a, a_scale, b, b_scale, counts, out_dtype):  # noqa: ANN001
    fp8.check_grouped(a, a_scale, b, b_scale, counts)
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


# ---- the fused gate on CUDA (kernels.gate) ----------------------------------------------------------


@torch.library.custom_op("epserve::grouped_topk", mutates_args=())
def grouped_topk(
    logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, method: str, scoring: str,
    norm_topk_prob: bool, routed_scaling_factor: float, bias: torch.Tensor | None,
    logical_to_physical: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate.grouped_topk``: logits [T, E] -> (ids int64 [T, K], weights fp32 [T, K])."""
    return gate.grouped_topk(
        logits, top_k=top_k, n_group=n_group, topk_group=topk_group, method=method, scoring=scoring,
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor, bias=bias,
        logical_to_physical=logical_to_physical,
    )


@grouped_topk.register_fake
def _(logits, top_k, n_group, topk_group, method, scoring, norm_topk_prob, routed_scaling_factor, bias,  # noqa: ANN001
      logical_to_physical):
    gate.check_args(logits, top_k, n_group, topk_group, method, scoring, bias, logical_to_physical)
    t = logits.shape[0]
    return logits.new_empty(t, top_k, dtype=torch.int64), logits.new_empty(t, top_k, dtype=torch.float32)


# ---- the Triton grouped SwiGLU experts (kernels.grouped) --------------------------------------------


@torch.library.custom_op("epserve::grouped_swiglu_triton", mutates_args=())
def grouped_swiglu_triton(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``grouped_triton.grouped_swiglu_triton``: x [R, H] grouped by expert -> [R, H], rows past sum(counts) zero."""
    return grouped._triton().grouped_swiglu_triton(x, counts, w13, w2)


@grouped_swiglu_triton.register_fake
def _(x, counts, w13, w2):  # noqa: ANN001
    grouped.check_grouped_swiglu(x, counts, w13, w2)
    return x.new_empty(x.shape[0], w2.shape[1])


# ---- the small fused ops on CUDA (kernels.fused, Triton in kernels.fused_triton) ------------------------


@torch.library.custom_op("epserve::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``fused_triton.rms_norm_triton``: x [..., D] -> a new [..., D] in the promoted dtype of x and weight."""
    return fused._triton().rms_norm_triton(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):  # noqa: ANN001
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("epserve::rope_heads", mutates_args=())
def rope_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
               rope_dim: int) -> torch.Tensor:
    """``fused_triton.rope_heads_triton`` out of place (eager calls rotate q in place): q [T, h, D] -> a new
    [T, h, D] with the last ``rope_dim`` columns of each head rotated."""
    return fused._triton().rope_heads_triton(q.clone(memory_format=torch.contiguous_format), cos, sin, interleave,
                                              rope_dim)


@rope_heads.register_fake
def _(q, cos, sin, interleave, rope_dim):  # noqa: ANN001
    return q.new_empty(q.shape)


@torch.library.custom_op("epserve::append_latent", mutates_args=("flat_cache",))
def append_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  interleave: bool, slots: torch.Tensor, flat_cache: torch.Tensor, kv_lora_rank: int) -> None:
    """``fused_triton.append_latent_triton``: ``[RMSNorm(c_kv) | rope(k_pe)]`` of each latent row written to
    ``flat_cache``'s rows ``slots``."""
    fused._triton().append_latent_triton(latent, norm_weight, eps, cos, sin, interleave, slots, flat_cache,
                                         kv_lora_rank)


@append_latent.register_fake
def _(latent, norm_weight, eps, cos, sin, interleave, slots, flat_cache, kv_lora_rank):  # noqa: ANN001
    return None
