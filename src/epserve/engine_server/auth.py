"""The engine's gRPC door: with a token (``--engine-token``, or the API key under ``epserve serve``)
every engine call must carry ``authorization: Bearer TOKEN`` metadata, which the router sends
(:func:`epserve.rpc.convert.auth_metadata`); calls without it end UNAUTHENTICATED."""

from __future__ import annotations

import hmac

import grpc

from epserve.rpc.convert import AUTH_METADATA_KEY


class TokenCheck(grpc.aio.ServerInterceptor):
    """Engine calls need ``authorization: Bearer TOKEN`` metadata (UNAUTHENTICATED otherwise); the
    standard health service stays open (it tells nothing but SERVING / NOT_SERVING)."""

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health."):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == AUTH_METADATA_KEY), "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that refuses the call as UNAUTHENTICATED."""
    message = "missing or wrong engine token (authorization metadata)"

    async def unary(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    codec = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)
