"""Issue 45 (7): a row whose every token is masked (its stop tokens covering the vocabulary under
``min_tokens``, or any mask leaving nothing) used to draw token 0 silently. The sampler now reads such a
row back as empty with the tokens (no transfer of its own), the sampling pipeline fails its request with
the reason, and what is decidable from the parameters alone is named up front (:func:`no_token_left`)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from epserve import LLM
from epserve.engine.batch_plan import BatchPlan
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.sampler import Sampler
from epserve.engine.sampling import NO_TOKEN_LEFT, SamplingPipeline, no_token_left
from epserve.messages.sampling import SamplingParams

V = 16
NEG_INF = float("-inf")


def _logits() -> torch.Tensor:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    logits[1] = NEG_INF  # nothing left
    logits[3, :-1] = NEG_INF  # one token left: V - 1
    return logits


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_sampler_reports_an_empty_row_instead_of_drawing_token_0(temperature, logprobs):
    params = [SamplingParams(temperature=temperature, logprobs=logprobs, seed=s) for s in range(4)]
    out = Sampler().sample(_logits(), params, [None] * 4)
    assert out.empty_rows == (1,)
    assert out.token_ids[1] == 0 and out.token_ids[3] == V - 1 and all(0 <= t < V for t in out.token_ids)
    if logprobs is not None:
        assert [lp.token_id for lp in out.logprobs] == out.token_ids  # type: ignore[union-attr]
    assert Sampler().sample(torch.zeros(2, V), params[:2], [None] * 2).empty_rows == ()


@pytest.fixture(scope="module")
def head(tiny_ckpt):
    llm = LLM(tiny_ckpt, dtype="float32", num_blocks=64)
    return llm.engine.config, llm.engine.runner.model.compute_logits


def _decode(rid: str, params: SamplingParams, eos: tuple[int, ...]) -> ScheduledChunk:
    request = Request(rid, [1, 2, 3], params, eos_token_ids=eos)
    request.append_output_token(4)
    return ScheduledChunk(request, request.num_tokens - 1, 1, ())


def test_a_request_whose_stop_tokens_cover_the_vocabulary_under_min_tokens_fails(head):
    """The logits processor masks every token of the row (stop ids under min_tokens): the pipeline fails
    that request with the reason; its neighbour is drawn as before; the failure is taken once."""
    config, compute_logits = head
    vocab, eos = config.model.vocab_size, config.model.eos_token_ids
    pipeline = SamplingPipeline(config, compute_logits, torch.device("cpu"))
    stopped = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=4, stop_token_ids=tuple(range(vocab)))
    chunks = [_decode("fine", replace(stopped, min_tokens=0), eos), _decode("masked", stopped, eos)]
    hidden = torch.randn(2, config.model.hidden_size, generator=torch.Generator().manual_seed(0))
    result = pipeline.sample(chunks, hidden, BatchPlan(logits_indices=(0, 1)))
    assert result.sampled["fine"] == compute_logits(hidden[:1]).argmax(-1).item()
    assert pipeline.take_failures() == {"masked": NO_TOKEN_LEFT}
    assert pipeline.take_failures() == {}
    pipeline.sample(chunks, hidden, BatchPlan(logits_indices=(0, 1)))
    pipeline.release("masked")  # (a request released meanwhile: nothing to report)
    assert pipeline.take_failures() == {}


def test_no_token_left_names_the_fields():
    eos = (2,)
    every = tuple(range(V))
    assert "bad_words" in no_token_left(SamplingParams(bad_words=tuple((t,) for t in every)), V, eos)
    why = no_token_left(SamplingParams(min_tokens=1, stop_token_ids=every[:-1]), V, (V - 1,))
    assert why is not None and "min_tokens 1: stop_token_ids and EOS cover every token" in why
    split = SamplingParams(min_tokens=2, stop_token_ids=every[:8], bad_words=tuple((t,) for t in every[8:]))
    why = no_token_left(split, V, eos)
    assert why is not None and "stop_token_ids and EOS with bad_words" in why
    assert no_token_left(SamplingParams(min_tokens=1, stop_token_ids=every[:-1], ignore_eos=True), V, (V - 1,)) is None
    assert no_token_left(SamplingParams(stop_token_ids=every), V, eos) is None  # (no min_tokens: it may stop)
    assert no_token_left(SamplingParams(min_tokens=1, stop_token_ids=every[:-1]), V, ()) is None
    assert no_token_left(SamplingParams(max_tokens=0, bad_words=tuple((t,) for t in every)), V, eos) is None


@pytest.mark.parametrize("speculative", [None, "mtp"])
def test_an_engine_refuses_what_is_decidable_and_aborts_a_row_left_empty(tiny_ckpt, speculative):
    """Through the engine: parameters that leave no token at all are refused where the request enters (the
    router answers such a RequestError with a 400); a row emptied only by what was drawn (a two-token bad
    word X X after the only allowed token X) fails the request, where it drew token 0 before. With MTP the
    row left empty is a verification row: it fails the request too (it emitted a banned token 0 before)."""
    from epserve.engine.engine import RequestError

    llm = LLM(tiny_ckpt, dtype="float32", num_blocks=64, **({"speculative": speculative} if speculative else {}))
    vocab = llm.engine.config.model.vocab_size
    x = 7
    with pytest.raises(RequestError, match="bad_words ban every token"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, bad_words=tuple((t,) for t in range(vocab))))
    only_x = tuple((t,) for t in range(vocab) if t != x)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, bad_words=only_x)
    assert llm.generate([[1, 2, 3]], params)[0].token_ids == [x, x, x]
    with pytest.raises(RequestError, match="leave no token allowed"):  # (offline, a failed request raises)
        llm.generate([[1, 2, 3]], replace(params, bad_words=(*only_x, (x, x))))
