"""The CPU implementations of ``kernels.nvfp4``'s ops: ``cpu_nvfp4.c`` and ``cpu_nvfp4_bf16.c`` (the ``kernels.cpu``
library ``NVFP4``, AVX-512F, BW, VBMI and BF16 + FMA), which run NVFP4 weights as ModelOpt stores them, four
bits and two scales a weight decoded in registers, never expanded in memory (W4A16: x stays fp32 or bf16, fp32
accumulation, bf16 rows by exact bf16 products; the result in x's dtype).

``linear`` streams the packed weight and its block scales once for up to ``TILE_M`` rows of x (more rows pass
over each block of weight rows from cache); past :data:`PREFILL_ROWS` fp32 rows (prefill) the C kernel
dequantizes :data:`CHUNK_ROWS` weight rows at a time into fp32 for torch's GEMM, which is faster there (bf16 rows
stay on the kernel's dot products, faster at any size: 256 rows of a 2048 x 2048 weight on one core, 21 ms
against 26 ms dequantized for torch's GEMM and 64 ms the torch reference; fp32, 33 ms against 26 and 45). ``moe_swiglu``
runs the routed experts on rows grouped by expert, the row counts read by the kernel from memory (so a recorded
decode step, ``kernels/cpu_graph.py``, replays with the step's counts); rows past their sum come out zero.

Each ``*_takes`` answers from shapes and dtypes only (so it answers in a trace as well): CPU tensors of the
format's dtypes, contiguous, K a multiple of 16, the library loaded (``EPSERVE_CPU_KERNELS=0``, a CPU without
those instructions or no C compiler: the op's torch reference runs), no gradients. Kernel calls go through
``kernels.cpu._lib``, so a decode step being recorded records them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from epserve.kernels import cpu, cpu_threads

GROUP = 16  # values per e4m3 block scale (kernels.nvfp4.GROUP, which imports this module's checks)
PREFILL_ROWS = 32  # more fp32 rows of x: dequantize a chunk of weight rows for torch's GEMM (measured crossover)
CHUNK_ROWS = 256  # weight rows dequantized at a time for the prefill GEMM (as the reference's chunks)
_ACTIVATIONS = (torch.float32, torch.bfloat16)


def _packed_ok(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dims: int) -> bool:
    """A packed weight [..., N, K/2] uint8 with its e4m3 scales [..., N, K/16] and fp32 global scales [..., S]
    (S dividing N), ``dims`` dimensions, all contiguous CPU tensors."""
    return (weight.dim() == dims and scale.dim() == dims and scale_2.dim() == dims - 1 and weight.dtype == torch.uint8
            and scale.dtype == torch.float8_e4m3fn and scale_2.dtype == torch.float32
            and (2 * weight.shape[-1]) % GROUP == 0 and weight.shape[-1] > 0
            and scale.shape == (*weight.shape[:-1], 2 * weight.shape[-1] // GROUP)
            and scale_2.shape[:-1] == weight.shape[:-2] and scale_2.shape[-1] > 0
            and weight.shape[-2] % scale_2.shape[-1] == 0
            and all(t.device.type == "cpu" and t.is_contiguous() for t in (weight, scale, scale_2)))


def _x_ok(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _ACTIVATIONS and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad))


def linear_takes(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor) -> bool:
    """Whether :func:`linear` takes x [..., K] @ W^T: x fp32 or bf16, W an NVFP4 weight [N, K] (uint8
    [N, K/2], e4m3 [N, K/16], fp32 [S]), K a multiple of 16, all contiguous CPU tensors, the library loaded."""
    return (x.dim() >= 1 and _x_ok(x) and _packed_ok(weight, weight_scale, weight_scale_2, 2)
            and x.shape[-1] == 2 * weight.shape[1] and cpu.available(cpu.NVFP4))


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           weight_scale_2: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype by ``epserve_nvfp4_linear`` (for the calls :func:`linear_takes`
    accepts), or for more than :data:`PREFILL_ROWS` fp32 rows by torch's fp32 GEMM over chunks the C kernel
    dequantized."""
    n, k = weight.shape[0], x.shape[-1]
    rows = x.view(-1, k)
    if rows.shape[0] > PREFILL_ROWS and x.dtype == torch.float32:
        return _prefill(rows, weight, weight_scale, weight_scale_2).view(*x.shape[:-1], n)
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    if rows.shape[0]:
        cpu._lib(cpu.NVFP4).epserve_nvfp4_linear(
            x.data_ptr(), int(x.dtype == torch.bfloat16), rows.shape[0], weight.data_ptr(), weight_scale.data_ptr(),
            weight_scale_2.data_ptr(), weight_scale_2.shape[0], n, k, out.data_ptr(), cpu_threads.threads())
    return out


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, weight_scale_2: torch.Tensor, lo: int, hi: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [lo, hi) of an NVFP4 weight as fp32 [hi - lo, K] (``kernels.nvfp4.dequantize_rows``' values), by the C
    kernel; into ``out`` (fp32, at least that many elements) when given."""
    n, k = weight.shape[0], 2 * weight.shape[1]
    out = torch.empty(hi - lo, k) if out is None else out.view(-1)[: (hi - lo) * k].view(hi - lo, k)
    cpu._lib(cpu.NVFP4).epserve_nvfp4_dequantize(
        weight.data_ptr(), weight_scale.data_ptr(), weight_scale_2.data_ptr(), weight_scale_2.shape[0], n, k, lo, hi,
        out.data_ptr(), cpu_threads.threads())
    return out


def _prefill(rows: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
             weight_scale_2: torch.Tensor) -> torch.Tensor:
    """Many rows: torch's fp32 GEMM against :data:`CHUNK_ROWS` dequantized weight rows at a time (one buffer)."""
    n, k = weight.shape[0], rows.shape[1]
    xf, out = rows.float(), torch.empty(rows.shape[0], n, dtype=rows.dtype)
    buffer = torch.empty(min(n, CHUNK_ROWS) * k)
    for lo in range(0, n, CHUNK_ROWS):
        hi = min(n, lo + CHUNK_ROWS)
        out[:, lo:hi] = F.linear(xf, dequantize(weight, weight_scale, weight_scale_2, lo, hi, buffer))
    return out


def moe_swiglu_takes(x: torch.Tensor, counts: torch.Tensor | list[int], w13: torch.Tensor, w13_scale: torch.Tensor,
                     w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
                     rows_per_expert: float | None = None, masked: bool = False) -> bool:
    """Whether :func:`moe_swiglu` takes the call: x [R, H] fp32 or bf16, counts int64 [E] (or a list of E ints),
    NVFP4 experts w13 [E, 2I, H] and w2 [E, H, I] of matching shapes (H and I multiples of 16), all contiguous
    CPU tensors, the library loaded."""
    if not (x.dim() == 2 and _x_ok(x) and _packed_ok(w13, w13_scale, w13_scale_2, 3)
            and _packed_ok(w2, w2_scale, w2_scale_2, 3)):
        return False
    e, two_i, h = w13.shape[0], w13.shape[1], 2 * w13.shape[2]
    if x.shape[1] != h or two_i % (2 * GROUP) or tuple(w2.shape) != (e, h, two_i // 4):
        return False
    if isinstance(counts, torch.Tensor):
        counts_ok = counts.dtype == torch.int64 and counts.shape == (e,) and counts.is_contiguous()
    else:
        counts_ok = len(counts) == e
    return counts_ok and cpu.available(cpu.NVFP4)


def moe_swiglu(x: torch.Tensor, counts: torch.Tensor | list[int], w13: torch.Tensor, w13_scale: torch.Tensor,
               w13_scale_2: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
               rows_per_expert: float | None = None, masked: bool = False) -> torch.Tensor:
    """The routed experts by ``epserve_nvfp4_moe_swiglu`` (for the calls :func:`moe_swiglu_takes` accepts): the
    counts read by the kernel; rows past their sum zero (also with ``masked``); the tile hint is the GPU
    kernels'. Counts adding up to more than the rows of x are refused (ValueError)."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(list(counts), dtype=torch.int64)
    hidden, inter = w2.shape[1], 2 * w2.shape[2]
    out = torch.empty(x.shape[0], hidden, dtype=x.dtype)
    code = cpu._lib(cpu.NVFP4).epserve_nvfp4_moe_swiglu(
        x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], counts.data_ptr(), counts.shape[0], w13.data_ptr(),
        w13_scale.data_ptr(), w13_scale_2.data_ptr(), w13_scale_2.shape[1], w2.data_ptr(), w2_scale.data_ptr(),
        w2_scale_2.data_ptr(), w2_scale_2.shape[1], hidden, inter, out.data_ptr(), cpu_threads.threads())
    if code:
        raise ValueError(f"expert row counts {counts.tolist()} add up to more than the {x.shape[0]} rows")
    return out
