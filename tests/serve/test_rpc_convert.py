"""Every sampling field and a request's prompt logprobs and times survive the engine's protobuf, both
ways (the router reads the engine's messages back as ``GeneratedTokens``)."""

from __future__ import annotations

import math
import random

from epserve.messages.engine import GeneratedTokens, RequestTimes
from epserve.messages.sampling import SamplingParams, TokenLogprobs
from epserve.rpc import convert
from epserve.rpc.proto import engine_pb2 as pb


def test_sampling_params_round_trip() -> None:
    cases = [
        SamplingParams(),
        SamplingParams(max_tokens=0, prompt_logprobs=0),
        SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.75, min_p=0.125, seed=-3, stop_token_ids=(4, 9),
                       ignore_eos=True, logprobs=2, presence_penalty=-1.5, frequency_penalty=0.25,
                       repetition_penalty=1.125, logit_bias={3: -100.0, 8: 2.5}, min_tokens=5, prompt_logprobs=20,
                       bad_words=[(4,), (5, 6, 7)]),
    ]
    for params in cases:
        assert convert.sampling_from_proto(convert.sampling_to_proto(params)) == params


def test_generated_tokens_carry_prompt_logprobs_and_times() -> None:
    lps = (TokenLogprobs(5, -1.5, ((5, -1.5), (2, -2.0))), TokenLogprobs(6, -0.25, ()))
    out = GeneratedTokens("r", (1,), (), 3, 0, 1, "length", lps, RequestTimes(0.5, 0.25, 2.0))
    msg = convert.generated_to_proto(out)
    assert [(p.logprob, [(t.token_id, t.logprob) for t in p.top]) for p in msg.prompt_logprobs] == [
        (-1.5, [(5, -1.5), (2, -2.0)]), (-0.25, [])]
    assert (msg.queued_seconds, msg.prefill_seconds, msg.decode_seconds) == (0.5, 0.25, 2.0)
    plain = convert.generated_to_proto(GeneratedTokens("r", (1,), (), 3, 0, 1, None))
    assert not plain.prompt_logprobs and plain.decode_seconds == 0


def test_generated_tokens_round_trip() -> None:
    """What the router reads is what the engine sent: the token ids of the logprobs are the message's tokens
    and the prompt's (from its second), which the protocol does not repeat; no times when none were sent."""
    prompt = (9, 5, 6)
    cases = [
        GeneratedTokens("r", (7, 8), (TokenLogprobs(7, -0.5, ((7, -0.5), (3, -1.0))), TokenLogprobs(8, -2.0, ())),
                        3, 1, 2, None, (TokenLogprobs(5, -1.5, ((5, -1.5),)), TokenLogprobs(6, -0.25, ())),
                        RequestTimes(0.5, 0.25, 0.0)),
        GeneratedTokens("r", (4,), (), 3, 0, 3, "stop", (), RequestTimes(0.5, 0.25, 2.0)),
        GeneratedTokens("r", (), (), 3, 0, 3, "abort"),
    ]
    for out in cases:
        assert convert.generated_from_proto("r", prompt, convert.generated_to_proto(out)) == out


def test_logprobs_read_back_as_the_protocol_holds_them() -> None:
    """The top logprobs are read in bulk (``logprob_from_proto``): the same tuples as reading each field,
    proto3's defaults (token 0, logprob 0.0: not on the wire) and -inf included; ``logprob_entries`` tells
    how many entries reading a message back converts, without converting them."""
    rng = random.Random(0)
    top = [(0, 0.0), (5, -math.inf), *[(rng.randrange(1 << 17), -rng.random() * 30) for _ in range(18)]]
    msg = pb.TokenLogprob(logprob=-0.75, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])
    read = convert.logprob_from_proto(3, pb.TokenLogprob.FromString(msg.SerializeToString()))
    assert read == TokenLogprobs(3, -0.75, tuple((t.token_id, t.logprob) for t in msg.top))
    assert read.top[:2] == ((0, 0.0), (5, -math.inf)) and all(type(t) is int for t, _ in read.top)
    assert convert.logprob_from_proto(4, pb.TokenLogprob()) == TokenLogprobs(4, 0.0, ())

    entry = TokenLogprobs(5, -1.5, tuple((t, -1.0) for t in range(20)))
    out = GeneratedTokens("r", (7, 8), (entry, entry), 4, 0, 2, None, (entry,) * 3)
    assert convert.logprob_entries(convert.generated_to_proto(out)) == 5 * 21
    plain = GeneratedTokens("r", (7,), (TokenLogprobs(7, -0.5, ()),), 4, 0, 1, None)
    assert convert.logprob_entries(convert.generated_to_proto(plain)) == 1
    assert convert.logprob_entries(convert.generated_to_proto(GeneratedTokens("r", (7,), (), 4, 0, 1, None))) == 0
