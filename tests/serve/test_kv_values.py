"""Issue 45 (7): a prefill peer's KV blocks are checked for their values, not just their shape: a NaN or
an infinity in any cached layer, in any of the cache's element types, fails the transfer as a malformed
reply (the decode instance fails that request, which a router retries on another prefill instance)
before anything is written to the cache or its prefix cache; finite data of every kind passes."""

from __future__ import annotations

import pytest
import torch

from epserve.engine_server.kv_transport import KVTransferError, check_prefilled
from epserve.messages.kv import KVLayout, PrefilledKV, PrefillJob
from epserve.messages.sampling import SamplingParams

LAYERS, BLOCKS, BLOCK_SIZE, WIDTH = 3, 2, 4, 8  # WIDTH elements a token
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "fp8_e4m3": torch.float8_e4m3fn}


def _job(dtype: str) -> PrefillJob:
    size = DTYPES[dtype].itemsize
    layout = KVLayout(LAYERS, BLOCK_SIZE, WIDTH * size, dtype)
    return PrefillJob("r", tuple(range(BLOCKS * BLOCK_SIZE)), SamplingParams(max_tokens=4), 0, BLOCKS, layout)


def _arrival(values: torch.Tensor) -> PrefilledKV:
    """``values`` [LAYERS, BLOCKS, BLOCK_SIZE, WIDTH] as the cache's bytes."""
    data = values.contiguous().view(torch.uint8).reshape(LAYERS, BLOCKS, BLOCK_SIZE, -1)
    return PrefilledKV("r", 0, data, 7, None, 0)


def _values(dtype: str) -> torch.Tensor:
    """Finite values of every kind the type has: zeros of both signs, subnormals, its largest, small ones."""
    t = DTYPES[dtype]
    info = torch.finfo(t)
    x = torch.randn(LAYERS, BLOCKS, BLOCK_SIZE, WIDTH)
    x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, info.smallest_normal / 4, -info.smallest_normal / 2])
    x[1, 1, 3, :2] = torch.tensor([info.max, -info.max])
    return x.to(t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_kv_passes(dtype):
    check_prefilled(_job(dtype), _arrival(_values(dtype)), vocab_size=512)


@pytest.mark.parametrize("dtype, bad", [(dtype, bad) for dtype in DTYPES for bad in ("nan", "inf", "-inf")
                                        if dtype != "fp8_e4m3" or bad == "nan"])  # (e4m3fn has no infinities)
def test_nan_or_infinite_kv_is_a_malformed_reply(dtype, bad):
    values = _values(dtype)
    values[2, 1, 2, 5] = torch.tensor(float(bad)).to(DTYPES[dtype])
    with pytest.raises(KVTransferError, match=rf"malformed reply: KV data holds NaN or infinite {dtype} values "
                                              r"\(cached layer 2\)"):
        check_prefilled(_job(dtype), _arrival(values), vocab_size=512)


def test_fp8_nan_of_either_sign():
    for byte in (0x7F, 0xFF):
        data = _arrival(_values("fp8_e4m3")).data.clone()
        data[0, 0, 1, 3] = byte
        with pytest.raises(KVTransferError, match="cached layer 0"):
            check_prefilled(_job("fp8_e4m3"), PrefilledKV("r", 0, data, 7, None, 0), vocab_size=512)
