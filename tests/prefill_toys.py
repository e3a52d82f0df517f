"""A fake prefill instance for the disaggregation tests: it holds the engine token (so a decode instance
takes its calls) but answers ``Prefill`` with a reply malformed one way (:data:`MALFORMED`)."""

from __future__ import annotations

from concurrent import futures

import grpc

from epserve.rpc.convert import GRPC_OPTIONS
from epserve.rpc.proto import engine_pb2 as pb
from epserve.rpc.proto import engine_pb2_grpc as pb_grpc
from epserve.rpc.security import listen

# Each way a reply can be malformed, and the logprobs the request asks for (None or k); everything
# else about the reply is right (zero blocks of the size wanted, a first token in the vocabulary).
MALFORMED = {
    "first_token_out_of_vocab": None,
    "cached_tokens_past_the_prompt": None,
    "one_block_too_many": None,
    "a_chunk_one_byte_short": None,
    "kv_nan": None,  # every byte 0xFF: NaN in bf16, fp16, fp32 and e4m3 alike
    "logprobs_not_asked_for": None,
    "logprobs_missing": 2,
    "logprob_nan": 2,
    "top_logprob_infinite": 2,
    "more_top_logprobs_than_asked": 2,
    "top_logprob_out_of_vocab": 2,
}


class FakePrefill(pb_grpc.EngineServicer):
    """``Prefill`` answers as ``mode`` says (counted in ``calls``); ``GetInfo`` and ``GetLoad`` are those
    of ``real`` (a real instance that prefills), so a router takes it for a prefill instance."""

    def __init__(self, real: pb_grpc.EngineStub, vocab_size: int) -> None:
        self.real, self.vocab_size = real, vocab_size
        self.mode = "first_token_out_of_vocab"
        self.calls = 0

    def GetInfo(self, request, context):  # noqa: N802
        return self.real.GetInfo(request, timeout=10)

    def GetLoad(self, request, context):  # noqa: N802
        return self.real.GetLoad(request, timeout=10)

    def Prefill(self, request, context):  # noqa: N802
        self.calls += 1
        mode, vocab, layout, prompt = self.mode, self.vocab_size, request.layout, request.prompt_token_ids
        block_bytes = layout.num_layers * layout.block_size * layout.token_bytes
        num_blocks = -(-len(prompt) // layout.block_size) - request.first_block + (mode == "one_block_too_many")
        size = num_blocks * block_bytes - (mode == "a_chunk_one_byte_short")
        data = b"\xff" * size if mode == "kv_nan" else bytes(size)
        yield pb.KVChunk(first_block=request.first_block, num_blocks=num_blocks, data=data)
        last = pb.KVChunk(done=True, first_token=vocab + 5 if mode == "first_token_out_of_vocab" else 7,
                          num_cached_tokens=len(prompt) + 1 if mode == "cached_tokens_past_the_prompt" else 0)
        k = request.sampling_params.logprobs if request.sampling_params.HasField("logprobs") else 0
        lp = pb.TokenLogprob(logprob=float("nan") if mode == "logprob_nan" else -0.5,
                             top=[pb.TopLogprob(token_id=7 + i, logprob=-0.5 - i) for i in range(k)])
        if mode == "top_logprob_infinite":
            lp.top[-1].logprob = float("-inf")
        if mode == "more_top_logprobs_than_asked":
            lp.top.append(pb.TopLogprob(token_id=20, logprob=-9.0))
        if mode == "top_logprob_out_of_vocab":
            lp.top[-1].token_id = vocab + 1
        if (k and mode != "logprobs_missing") or mode == "logprobs_not_asked_for":
            last.first_logprob.CopyFrom(lp)
        yield last


def serve_fake_prefill(real: pb_grpc.EngineStub, vocab_size: int, token: str) -> tuple[FakePrefill, str, grpc.Server]:
    """A :class:`FakePrefill` listening on a free loopback port under ``token``: it, its address, its server."""
    fake = FakePrefill(real, vocab_size)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    pb_grpc.add_EngineServicer_to_server(fake, server)
    port = listen(server, "127.0.0.1:0", token)
    server.start()
    return fake, f"127.0.0.1:{port}", server
