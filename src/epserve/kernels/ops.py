"""Every kernel op of the model in one namespace: ``ops.<name>(...)``.

Each op is declared once, in its definition module, with ``kernels.opdef``: its signature and torch reference
(one function), its argument checks and fake implementation, and its implementations per device (C kernels on
the CPU, Triton, FlashInfer or ``torch._scaled_mm`` on CUDA). Calling it is the one place that decides: traced,
the custom op ``torch.ops.epserve.<name>`` (for what a trace cannot enter) or torch code; eager, the
implementation chosen for the device (filled once, after ``kernels.backends`` ran its self-tests), falling back
to the reference inside the op where an implementation declines a call. Model and MoE code call these and never
ask whether they are traced nor test for a kernel's absence.

- ``kernels.fused``: ``rms_norm``, ``rope_heads``, ``append_latent``, ``head_matmul``, ``gather_rows``,
  ``copy_``, ``add``, ``silu_mul``;
- ``kernels.gate``: ``grouped_topk``; ``kernels.mla_decode``: ``mla_decode`` (``paged_mla_decode``);
- ``kernels.fp8``: ``act_quant``, ``silu_mul_quant``, ``block_fp8_gemm``, ``grouped_block_fp8_gemm``;
- ``kernels.grouped``: ``grouped_swiglu``; ``kernels.dense``: ``linear``;
- ``kernels.nvfp4``: ``nvfp4_linear``, ``nvfp4_moe_swiglu`` (NVFP4 weights, W4A16); ``kernels.nvfp4_w4a4``:
  ``nvfp4_w4a4_linear`` (W4A4 on FP4 tensor cores); ``kernels.nvfp4_w4a4_moe``: ``nvfp4_w4a4_moe_swiglu`` (the
  routed experts W4A4); ``kernels.nvfp4_act``: ``nvfp4_act_quant``,
  ``nvfp4_act_dequant``, ``nvfp4_token_scale`` (NVFP4 activations: W4A4's and the FP4 dispatch's);
- ``kernels.moe_ops``: ``group_by_expert``, ``local_dispatch``, ``weighted_combine``, ``index_add_counts``.
"""

from __future__ import annotations

from epserve.kernels.dense import linear
from epserve.kernels.fp8 import act_quant, block_fp8_gemm, grouped_block_fp8_gemm, silu_mul_quant
from epserve.kernels.fused import (
    add,
    append_latent,
    copy_,
    gather_rows,
    head_matmul,
    rms_norm,
    rope_heads,
    silu_mul,
)
from epserve.kernels.gate import grouped_topk
from epserve.kernels.grouped import grouped_swiglu
from epserve.kernels.mla_decode import paged_mla_decode
from epserve.kernels.moe_ops import group_by_expert, index_add_counts, local_dispatch, weighted_combine
from epserve.kernels.nvfp4 import nvfp4_linear, nvfp4_moe_swiglu
from epserve.kernels.nvfp4_act import nvfp4_act_dequant, nvfp4_act_quant, nvfp4_token_scale
from epserve.kernels.nvfp4_w4a4 import nvfp4_w4a4_linear
from epserve.kernels.nvfp4_w4a4_moe import nvfp4_w4a4_moe_swiglu
from epserve.kernels.opdef import OpDef, defined

mla_decode = paged_mla_decode

__all__ = ["OpDef", "act_quant", "add", "append_latent", "block_fp8_gemm", "copy_", "defined", "gather_rows",
           "group_by_expert", "grouped_block_fp8_gemm", "grouped_swiglu", "grouped_topk", "head_matmul",
           "index_add_counts", "linear", "local_dispatch", "mla_decode", "nvfp4_act_dequant", "nvfp4_act_quant",
           "nvfp4_linear", "nvfp4_moe_swiglu", "nvfp4_token_scale", "nvfp4_w4a4_linear", "nvfp4_w4a4_moe_swiglu",
           "paged_mla_decode",
           "rms_norm", "rope_heads", "silu_mul", "silu_mul_quant", "weighted_combine"]
