"""Build the model on the meta device and materialize each tensor once, in its runtime dtype, on its
device, from this rank's shard of a Hugging Face checkpoint.

Loading reads only what a rank keeps: its own routed experts (through the expert placement), its TP
heads (a row range of the per-head projections, read directly; ``o_proj``'s columns through one
temporary), and, on a DP group's leader only, the LM head. With FP8 weights kept, FP8 tensors and
their tile scales are read as stored straight into the parameters; dequantized, each tensor passes
through one fp32 temporary. An NVFP4 checkpoint's four-bit modules (``model.quantization.nvfp4_quantized``)
are read as stored too: packed uint8 weights, e4m3 block scales and the fp32 global and input scales, each
part of a fused linear into its rows (or, for a scalar, its entry). Peak memory is about the weights kept plus
one tensor.

Our parameter layout differs from the checkpoint's in three places, all resolved by the per-rank plan
(``model/load_plan.py``, which also builds the model on the meta device): q_a_proj and kv_a_proj_with_mqa
are fused into one GEMM, gate/up projections are fused, and routed experts are stacked per rank in the
order of the expert placement. This module materializes the plan.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable, Iterator

import torch

from epserve.checkpoint import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    CheckpointError,
    CheckpointReader,
    fp8_block_dequantize,
    fp8_block_quantize,
    iter_with_progress,
    progress_enabled,
)
from epserve.config import ModelConfig
from epserve.kernels.fp8 import BLOCK
from epserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from epserve.model.load_plan import (
    ABSORBED,
    DERIVED,
    MTP_VOCAB,
    OPTIONAL,
    Piece,
    build_on_meta,
    empty_like,
    model_bytes,
    named_tensors,
    set_tensor,
    tensor_pieces,
)
from epserve.model.mla import MLAttention
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.context import ParallelContext

logger = logging.getLogger(__name__)

# ---- filling ------------------------------------------------------------------------------------


def _read(reader: CheckpointReader, piece: Piece) -> torch.Tensor:
    """A piece's source rows and columns, dequantized to fp32 if stored FP8 (one temporary)."""
    name = piece.source
    if reader.is_fp8(name):
        rows = piece.rows
        aligned = rows is None or rows[0] % reader.block_size[0] == 0
        w = reader.get_raw(name, rows=rows if aligned else None)
        scale = reader.get_raw(name + SCALE_SUFFIX, rows=piece.scaled().rows if aligned and rows else None)
        try:
            t = fp8_block_dequantize(w, scale, reader.block_size)
        except ValueError as e:
            raise CheckpointError(f"cannot dequantize {name!r}: {e}") from None
        if not aligned:
            t = t[rows[0] : rows[1]]
    else:
        t = reader.get_raw(name, rows=piece.rows)
    return t if piece.cols is None else t[:, piece.cols[0] : piece.cols[1]]


def _whole_tiles(reader: CheckpointReader, piece: Piece) -> bool:
    """Whether ``piece`` takes every column and its rows start on a tile (it reads whole tile rows)."""
    return piece.cols is None and (piece.rows is None or piece.rows[0] % reader.block_size[0] == 0)


def _dequantize_into(reader: CheckpointReader, piece: Piece, dst: torch.Tensor, name: str) -> None:
    """Dequantize an FP8 ``piece`` of whole tile rows straight into ``dst`` (no full-size temporary)."""
    rows = piece.rows
    _check(piece, _rows_shape(reader, piece), tuple(dst.shape), name)
    w = reader.get_raw(piece.source, rows=rows)
    scale = reader.get_raw(piece.source + SCALE_SUFFIX, rows=piece.scaled().rows if rows else None)
    try:
        fp8_block_dequantize(w, scale, reader.block_size, out=dst)
    except ValueError as e:
        raise CheckpointError(f"cannot dequantize {piece.source!r}: {e}") from None


def _check(piece: Piece, got: tuple[int, ...], want: tuple[int, ...], name: str) -> None:
    if got != want:
        raise CheckpointError(f"checkpoint tensor {piece.source!r} (for {name}) has shape {got}, expected {want}")


def _check_stored_dtype(reader: CheckpointReader, piece: Piece, dtype: torch.dtype, name: str) -> None:
    """Refuse a tensor stored in another dtype than ``dtype`` (its first row read to tell)."""
    stored = reader.get_raw(piece.source, rows=(0, 1) if reader.shape(piece.source) else None).dtype
    if stored != dtype:
        raise CheckpointError(f"checkpoint tensor {piece.source!r} (for {name}) is stored {stored}, expected {dtype}")


def _copy_stored(reader: CheckpointReader, part: Piece, out: torch.Tensor, name: str) -> None:
    """``part`` of a checkpoint tensor, as stored (cast to ``out``'s dtype if it differs), into ``out``:
    rows read straight into it where they can be (``CheckpointReader.read_into``), columns through one
    temporary."""
    if part.cols is None:
        _check(part, _rows_shape(reader, part), tuple(out.shape), name)
        reader.read_into(part.source, out, part.rows)
    else:
        t = reader.get_raw(part.source, rows=part.rows)[:, part.cols[0] : part.cols[1]]
        _check(part, tuple(t.shape), tuple(out.shape), name)
        out.copy_(t)


def _fill(reader: CheckpointReader, name: str, target: torch.Tensor, scale: torch.Tensor | None,
          pieces: list[Piece]) -> None:
    """Fill ``target`` (and its tile ``scale`` when FP8) from ``pieces``."""
    for piece in pieces:
        dst = target[piece.index] if piece.index else target
        dst = dst[piece.dst_rows[0] : piece.dst_rows[1]] if piece.dst_rows else dst
        stored_fp8 = reader.is_fp8(piece.source)
        if scale is not None and stored_fp8:  # FP8 kept: weight and scales as stored
            if reader.block_size != (BLOCK, BLOCK):
                raise CheckpointError(f"{piece.source!r}: FP8 blocks {reader.block_size}, expected {(BLOCK, BLOCK)}")
            _copy_stored(reader, piece, dst, name)
            _copy_stored(reader, piece.scaled(), _scale_view(scale, piece), name)
        elif scale is None and not stored_fp8:  # as stored, cast to the runtime dtype
            if dst.dtype in (torch.uint8, FP8_DTYPE):  # NVFP4's packed weights and block scales: never cast
                _check_stored_dtype(reader, piece, dst.dtype, name)
            _copy_stored(reader, piece, dst, name)
        elif scale is None and _whole_tiles(reader, piece):  # FP8 dequantized straight into the target
            _dequantize_into(reader, piece, dst, name)
        else:  # FP8 dequantized through a temporary, or a higher-precision checkpoint quantized at load
            t = _read(reader, piece)
            _check(piece, tuple(t.shape), tuple(dst.shape), name)
            if scale is None:
                dst.copy_(t)
            else:
                q = fp8_block_quantize(t, (BLOCK, BLOCK))
                dst.copy_(q.weight)
                _scale_view(scale, piece).copy_(q.scale_inv)


def _equal_to(reader: CheckpointReader, pieces: list[Piece], main: torch.Tensor, rows: int = 4096) -> bool:
    """Whether the checkpoint tensor of ``pieces`` (one whole tensor, or none on a rank without a head)
    equals ``main`` in its runtime dtype, compared ``rows`` at a time (no second full copy)."""
    if not pieces:
        return main.shape[0] == 0
    source = pieces[0].source
    if reader.shape(source) != tuple(main.shape) or reader.is_fp8(source):
        return False
    for lo in range(0, main.shape[0], rows):
        hi = min(lo + rows, main.shape[0])
        if not torch.equal(reader.get_raw(source, rows=(lo, hi)).to(main.device, main.dtype), main[lo:hi]):
            return False
    return True


def _scale_view(scale: torch.Tensor, piece: Piece) -> torch.Tensor:
    s = scale[piece.index] if piece.index else scale
    rows = piece.scaled().dst_rows
    return s[rows[0] : rows[1]] if rows else s


def _rows_shape(reader: CheckpointReader, piece: Piece) -> tuple[int, ...]:
    shape = reader.shape(piece.source)
    return shape if piece.rows is None else (piece.rows[1] - piece.rows[0], *shape[1:])


class _ProgressLog:
    """Loading's progress as log lines where stderr is no terminal (systemd, Kubernetes; a terminal gets
    tqdm's bar): one when another tenth of the bytes is in, or after 30 s without one, at most one per
    ``interval_s``; ``load_model``'s last line gives the whole load."""

    def __init__(self, path: str, rank: int, total: int, interval_s: float) -> None:
        self.path, self.rank, self.total, self.interval_s = path, rank, total, interval_s
        self.done = self._logged = 0
        self.start = self._at = time.perf_counter()

    def counted(self, names: list[str], nbytes: dict[str, int]) -> Iterator[str]:
        """``names``, each one's bytes counted once the loop's body is done with it."""
        for name in names:
            yield name
            self.add(nbytes.get(name, 0))

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        quiet = now - self._at
        if quiet >= self.interval_s and (self.done - self._logged >= self.total / 10 or quiet >= 30.0):
            self._at, self._logged = now, self.done
            rate = self.done / max(now - self.start, 1e-9)
            logger.info("loading %s: %.2f of %.2f GiB on rank %d (%.0f%%), %.1f MB/s, about %.0f s left", self.path,
                        self.done / 2**30, self.total / 2**30, self.rank, 100 * self.done / max(self.total, 1),
                        rate / 1e6, (self.total - self.done) / max(rate, 1e-9))


def load_model(
    config: ModelConfig,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    dispatcher: Dispatcher,
    placement: ExpertPlacement,
    ctx: ParallelContext,
    fp8: bool = False,
    mtp: bool = False,
    progress_interval_s: float = 5.0,
) -> DeepseekV3ForCausalLM:
    """Build on the meta device, then materialize every tensor on ``device`` from the checkpoint at
    ``path`` (this rank's experts and heads only); ``fp8``: keep FP8 block-scaled weights; ``mtp``: load
    the MTP layer too (speculative decoding), sharing the main model's embedding and head where the
    checkpoint's copies are equal. Rank 0 shows its progress (a bar on a terminal, else log lines at most
    every ``progress_interval_s``)."""
    start = time.perf_counter()
    reader = CheckpointReader(path)
    mtp_layer = f"model.layers.{config.num_hidden_layers}"
    if mtp and not reader.has(f"{mtp_layer}.eh_proj.weight"):
        raise CheckpointError(f"speculative decoding with MTP needs the MTP layer's tensors ({mtp_layer}.*); "
                              f"the checkpoint at {path} has none")
    model = build_on_meta(config, dtype, fp8, ctx, placement, dispatcher, mtp)
    local_experts = placement.local_logical_experts(ctx.rank)
    tensors = {name: (module, attr, t) for name, module, attr, t in named_tensors(model)}
    shared = []
    names: Iterable[str] = list(tensors)
    if ctx.rank == 0 and not progress_enabled():  # (derived tensors are computed, not loaded)
        nbytes = {n: t.nbytes for n, (_, _, t) in tensors.items() if not n.endswith(DERIVED)}
        names = _ProgressLog(path, ctx.rank, sum(nbytes.values()), progress_interval_s).counted(list(tensors), nbytes)
    for name in iter_with_progress(names, desc="Loading weights", total=len(tensors), disable=ctx.rank != 0):
        module, attr, meta = tensors[name]
        if name.endswith(SCALE_SUFFIX) or name.endswith(DERIVED):
            continue  # scales are filled with their weight; derived tensors computed below
        twin = MTP_VOCAB.get(name.partition(".")[2].partition(".")[2]) if name.startswith("mtp.") else None
        if twin is not None:
            main = getattr(model, twin)
            pieces = tensor_pieces(config, name, tuple(meta.shape), local_experts, ctx)
            if _equal_to(reader, pieces, main):
                set_tensor(module, attr, main)
                shared.append(name)
                continue
        target = empty_like(meta, device)
        scale = None
        if target.dtype == FP8_DTYPE and name + SCALE_SUFFIX in tensors:  # (not NVFP4's e4m3 block scales)
            _, s_attr, s_meta = tensors[name + SCALE_SUFFIX]
            scale = empty_like(s_meta, device)
            set_tensor(module, s_attr, scale)
        pieces = tensor_pieces(config, name, tuple(meta.shape), local_experts, ctx)
        if name.endswith(OPTIONAL) and not all(reader.has(pc.source) for pc in pieces):
            target.fill_(1.0)
        else:
            with torch.no_grad():
                _fill(reader, name, target, scale, pieces)
        set_tensor(module, attr, target)
    reader.close()
    if shared:
        logger.info("MTP layer shares the main model's %s (equal in the checkpoint)", " and ".join(shared))
    for name, module, attr, meta in named_tensors(model):  # derived tensors: allocated, then computed
        if meta.device.type == "meta" and name.endswith(ABSORBED):
            set_tensor(module, attr, empty_like(meta, device))
    model.init_buffers(device)
    for module in model.modules():
        if isinstance(module, MLAttention):
            module.prepare()
    if device.type == "cuda":  # (on the CPU every temporary is already freed: no reference cycles)
        gc.collect()
        torch.cuda.empty_cache()
    size, seconds = model_bytes(model), time.perf_counter() - start
    logger.info("loaded %s: %.2f GiB on rank %d (%s weights) in %.1f s, %.1f MB/s", path, size / 2**30, ctx.rank,
                "FP8" if fp8 else str(dtype).removeprefix("torch."), seconds, size / max(seconds, 1e-9) / 1e6)
    return model.eval()
