"""The sampling pipeline's greedy shortcut (``engine/sampling.py``): a step whose rows are all plain greedy
takes the argmax of the logits and nothing else, with the tokens the whole path draws; a row that asks for
more (logprobs, a bias, penalties, min_tokens, bad words, a grammar, a temperature) sends its step down the
whole path. In an MTP engine the same holds with drafts: an all plain greedy step verifies them against the
argmax alone. The logits come from the forward where it computed them, else from the head."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from epserve import LLM
from epserve.engine.batch_plan import BatchPlan
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.sampling import SamplingPipeline, argmax_rows, plain_greedy
from epserve.messages.sampling import SamplingParams, StructuredOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [42] * 5]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, dtype="float32", num_blocks=64)


def _decode(rid: str, params: SamplingParams = GREEDY) -> ScheduledChunk:
    request = Request(rid, [1, 2, 3], params)
    request.append_output_token(4)  # a decode: one known token, an output
    return ScheduledChunk(request, request.num_tokens - 1, 1)


def _verifying(rid: str, drafts: tuple[int, ...], params: SamplingParams = GREEDY) -> ScheduledChunk:
    """A decode verifying ``drafts`` (its ``1 + len(drafts)`` rows)."""
    request = Request(rid, [1, 2, 3], params)
    request.append_output_token(4)
    return ScheduledChunk(request, request.num_tokens - 1, 1 + len(drafts), drafts)


def test_an_mtp_engines_greedy_steps_verify_on_the_argmax_alone(llm, monkeypatch):
    """In an MTP engine, a step whose rows are all plain greedy (drafts or none) runs neither the logits
    processor nor the constraints: each request keeps its drafts while they equal the argmax, then the argmax,
    as the whole path gives (a step asking logprobs of every row); a biased request and one asking logprobs
    beside them send the step down the whole path, where the bias holds (its draft, the argmax's loser, is
    accepted) and the logprobs come back."""
    config = replace(llm.engine.config, speculative="mtp", num_speculative_tokens=1)
    model = llm.engine.runner.model
    pipeline = SamplingPipeline(config, model.compute_logits, torch.device("cpu"))
    processed = []
    apply = pipeline.logits_processor.apply
    monkeypatch.setattr(pipeline.logits_processor, "apply", lambda *a, **k: processed.append(1) or apply(*a, **k))
    hidden = torch.randn(5, config.model.hidden_size, generator=torch.Generator().manual_seed(3))
    logits = model.compute_logits(hidden)
    a = logits.argmax(-1).tolist()
    wrong = (a[3] + 1) % config.model.vocab_size
    plan = BatchPlan(logits_indices=tuple(range(5)))
    expected = {"r0": (a[0],), "r1": (a[1], a[2]), "r2": (a[3],)}

    def chunks(params: SamplingParams = GREEDY) -> list[ScheduledChunk]:
        return [_verifying("r0", (), params), _verifying("r1", (a[1],), params), _verifying("r2", (wrong,), params)]

    result = pipeline.sample(chunks(), hidden, plan, logits.clone())
    assert result.sampled == expected and not result.logprobs and not processed  # the shortcut
    assert pipeline.stats.num_drafts == 2 and pipeline.stats.num_accepted_tokens == 1
    whole = pipeline.sample(chunks(replace(GREEDY, logprobs=0)), hidden, plan, logits.clone())
    assert whole.sampled == expected and set(whole.logprobs) == set(expected) and processed
    assert pipeline.sample(chunks()[:1], hidden[:1], BatchPlan(logits_indices=(0,))).sampled == {"r0": (a[0],)}
    favoured = int(logits[3].argmin())
    assert float(logits[3].max() - logits[3].min()) < 100 and float(logits[4].max() - logits[4].min()) < 100
    mixed = [_verifying("r0", (), replace(GREEDY, logprobs=1)), _verifying("r1", (a[1],)),
             _verifying("r2", (favoured,), replace(GREEDY, logit_bias=((favoured, 100.0),)))]
    result = pipeline.sample(mixed, hidden, plan, logits.clone())
    assert result.sampled == {"r0": (a[0],), "r1": (a[1], a[2]), "r2": (favoured, favoured)}
    assert set(result.logprobs) == {"r0"}


def test_plain_greedy_is_greedy_with_nothing_else_asked():
    assert plain_greedy(GREEDY) and plain_greedy(replace(GREEDY, seed=3, ignore_eos=True, stop_token_ids=(7,)))
    for more in (dict(temperature=0.7), dict(logprobs=0), dict(logit_bias=((3, 1.0),)), dict(min_tokens=2),
                 dict(bad_words=((5,),)), dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                 dict(frequency_penalty=0.5), dict(structured=StructuredOutput("regex", "[ab]+"))):
        assert not plain_greedy(replace(GREEDY, **more)), more


def test_the_shortcut_and_the_whole_path_draw_the_same_tokens(llm):
    """The same rows drawn from the head's logits and from the forward's, with and without the shortcut (a
    row asking for logprobs takes the whole path): the same tokens, every row's argmax."""
    pipeline = SamplingPipeline(llm.engine.config, llm.engine.runner.model.compute_logits, torch.device("cpu"))
    hidden = torch.randn(4, llm.engine.config.model.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = llm.engine.runner.model.compute_logits(hidden)
    expected = logits.argmax(-1).tolist()
    plain = [_decode(f"r{i}") for i in range(4)]
    whole = [_decode(f"r{i}", replace(GREEDY, logprobs=0)) for i in range(4)]
    plan = BatchPlan(logits_indices=tuple(range(4)))
    for chunks in (plain, whole):
        for given in (None, logits.clone()):
            result = pipeline.sample(chunks, hidden, plan, given)
            assert [result.sampled[f"r{i}"] for i in range(4)] == expected
            assert bool(result.logprobs) == (chunks is whole)
    result = pipeline.sample(plain[:1] + whole[1:2], hidden[:2], BatchPlan(logits_indices=(0, 1)), logits[:2].clone())
    assert [result.sampled["r0"], result.sampled["r1"]] == expected[:2] and set(result.logprobs) == {"r1"}
    tied = torch.randint(0, 3, logits.shape, generator=torch.Generator().manual_seed(2)).float()  # many equal maxima
    drawn = [pipeline.sample(chunks, hidden, plan, tied.clone()).sampled for chunks in (plain, whole)]
    assert drawn[0] == drawn[1] == {f"r{i}": t for i, t in enumerate(tied.argmax(-1).tolist())}


def test_the_shortcuts_argmax_is_torchs():
    """The first of equal maxima, a NaN before any number, a row of -inf's first entry: as ``torch.argmax``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (16, 5000), generator=g).float()
    x[torch.rand(x.shape, generator=g) < 0.0005] = float("nan")
    x[3], x[4, 7:] = float("-inf"), float("nan")
    assert argmax_rows(x) == x.argmax(-1).tolist() and argmax_rows(x[5:6]) == x[5:6].argmax(-1).tolist()


def test_a_row_that_asks_for_more_takes_its_step_down_the_whole_path(llm):
    """A plain greedy row beside a biased one and one asking for logprobs: the bias and the logprobs hold (the
    shortcut for the step would have dropped both); the plain row gets its argmax."""
    pipeline = SamplingPipeline(llm.engine.config, llm.engine.runner.model.compute_logits, torch.device("cpu"))
    hidden = torch.randn(3, llm.engine.config.model.hidden_size, generator=torch.Generator().manual_seed(1))
    logits = llm.engine.runner.model.compute_logits(hidden)
    favoured = int(logits[1].argmin())
    assert float(logits[1].max() - logits[1].min()) < 100  # the bias makes it the argmax
    chunks = [_decode("plain"), _decode("biased", replace(GREEDY, logit_bias=((favoured, 100.0),))),
              _decode("logprobs", replace(GREEDY, logprobs=1))]
    result = pipeline.sample(chunks, hidden, BatchPlan(logits_indices=(0, 1, 2)), logits.clone())
    assert result.sampled == {"plain": int(logits[0].argmax()), "biased": favoured,
                              "logprobs": int(logits[2].argmax())}
    assert set(result.logprobs) == {"logprobs"} and result.logprobs["logprobs"].token_id == result.sampled["logprobs"]


def test_engine_tokens_are_the_whole_paths(llm):
    """Greedy requests decoded through the shortcut (the CPU graph's logits on a CPU with its kernels) and the
    same requests asking for their logprobs (the whole path): the same tokens; a penalized request beside
    plain greedy ones repeats no token (the penalty held), as it does alone."""
    plain = llm.generate(PROMPTS, GREEDY)
    whole = llm.generate(PROMPTS, replace(GREEDY, logprobs=0))
    assert [o.token_ids for o in plain] == [o.token_ids for o in whole]
    assert [o.token_ids for o in whole] == [[lp.token_id for lp in o.logprobs] for o in whole]
    banned = replace(GREEDY, presence_penalty=2.0, repetition_penalty=1e4)
    alone = llm.generate([[42] * 5], banned)[0].token_ids
    mixed = llm.generate(PROMPTS, [GREEDY, GREEDY, banned])
    assert mixed[2].token_ids == alone and len(set(alone)) == len(alone)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in plain[:2]]
