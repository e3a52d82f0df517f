"""The router's side of the gRPC engine service: one async client per engine instance. An engine message
with many logprobs (a long prompt's ``prompt_logprobs``) is read back on a worker thread, not on the event
loop: reading one entry costs about a microsecond, and such a message can hold a million."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epserve.messages.engine import GeneratedTokens
from epserve.messages.sampling import SamplingParams
from epserve.router.response_body import LARGE_COST
from epserve.rpc.convert import SERVICE_NAME, generate_request_to_proto, generated_from_proto, logprob_entries
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import engine_channel, handshake_refused

# Codes that say "this instance cannot take the request now" rather than "the request is bad".
# UNAUTHENTICATED too: an engine that refuses us cannot serve us (and the router says why).
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAUTHENTICATED}

# Reads back the engine messages whose logprobs cost more than LARGE_COST entries (every engine client's).
_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epserve-read")


class EngineUnavailable(RuntimeError):
    """The instance is down, unreachable or shutting down."""


class PrefillUnavailable(EngineUnavailable):
    """A decode instance's prefill instance failed or refused before the first token (ABORTED): the
    request may be retried on another prefill instance."""


class EngineRequestError(ValueError):
    """The instance refused the request (bad token ids, too long for its KV cache, …)."""


def _translate(e: grpc.aio.AioRpcError, address: str) -> Exception:
    if e.code() == grpc.StatusCode.ABORTED:
        return PrefillUnavailable(e.details() or "the prefill instance failed")
    if e.code() in _UNAVAILABLE:
        if handshake_refused(e.details()):
            return EngineUnavailable(f"engine {address}: the TLS handshake failed: it does not hold this router's "
                                     "engine token (or speaks plaintext); nothing was sent to it")
        return EngineUnavailable(f"engine {address}: {e.details() or e.code().name}")
    return EngineRequestError(e.details() or e.code().name)


class EngineClient:
    """``token``: the engine token (``--engine-token``): the channel is mutual TLS under it (rpc/security)."""

    def __init__(self, index: int, address: str, token: str | None = None) -> None:
        self.index = index
        self.address = address
        self.channel = engine_channel(address, token, aio=True)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill_address: str = ""
    ) -> AsyncIterator[GeneratedTokens]:
        """The request's stream, in the messages' vocabulary; closing the iterator early cancels the call
        (the engine aborts the request and frees its blocks). Raises EngineUnavailable or EngineRequestError.
        ``prefill_address``: a decode instance gets the prompt's KV from that prefill instance
        (PrefillUnavailable if it fails)."""
        call = self.stub.Generate(generate_request_to_proto(request_id, prompt_token_ids, params, prefill_address),
                                  wait_for_ready=False)
        loop = asyncio.get_running_loop()
        try:
            async for msg in call:
                if logprob_entries(msg) <= LARGE_COST:
                    yield generated_from_proto(request_id, prompt_token_ids, msg)
                else:
                    yield await loop.run_in_executor(_READER, generated_from_proto, request_id, prompt_token_ids,
                                                     msg)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from None
        finally:
            call.cancel()  # no-op once the call has finished

    async def _unary(self, method: str, request: object, timeout: float):
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise _translate(e, self.address) from None

    async def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        return (await self._unary("Abort", pb.AbortRequest(request_id=request_id), timeout)).found

    async def get_load(self, timeout: float = 2.0) -> pb.GetLoadResponse:
        return await self._unary("GetLoad", pb.GetLoadRequest(), timeout)

    async def get_info(self, timeout: float = 2.0) -> pb.GetInfoResponse:
        return await self._unary("GetInfo", pb.GetInfoRequest(), timeout)

    async def get_expert_load(self, timeout: float = 10.0) -> pb.GetExpertLoadResponse:
        return await self._unary("GetExpertLoad", pb.GetExpertLoadRequest(), timeout)

    async def is_serving(self, timeout: float = 2.0) -> bool:
        """The standard grpc.health.v1 check of the engine service."""
        try:
            reply = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()
