"""What both ends of the gRPC engine service share: names, channel options, message conversion."""

from __future__ import annotations

import torch

from epserve.engine.request import SamplingParams
from epserve.engine.sampler import TokenLogprobs
from epserve.moe.stats import ExpertLoad
from epserve.serve.proto import engine_pb2 as pb

SERVICE_NAME = "epserve.engine.v1.Engine"
GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a port already taken is an error, not a silently shared port
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


AUTH_METADATA_KEY = "authorization"  # gRPC metadata keys are lower case


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata a router sends an engine that requires ``token`` (None: no token)."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),) if token else None


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
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
    )


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(token_id: int, msg: pb.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def expert_load_to_proto(load: ExpertLoad) -> pb.GetExpertLoadResponse:
    return pb.GetExpertLoadResponse(
        layers=list(load.layers), num_experts=load.per_expert.shape[1], num_ranks=load.per_rank.shape[1],
        per_expert=load.per_expert.flatten().tolist(), per_rank=load.per_rank.flatten().tolist(),
    )


def expert_load_from_proto(msg: pb.GetExpertLoadResponse) -> ExpertLoad:
    layers = len(msg.layers)
    per_expert = torch.tensor(list(msg.per_expert), dtype=torch.long).view(layers, msg.num_experts)
    per_rank = torch.tensor(list(msg.per_rank), dtype=torch.long).view(layers, msg.num_ranks)
    return ExpertLoad(tuple(msg.layers), per_expert, per_rank)
