"""What both ends of the gRPC engine service share: names, channel options, and every conversion between
the message vocabulary (``epserve.messages``) and the protocol's messages. (The KV blocks themselves are
framed into ``KVChunk`` bytes by ``engine_server/kv_transport.py``, the one side that holds tensors.)"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

from epserve.messages.engine import EngineLoad, GeneratedTokens, RequestTimes
from epserve.messages.expert_load import ExpertLoad
from epserve.messages.kv import KVLayout, PrefillJob
from epserve.messages.sampling import SamplingParams, StructuredOutput, TokenLogprobs
from epserve.rpc.proto import engine_pb2 as pb

SERVICE_NAME = "epserve.engine.v1.Engine"
GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a port already taken is an error, not a silently shared port
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]
# Upper bounds (seconds) of the transfer-time histogram: engines report cumulative counts per bound.
KV_TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in p.logit_bias],
        min_tokens=p.min_tokens,
        bad_words=[pb.TokenIds(token_ids=w) for w in p.bad_words],
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.repetition_penalty != 1.0:
        msg.repetition_penalty = p.repetition_penalty
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        msg.structured.kind, msg.structured.spec = p.structured.kind, p.structured.spec
    return msg


def sampling_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """ValueError for values SamplingParams refuses."""
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple((b.token_id, b.bias) for b in p.logit_bias),
        min_tokens=p.min_tokens,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        bad_words=tuple(tuple(w.token_ids) for w in p.bad_words),
        structured=StructuredOutput(p.structured.kind, p.structured.spec) if p.HasField("structured") else None,
    )


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(token_id: int, msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(token_id, msg.logprob, tuple(map(_TOP_PAIR, msg.top)))


_TOP_PAIR = operator.attrgetter("token_id", "logprob")  # a TopLogprob as (token id, logprob)


def logprob_entries(msg: pb.GenerateResponse) -> int:
    """How many logprob entries (a token's and each of its top ones) reading ``msg`` back converts: its
    cost, told without reading them (a message's entries all have as many top ones as it asked for)."""
    num_tokens = len(msg.logprobs) + len(msg.prompt_logprobs)
    if not num_tokens:
        return 0
    return num_tokens * (1 + len((msg.prompt_logprobs or msg.logprobs)[0].top))


def expert_load_to_proto(load: ExpertLoad) -> pb.GetExpertLoadResponse:
    return pb.GetExpertLoadResponse(
        layers=list(load.layers), num_experts=len(load.per_expert[0]) if load.per_expert else 0,
        num_ranks=len(load.per_rank[0]) if load.per_rank else 0,
        per_expert=[n for row in load.per_expert for n in row], per_rank=[n for row in load.per_rank for n in row],
    )


def _rows(flat: list[int], num_rows: int, width: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(flat[i * width:(i + 1) * width]) for i in range(num_rows))


def expert_load_from_proto(msg: pb.GetExpertLoadResponse) -> ExpertLoad:
    layers = len(msg.layers)
    return ExpertLoad(tuple(msg.layers), _rows(list(msg.per_expert), layers, msg.num_experts),
                      _rows(list(msg.per_rank), layers, msg.num_ranks))


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(num_layers=layout.num_layers, block_size=layout.block_size,
                       token_bytes=layout.token_bytes, dtype=layout.dtype)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.num_layers, msg.block_size, msg.token_bytes, msg.dtype)


def generate_request_to_proto(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                              prefill_address: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                              sampling_params=sampling_to_proto(params), prefill_address=prefill_address)


def generated_to_proto(out: GeneratedTokens) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        token_ids=out.token_ids, num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=out.num_output_tokens, finish_reason=out.finish_reason or "",
    )
    msg.logprobs.extend(logprob_to_proto(lp) for lp in out.logprobs)
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprob_to_proto(lp) for lp in out.prompt_logprobs)
    if out.times is not None:
        msg.queued_seconds, msg.prefill_seconds, msg.decode_seconds = (
            out.times.queued_s, out.times.prefill_s, out.times.decode_s)
    return msg


def generated_from_proto(request_id: str, prompt_token_ids: Sequence[int], msg: pb.GenerateResponse) -> GeneratedTokens:
    """The router's side of ``generated_to_proto``. The protocol carries no token ids with the logprobs:
    they are the message's tokens (and the prompt's, from its second, for ``prompt_logprobs``); and no
    presence for the times: a message whose three times are zero has none."""
    times = None
    if msg.queued_seconds or msg.prefill_seconds or msg.decode_seconds:
        times = RequestTimes(msg.queued_seconds, msg.prefill_seconds, msg.decode_seconds)
    return GeneratedTokens(
        request_id, tuple(msg.token_ids), tuple(map(logprob_from_proto, msg.token_ids, msg.logprobs)),
        msg.num_prompt_tokens, msg.num_cached_tokens, msg.num_output_tokens, msg.finish_reason or None,
        tuple(map(logprob_from_proto, prompt_token_ids[1:], msg.prompt_logprobs)), times)


def load_to_proto(load: EngineLoad, **kv_transfer_fields: object) -> pb.GetLoadResponse:
    """A leader's load figures, with its KV-transfer counters (``KVTransferStats.proto_fields``)."""
    return pb.GetLoadResponse(**dataclasses.asdict(load), **kv_transfer_fields)


def prefill_job_to_proto(job: PrefillJob) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
                             sampling_params=sampling_to_proto(job.params), first_block=job.first_block,
                             layout=layout_to_proto(job.layout))
