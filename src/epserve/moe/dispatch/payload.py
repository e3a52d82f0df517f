"""What a dispatcher sends: token rows in the activation dtype, or their FP8 (``--dispatch-dtype fp8``) or
NVFP4 (``--dispatch-dtype nvfp4``) quantization packed with its scales into one row of bytes.

The FP8 payload is the activation quantization the FP8 expert GEMM would apply anyway
(``kernels.fp8.act_quant``: e4m3 values, one fp32 scale per row and 128 columns), done before the
exchange instead of after it, so the experts compute the same numbers while about half the bytes
travel. A row is packed as ``H`` fp8 bytes followed by the ``H/128`` fp32 scales' bytes, one ``uint8``
row of ``H + 4 * ceil(H/128)`` bytes: one exchange carries both, and gloo or NCCL, which refuse
float8, move plain bytes. All-zero rows (a fixed-shape backend's padding) unpack as zero values with
zero scales. Rows are quantized per token, so quantizing the ``T`` tokens once and then copying
rows equals quantizing the ``T*K`` copies.

The NVFP4 payload (``kernels.nvfp4_act``) quantizes each token with its own global scale
(``nvfp4_token_scale``: amax / (6 * 448)): a row is its ``H/2`` bytes of e2m1 codes, its ``H/16`` e4m3 block
scales and the 4 bytes of its fp32 global scale, ``H/2 + H/16 + 4`` bytes (0.28x a bf16 row for ``H >= 512``).
Unlike FP8 it is lossy for the experts that take it (W4A16: they compute on its dequantized values; W4A4
experts would take it as is), and, quantized per token, the same wherever the row goes: ``local`` (EP 1)
hands its experts the same values as every multi-rank backend. The experts receive it unpacked
(``ExpertInput``: codes, block scales, ``global_scale``); an all-zero row (padding) is zero values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from epserve.config import ConfigError
from epserve.kernels.device import is_cuda
from epserve.kernels.fp8 import BLOCK, FP8_DTYPE, act_quant, cdiv
from epserve.kernels.moe_ops import gather_real_rows
from epserve.kernels.nvfp4_act import GROUP, SCALE_DTYPE, nvfp4_act_quant, nvfp4_token_scale

SCALE_BYTES = 4  # one fp32 scale per row and 128 columns; an NVFP4 row's one global scale
PAYLOADS = ("model", "fp8", "nvfp4")  # what a dispatcher sends: Payload.kind


def use_fp8_payload(dispatch_dtype: str, fp8_weights: bool) -> bool:
    """Whether the dispatchers send FP8 rows: ``--dispatch-dtype`` resolved against the weights the engine
    runs. ``auto`` and ``model`` send the activation dtype, ``nvfp4`` NVFP4 rows (:func:`payload_kind`);
    ``fp8`` needs FP8 routed-expert weights (their GEMM takes the FP8 rows as they arrive) and is a
    ConfigError otherwise."""
    if dispatch_dtype in ("auto", "model", "nvfp4"):
        return False
    if dispatch_dtype != "fp8":
        raise ConfigError(f"unknown dispatch_dtype {dispatch_dtype!r}; choose from auto, fp8, model, nvfp4")
    if not fp8_weights:
        raise ConfigError("dispatch_dtype='fp8' (--dispatch-dtype fp8) needs FP8 routed-expert weights, but this "
                          "engine runs them dequantized (quantization none, or auto off CUDA / for a checkpoint the "
                          "FP8 runtime cannot take); use --quantization fp8 or --dispatch-dtype auto")
    return True


def payload_kind(dispatch_dtype: str, fp8_weights: bool, nvfp4_experts: bool) -> str:
    """The row format (``PAYLOADS``) for ``--dispatch-dtype`` and the routed experts the engine runs: ``fp8``
    as :func:`use_fp8_payload` allows it; ``nvfp4`` needs NVFP4 routed experts (an NVFP4 checkpoint's, as
    stored) and is a ConfigError otherwise."""
    if dispatch_dtype == "nvfp4":
        if not nvfp4_experts:
            raise ConfigError("dispatch_dtype='nvfp4' (--dispatch-dtype nvfp4) needs NVFP4 routed-expert weights (a "
                              "ModelOpt NVFP4 checkpoint whose exclude_modules leave the routed experts four-bit, "
                              "e.g. from epserve make-checkpoint --quantization nvfp4); use --dispatch-dtype auto")
        return "nvfp4"
    return "fp8" if use_fp8_payload(dispatch_dtype, fp8_weights) else "model"


def packed_width(hidden: int) -> int:
    """Bytes of one packed FP8 row of ``hidden`` columns: the values, then the scales."""
    return hidden + SCALE_BYTES * cdiv(hidden, BLOCK)


def quantize_packed(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] (bf16/fp16/fp32) -> uint8 [T, packed_width(H)]: ``act_quant(x)`` values and scales as bytes."""
    q, scales = act_quant(x)
    # flattened first: CUDA's M-major scales of one group ([T, 1], strides (1, T)) count as contiguous but
    # cannot be viewed as bytes
    scale_bytes = scales.contiguous().flatten().view(torch.uint8).view(q.shape[0], SCALE_BYTES * scales.shape[1])
    return torch.cat([q.view(torch.uint8), scale_bytes], dim=1)


def unpack(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, packed_width(H)] -> (fp8 [N, H] contiguous, fp32 scales [N, ceil(H/128)]), the scales in
    the layout ``act_quant`` returns on this device: row-major on the CPU, M-major (strides ``(1, N)``) on
    CUDA, which the FP8 GEMMs read."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != packed_width(hidden):
        raise ValueError(f"packed FP8 rows must be uint8 [N, {packed_width(hidden)}] for hidden size {hidden}, "
                         f"got {packed.dtype} {tuple(packed.shape)}")
    q = packed[:, :hidden].contiguous().view(FP8_DTYPE)
    scales = packed[:, hidden:].contiguous().view(torch.float32)
    if is_cuda(packed):
        scales = scales.t().contiguous().t()
    return q, scales


def nvfp4_width(hidden: int) -> int:
    """Bytes of one packed NVFP4 row of ``hidden`` columns: the e2m1 codes, the block scales, the global scale."""
    if hidden % GROUP:
        raise ValueError(f"an NVFP4 payload needs the hidden size ({hidden}) to be a multiple of {GROUP}")
    return hidden // 2 + hidden // GROUP + SCALE_BYTES


class Nvfp4Rows(NamedTuple):
    """Unpacked NVFP4 rows: ``values`` uint8 [N, H/2] (two e2m1 codes a byte), ``scales`` e4m3 [N, H/16] and
    ``global_scale`` fp32 [N], as ``kernels.nvfp4_act.nvfp4_act_dequant`` takes them."""

    values: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor


def quantize_nvfp4_packed(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] (bf16/fp16/fp32) -> uint8 [T, nvfp4_width(H)]: each row quantized with its own global scale."""
    nvfp4_width(x.shape[1])
    global_scale = nvfp4_token_scale(x)
    values, scales = nvfp4_act_quant(x, global_scale)
    return torch.cat([values, scales.view(torch.uint8), global_scale.view(torch.uint8).view(-1, SCALE_BYTES)], dim=1)


def unpack_nvfp4(packed: torch.Tensor, hidden: int) -> Nvfp4Rows:
    """uint8 [N, nvfp4_width(H)] -> the rows' codes, block scales and global scales, each contiguous."""
    width = nvfp4_width(hidden)
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != width:
        raise ValueError(f"packed NVFP4 rows must be uint8 [N, {width}] for hidden size {hidden}, got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    half, blocks = hidden // 2, hidden // 2 + hidden // GROUP
    global_scale = packed[:, blocks:width].contiguous().view(torch.float32).view(-1)
    return Nvfp4Rows(packed[:, :half].contiguous(), packed[:, half:blocks].contiguous().view(SCALE_DTYPE),
                     global_scale)


class ExpertRows(NamedTuple):
    """The ExpertInput fields of received rows: ``hidden_states`` (activation rows, FP8 values or NVFP4 codes),
    ``scales`` (FP8's fp32 or NVFP4's e4m3 block scales), ``global_scale`` (NVFP4's fp32 per row)."""

    hidden_states: torch.Tensor
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None


class Payload:
    """A dispatcher's row format, fixed at start-up (``kind``: ``model``, ``fp8`` or ``nvfp4``): ``rows(x)`` what
    is sent for the tokens ``x`` [T, H] (gathered per copy afterwards), ``expert_rows(received)`` the
    ExpertInput fields of received rows."""

    def __init__(self, fp8: bool = False, nvfp4: bool = False) -> None:
        if fp8 and nvfp4:
            raise ValueError("a dispatcher sends FP8 or NVFP4 rows, not both")
        self.kind = "fp8" if fp8 else "nvfp4" if nvfp4 else "model"

    @property
    def fp8(self) -> bool:
        return self.kind == "fp8"

    @property
    def nvfp4(self) -> bool:
        return self.kind == "nvfp4"

    @property
    def quantized(self) -> bool:
        return self.kind != "model"

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.nvfp4:
            return quantize_nvfp4_packed(x)
        return quantize_packed(x) if self.fp8 else x

    def width(self, hidden: int) -> int:
        """Elements per sent row."""
        if self.nvfp4:
            return nvfp4_width(hidden)
        return packed_width(hidden) if self.fp8 else hidden

    def dtype(self, activation: torch.dtype) -> torch.dtype:
        """Element type of the sent rows."""
        return torch.uint8 if self.quantized else activation

    def gather_expert_rows(self, received: torch.Tensor, index: torch.Tensor, total: torch.Tensor, hidden: int
                           ) -> ExpertRows:
        """The masked form of ``expert_rows(received[index])`` (``received``'s rows may be wider than the
        payload's, the payload first): only the ``total`` real rows (a count on the device) are gathered; the
        rows past them are left unwritten (an FP8 payload's scales excepted, which are put in the GEMM's
        layout as a whole); an NVFP4 payload's three parts are gathered each into its own rows."""
        if self.nvfp4:
            n, half, blocks = index.shape[0], hidden // 2, hidden // GROUP
            values, scales, global_scale = (received.new_empty(n, w) for w in (half, blocks, SCALE_BYTES))
            for part, col0 in ((values, 0), (scales, half), (global_scale, half + blocks)):
                gather_real_rows(part, received, index, total, col0)
            return ExpertRows(values, scales.view(SCALE_DTYPE), global_scale.view(torch.float32).view(-1))
        rows = received.new_empty(index.shape[0], hidden)
        gather_real_rows(rows, received, index, total, 0)
        if not self.fp8:
            return ExpertRows(rows)
        scale_bytes = received.new_empty(index.shape[0], packed_width(hidden) - hidden)
        gather_real_rows(scale_bytes, received, index, total, hidden)
        scales = scale_bytes.view(torch.float32)
        return ExpertRows(rows.view(FP8_DTYPE), scales.t().contiguous().t() if is_cuda(received) else scales)

    def expert_rows(self, received: torch.Tensor, hidden: int) -> ExpertRows:
        """Received rows -> the ExpertInput's hidden_states, scales and global_scale."""
        if self.nvfp4:
            return ExpertRows(*unpack_nvfp4(received, hidden))
        return ExpertRows(*unpack(received, hidden)) if self.fp8 else ExpertRows(received)
