"""Hugging Face–format DeepSeek-V3 checkpoints: FP8 block (de)quantization (``fp8``), safetensors files
read without a memory map (``files``), the lazy sharded reader (``reader``) and the writer (``writer``)."""

from epserve.checkpoint.fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SCALE_SUFFIX,
    Fp8Weight,
    fp8_block_dequantize,
    fp8_block_quantize,
)
from epserve.checkpoint.reader import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    CheckpointReader,
    as_torch_dtype,
    iter_with_progress,
    progress_enabled,
)
from epserve.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, save_checkpoint

__all__ = [
    "CONFIG_FILE", "DEFAULT_BLOCK", "DEFAULT_MAX_SHARD_BYTES", "FP8_DTYPE", "FP8_MAX", "INDEX_FILE", "SCALE_SUFFIX",
    "SINGLE_FILE", "CheckpointError", "CheckpointReader", "Fp8Weight", "as_torch_dtype", "fp8_block_dequantize",
    "fp8_block_quantize", "iter_with_progress", "progress_enabled", "save_checkpoint",
]
