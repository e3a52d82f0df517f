"""The model's kernels as torch custom ops (``torch.ops.epserve.*``), so ``torch.compile`` sees each as
one opaque call with a known output shape (its fake implementation) instead of tracing into code that
reads the device on the host: the CPU reference of paged MLA decode reads ``seq_lens``, the CPU expert
paths read the per-expert counts. On CUDA the same functions run the sync-free Triton kernels.

Only a trace goes through the op (:func:`tracing`: under ``torch.compile`` or a fake-tensor mode): a
custom op's first eager call imports torch's compiler stack (seconds, in every rank process), and eager
callers gain nothing from it.
"""

from __future__ import annotations

import torch

from epserve.kernels.mla_decode import paged_mla_decode


def tracing() -> bool:
    """Whether this call is being traced (``torch.compile``) or run on fake tensors: then the opaque op."""
    return torch.compiler.is_compiling() or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


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
