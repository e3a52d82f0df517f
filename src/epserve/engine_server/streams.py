"""A Generate or Prefill call's messages on the leader's gRPC loop: what the step loop delivered and
the call has not sent yet, and a slow reader's pile-up merged into one message."""

from __future__ import annotations

import asyncio
import collections

from epserve.messages.engine import RequestFailed
from epserve.messages.kv import PrefilledKV
from epserve.rpc.proto import engine_pb2 as pb


class ResponseStream:
    """One Generate call's messages not yet sent (on the gRPC loop only; a reader that fell behind
    takes everything at once and sends it as one message)."""

    __slots__ = ("items", "ready")

    def __init__(self) -> None:
        self.items: collections.deque[pb.GenerateResponse | RequestFailed | PrefilledKV] = collections.deque()
        self.ready = asyncio.Event()

    def push(self, item: pb.GenerateResponse | RequestFailed | PrefilledKV) -> None:
        self.items.append(item)
        self.ready.set()

    async def take(self) -> list[pb.GenerateResponse | RequestFailed | PrefilledKV]:
        await self.ready.wait()
        self.ready.clear()
        items = list(self.items)
        self.items.clear()
        return items


def merge_responses(msgs: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """Messages a slow reader let pile up, as one (tokens and logprobs in order, the latest counts)."""
    merged = pb.GenerateResponse()
    merged.CopyFrom(msgs[-1])
    del merged.token_ids[:]
    del merged.logprobs[:]
    del merged.prompt_logprobs[:]
    for m in msgs:
        merged.token_ids.extend(m.token_ids)
        merged.logprobs.extend(m.logprobs)
        merged.prompt_logprobs.extend(m.prompt_logprobs)
    return merged
