"""Moving a request's latent KV from a prefill instance to a decode instance, engine to engine.

:class:`KVTransport` is the channel's interface: the prefill side *sends* a finished prefill's
blocks (:meth:`KVTransport.send`, copied out of its cache by the step loop) and the decode side
*receives* them for blocks it has already allocated (:meth:`KVTransport.receive`), with completion
(the arrival) or failure (:class:`KVTransferError`). :class:`GrpcKVTransport` streams the blocks over
the engines' gRPC service (the decode instance calls ``Prefill`` on the prefill instance, which
answers with the blocks in :class:`~epserve.rpc.proto.engine_pb2.KVChunk` messages, then the first
token). A GPU deployment would put NIXL/UCX (RDMA reads straight into the allocated blocks) or NCCL
behind the same interface.
"""

from __future__ import annotations

import asyncio
import bisect
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import torch

from epserve.messages.kv import PrefilledKV, PrefillJob
from epserve.rpc.convert import (
    KV_TRANSFER_BUCKETS,
    logprob_from_proto,
    logprob_to_proto,
    prefill_job_to_proto,
)
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import engine_channel

CHUNK_BYTES = 4 << 20  # blocks per KVChunk message: as many as fit in this (at least one)


class KVTransferError(RuntimeError):
    """A transfer failed or was refused; the decode instance fails the request so that the router can
    retry it on another prefill instance (``invalid``: the prefill instance refused the request itself,
    e.g. a prompt too long for its cache: the client gets the refusal, not a retry)."""

    def __init__(self, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.invalid = invalid


def check_prefilled(job: PrefillJob, arrival: PrefilledKV, vocab_size: int) -> None:
    """KVTransferError unless ``arrival`` (what a prefill instance sent, through any transport) is a
    well-formed answer to ``job``: its blocks exactly those wanted, in the job's layout, every value in
    them finite (NaN or infinite KV would enter the decode instance's prefix cache and poison every
    later request with that prefix), a first token in the vocabulary, a prefix-cache hit within the
    prompt, and logprobs exactly when asked for (finite, of that token, at most the top ones asked for,
    in the vocabulary). A peer instance's answer is checked like a client's input: what passes cannot
    fail the decode instance's step loop."""
    layout, lp, k = job.layout, arrival.logprobs, job.params.logprobs
    data = arrival.data
    want = (layout.num_layers, job.num_blocks, layout.block_size, layout.token_bytes)

    def bad(why: str) -> KVTransferError:
        return KVTransferError(f"the prefill instance sent a malformed reply: {why}")

    if arrival.request_id != job.request_id or arrival.first_block != job.first_block:
        raise bad(f"request {arrival.request_id!r} from block {arrival.first_block}, "
                  f"{job.request_id!r} from block {job.first_block} wanted")
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or tuple(data.shape) != want:
        raise bad(f"KV data {getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}, "
                  f"uint8 {want} wanted")
    if (layer := _non_finite_layer(data, layout.dtype)) is not None:
        raise bad(f"KV data holds NaN or infinite {layout.dtype} values (cached layer {layer})")
    if not _is_int(arrival.first_token) or not 0 <= arrival.first_token < vocab_size:
        raise bad(f"first token {arrival.first_token!r} is outside the vocabulary [0, {vocab_size})")
    if not _is_int(arrival.num_cached_tokens) or not 0 <= arrival.num_cached_tokens <= len(job.prompt_token_ids):
        raise bad(f"{arrival.num_cached_tokens!r} cached tokens of a {len(job.prompt_token_ids)}-token prompt")
    if k is None:
        if lp is not None:
            raise bad("logprobs the request did not ask for")
        return
    if lp is None:
        raise bad("no logprobs for the first token (the request asked for them)")
    if lp.token_id != arrival.first_token or not _is_logprob(lp.logprob):
        raise bad(f"logprob {lp.logprob!r} of token {lp.token_id!r} for first token {arrival.first_token}")
    if len(lp.top) > k:
        raise bad(f"{len(lp.top)} top logprobs, at most {k} asked for")
    for entry in lp.top:
        if (not isinstance(entry, tuple) or len(entry) != 2 or not _is_int(entry[0])
                or not 0 <= entry[0] < vocab_size or not _is_logprob(entry[1])):
            raise bad(f"top logprob {entry!r} (a token in [0, {vocab_size}) and a finite logprob wanted)")


_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_FP8_NAN = 0x7F  # e4m3fn: exponent and mantissa all ones (either sign) is NaN; it has no infinities


def _non_finite_layer(data: torch.Tensor, dtype: str) -> int | None:
    """The first cached layer of ``data`` (uint8 ``[layers, blocks, block_size, token_bytes]``, the
    cache's bytes) holding a NaN or infinite ``dtype`` value, else None; a layer at a time (a temporary
    of one layer's size, not the transfer's). KVTransferError for an element type it cannot read."""
    for layer, part in enumerate(data):
        if dtype == "fp8_e4m3":
            bad = bool((part & _FP8_NAN).eq(_FP8_NAN).any())
        elif dtype in _KV_DTYPES:
            bad = not bool(part.contiguous().view(_KV_DTYPES[dtype]).isfinite().all())
        else:
            raise KVTransferError(f"cannot check the values of a {dtype} KV cache")
        if bad:
            return layer
    return None


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_logprob(x: object) -> bool:
    return isinstance(x, float | int) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class KVTransferStats:
    """One instance's transfer figures (reported in ``GetLoad``; the router exports them)."""

    bytes_received: int = 0
    bytes_sent: int = 0
    transfers: int = 0
    failures: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(KV_TRANSFER_BUCKETS))

    def received(self, nbytes: int, seconds: float) -> None:
        self.bytes_received += nbytes
        self.transfers += 1
        self.seconds_sum += seconds
        for i in range(bisect.bisect_left(KV_TRANSFER_BUCKETS, seconds), len(KV_TRANSFER_BUCKETS)):
            self.buckets[i] += 1  # cumulative, as Prometheus histograms are

    def proto_fields(self) -> dict[str, object]:
        return dict(kv_transfer_bytes_received=self.bytes_received, kv_transfer_bytes_sent=self.bytes_sent,
                    kv_transfer_seconds_buckets=list(self.buckets), kv_transfer_seconds_sum=self.seconds_sum,
                    kv_transfers_total=self.transfers, kv_transfer_failures_total=self.failures)


class KVTransport(ABC):
    """The KV transfer channel between engine instances (see the module's docstring)."""

    @abstractmethod
    def send(self, export: PrefilledKV) -> Iterator[object]:
        """Prefill side: the messages that carry ``export``'s blocks and first token to the caller."""

    @abstractmethod
    async def receive(self, source: str, job: PrefillJob) -> PrefilledKV:
        """Decode side: have ``source`` (a prefill instance) prefill ``job`` and hand over its blocks;
        KVTransferError when it fails. Cancelling it cancels the prefill. What it returns came from
        another instance, unchecked: the decode side calls :meth:`receive_checked`."""

    async def receive_checked(self, source: str, job: PrefillJob, vocab_size: int) -> PrefilledKV:
        """:meth:`receive`, then :func:`check_prefilled` (on a worker thread: reading every value of a
        long prompt's KV takes a while, and torch lets the event loop run meanwhile): what the decode
        side hands its engine."""
        arrival = await self.receive(source, job)
        await asyncio.to_thread(check_prefilled, job, arrival, vocab_size)
        return arrival

    async def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections."""


class GrpcKVTransport(KVTransport):
    """Blocks streamed over the engine service's ``Prefill`` call (one channel per prefill instance)."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self._channels: dict[str, grpc.aio.Channel] = {}

    def send(self, export: PrefilledKV) -> Iterator[pb.KVChunk]:
        data = export.data
        num_blocks = data.shape[1]
        per_chunk = max(1, CHUNK_BYTES // max(1, data[:, :1].numel()))
        for start in range(0, num_blocks, per_chunk):
            part = data[:, start : start + per_chunk].contiguous()
            yield pb.KVChunk(first_block=export.first_block + start, num_blocks=part.shape[1],
                             data=part.numpy().tobytes())
        last = pb.KVChunk(done=True, first_token=export.first_token, num_cached_tokens=export.num_cached_tokens)
        if export.logprobs is not None:
            last.first_logprob.CopyFrom(logprob_to_proto(export.logprobs))  # type: ignore[arg-type]
        yield last

    def _stub(self, source: str) -> pb_grpc.EngineStub:
        channel = self._channels.get(source)
        if channel is None:
            channel = self._channels[source] = engine_channel(source, self.token, aio=True)
        return pb_grpc.EngineStub(channel)

    async def receive(self, source: str, job: PrefillJob) -> PrefilledKV:
        layout = job.layout
        request = prefill_job_to_proto(job)
        shape = (layout.num_layers, -1, layout.block_size, layout.token_bytes)
        parts: list[torch.Tensor] = []
        next_block = job.first_block
        call = self._stub(source).Prefill(request)
        try:
            async for chunk in call:
                if chunk.done:
                    received = next_block - job.first_block
                    if received != job.num_blocks:
                        raise KVTransferError(f"prefill instance sent {received} KV blocks, {job.num_blocks} wanted")
                    data = (torch.cat(parts, dim=1) if parts else
                            torch.empty(layout.num_layers, 0, layout.block_size, layout.token_bytes, dtype=torch.uint8))
                    logprobs = (logprob_from_proto(chunk.first_token, chunk.first_logprob)
                                if chunk.HasField("first_logprob") else None)
                    return PrefilledKV(job.request_id, job.first_block, data, chunk.first_token, logprobs,
                                       chunk.num_cached_tokens)
                if (chunk.first_block != next_block or len(chunk.data) != chunk.num_blocks * layout.block_bytes
                        or next_block + chunk.num_blocks > job.first_block + job.num_blocks):
                    raise KVTransferError(f"malformed KV chunk (blocks {chunk.first_block}+{chunk.num_blocks}, "
                                          f"{len(chunk.data)} bytes; block {next_block} expected, "
                                          f"{job.first_block}+{job.num_blocks} wanted)")
                parts.append(torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8).view(shape))
                next_block += chunk.num_blocks
            raise KVTransferError("the prefill instance ended the transfer without its first token")
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise KVTransferError(f"the prefill instance refused the request: {e.details()}",
                                      invalid=True) from None
            raise KVTransferError(f"the prefill instance failed: {e.details() or e.code().name}") from None
        finally:
            call.cancel()

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)
