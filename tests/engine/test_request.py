from __future__ import annotations

import dataclasses
import math

import pytest

from epserve.engine.request import Request, RequestStatus
from epserve.messages.sampling import SamplingParams


def test_sampling_params_defaults_and_valid_edges() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.logprobs) == (16, 1.0, 0, 1.0, None)
    assert not p.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    for ok in (
        dict(top_k=-1),
        dict(top_p=1.0),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(seed=0),
        dict(max_tokens=1),
    ):
        SamplingParams(**ok)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=21), "logprobs"),
        (dict(stop_token_ids=["7"]), "stop_token_ids"),
        (dict(stop_token_ids=[1.0]), "stop_token_ids"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(seed=1.5), "seed"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=math.nan), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logit_bias={3: True}), "logit_bias"),
        (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
    ],
)
def test_sampling_params_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_token_ids_normalised_to_tuple_and_params_frozen() -> None:
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.stop_token_ids == (3, 4)
    assert isinstance(p.stop_token_ids, tuple)
    assert p == SamplingParams(stop_token_ids=(3, 4))
    hash(p)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


def test_status_finish_reasons() -> None:
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    for s in (RequestStatus.WAITING, RequestStatus.RUNNING):
        assert s.finish_reason is None and not s.is_finished
    assert all(s.is_finished for s in RequestStatus if s.finish_reason is not None)


def test_request_token_bookkeeping() -> None:
    source = [5, 6, 7]
    r = Request("r", source, SamplingParams(max_tokens=4), eos_token_ids=[2])
    source.append(99)  # the request keeps its own copy
    assert r.prompt_token_ids == [5, 6, 7]
    assert r.eos_token_ids == (2,)
    assert r.status is RequestStatus.WAITING and not r.is_finished and r.finish_reason is None
    view = r.all_token_ids
    r.append_output_token(8)
    r.append_output_token(9, logprobs="lp")
    assert r.all_token_ids is view  # no copy per step
    assert view == [5, 6, 7, 8, 9]
    assert r.prompt_token_ids == [5, 6, 7]
    assert r.output_token_ids == [8, 9]
    assert r.output_logprobs == ["lp"]
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (5, 3, 2)
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"


def test_request_arrival_time_is_monotonic_default() -> None:
    a = Request("a", [1])
    b = Request("b", [1])
    assert a.arrival_time <= b.arrival_time
    assert Request("c", [1], arrival_time=3.5).arrival_time == 3.5
