"""What a dispatcher sends: token rows in the activation dtype, or (``--dispatch-dtype fp8``) their FP8
quantization packed with its scales into one row of bytes.

The FP8 payload is the activation quantization the FP8 expert GEMM would apply anyway
(``kernels.fp8.act_quant``: e4m3 values, one fp32 scale per row and 128 columns), done before the
exchange instead of after it, so the experts compute the same numbers while about half the bytes
travel. A row is packed as ``H`` fp8 bytes followed by the ``H/128`` fp32 scales' bytes, one ``uint8``
row of ``H + 4 * ceil(H/128)`` bytes: one exchange carries both, and gloo or NCCL, which refuse
float8, move plain bytes. All-zero rows (a fixed-shape backend's padding) unpack as zero values with
zero scales. Rows are quantized per token, so quantizing the ``T`` tokens once and then copying
rows equals quantizing the ``T*K`` copies.
"""

from __future__ import annotations

import torch

from epserve.config import ConfigError
from epserve.kernels.device import is_cuda
from epserve.kernels.fp8 import BLOCK, FP8_DTYPE, act_quant, cdiv
from epserve.kernels.moe_ops import gather_real_rows

SCALE_BYTES = 4  # one fp32 scale per row and 128 columns


def use_fp8_payload(dispatch_dtype: str, fp8_weights: bool) -> bool:
    """Whether the dispatchers send FP8 rows: ``--dispatch-dtype`` resolved against the weights the engine
    runs. ``auto`` and ``model`` send the activation dtype; ``fp8`` needs FP8 routed-expert weights (their
    GEMM takes the FP8 rows as they arrive) and is a ConfigError otherwise."""
    if dispatch_dtype in ("auto", "model"):
        return False
    if dispatch_dtype != "fp8":
        raise ConfigError(f"unknown dispatch_dtype {dispatch_dtype!r}; choose from auto, fp8, model")
    if not fp8_weights:
        raise ConfigError("dispatch_dtype='fp8' (--dispatch-dtype fp8) needs FP8 routed-expert weights, but this "
                          "engine runs them dequantized (quantization none, or auto off CUDA / for a checkpoint the "
                          "FP8 runtime cannot take); use --quantization fp8 or --dispatch-dtype auto")
    return True


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


class Payload:
    """A dispatcher's row format, fixed at start-up: ``rows(x)`` what is sent for the tokens ``x`` [T, H]
    (gathered per copy afterwards), ``expert_rows(received)`` the ExpertInput fields of received rows."""

    def __init__(self, fp8: bool) -> None:
        self.fp8 = fp8

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return quantize_packed(x) if self.fp8 else x

    def width(self, hidden: int) -> int:
        """Elements per sent row."""
        return packed_width(hidden) if self.fp8 else hidden

    def dtype(self, activation: torch.dtype) -> torch.dtype:
        """Element type of the sent rows."""
        return torch.uint8 if self.fp8 else activation

    def gather_expert_rows(self, received: torch.Tensor, index: torch.Tensor, total: torch.Tensor, hidden: int
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The masked form of ``expert_rows(received[index])`` (``received``'s rows may be wider than the
        payload's, the payload first): only the ``total`` real rows (a count on the device) are gathered; the
        rows past them are left unwritten (an FP8 payload's scales excepted, which are put in the GEMM's
        layout as a whole)."""
        rows = received.new_empty(index.shape[0], hidden)
        gather_real_rows(rows, received, index, total, 0)
        if not self.fp8:
            return rows, None
        scale_bytes = received.new_empty(index.shape[0], packed_width(hidden) - hidden)
        gather_real_rows(scale_bytes, received, index, total, hidden)
        scales = scale_bytes.view(torch.float32)
        return rows.view(FP8_DTYPE), scales.t().contiguous().t() if is_cuda(received) else scales

    def expert_rows(self, received: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Received rows -> (hidden_states, scales) for the ExpertInput."""
        if not self.fp8:
            return received, None
        return unpack(received, hidden)
