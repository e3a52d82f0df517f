"""What prefill/decode disaggregation moves between engines: the KV layout both sides must share,
the blocks a decode instance waits for, and a finished prefill's KV with its first token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from epserve.messages.sampling import SamplingParams, TokenLogprobs

KVTransferRole = Literal["send", "receive"]


@dataclass(frozen=True)
class KVLayout:
    """What both sides must agree on for blocks to be copied as bytes."""

    num_layers: int  # cached layers (an MTP draft layer included)
    block_size: int  # tokens per block
    token_bytes: int  # bytes of one token in one layer
    dtype: str  # the cache's element type (``bfloat16``, ``float32``, ``fp8_e4m3``, ...)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.block_size * self.token_bytes

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks of ``other`` cannot be written into this layout (None: they can)."""
        if other == self:
            return None
        return (f"KV layouts differ: {other.num_layers} layers x {other.block_size}-token blocks of "
                f"{other.token_bytes} bytes ({other.dtype}) vs {self.num_layers} x {self.block_size} of "
                f"{self.token_bytes} ({self.dtype})")


@dataclass(frozen=True)
class KVWanted:
    """Decode side: blocks ``[first_block, first_block + num_blocks)`` of the request are allocated and
    wait for their KV (blocks before ``first_block`` are this instance's own prefix-cache hit)."""

    request_id: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class PrefilledKV:
    """A finished prefill's KV and the first token it sampled: copied out of the prefill instance's
    cache (``LLMEngine.export_kv``, its request id) and handed to the decode instance
    (``LLMEngine.receive_kv``, the decode side's id). ``data``: uint8 ``[layers, blocks, block_size,
    token_bytes]``, on the host, of the request's blocks from ``first_block`` on (those of its
    :class:`KVWanted`)."""

    request_id: str
    first_block: int
    data: torch.Tensor  # uint8, on the host
    first_token: int
    logprobs: TokenLogprobs | None  # when the request asked for logprobs
    num_cached_tokens: int  # the prefill instance's prefix-cache hit (what usage reports)


@dataclass(frozen=True)
class PrefillJob:
    """What a decode instance asks of a prefill instance for one request (its blocks from
    ``first_block`` on, in the decode instance's layout)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    first_block: int  # blocks before it are the decode instance's own prefix-cache hit
    num_blocks: int  # blocks to receive
    layout: KVLayout  # the decode instance's
