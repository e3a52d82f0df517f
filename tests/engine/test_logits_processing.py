"""Logits processing and prompt logprobs in the engine: penalties, ``logit_bias`` and ``min_tokens``
against a torch reference of vLLM's formulas on the same logits, the engine's greedy decode against the
same reference step by step, exactness under MTP verification, ``max_tokens`` 0, and prompt logprobs
against transformers' log-softmax (chunked prefill and prefix-cache hits included)."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.engine.logits_processor import PAGE, LogitsProcessor
from epserve.engine.request import Request
from epserve.engine.sampler import filter_logits
from epserve.engine.spec_decode import Noise, VerifyGroup, draft_tokens, verify
from tests.model.test_model_parity import engine_logits

V = 50


def reference(logits: torch.Tensor, request: Request, extra: tuple[int, ...] = ()) -> torch.Tensor:
    """vLLM v1's sampler, one row, written out plainly: bad words, then min_tokens and logit_bias, then the
    repetition, frequency and presence penalties (on the biased logits)."""
    p = request.sampling_params
    out = logits.clone()
    outputs = [*request.output_token_ids, *extra]
    for word in p.bad_words:
        ends_with_rest = len(outputs) >= len(word) - 1 and tuple(outputs[len(outputs) - len(word) + 1:]) == word[:-1]
        if len(word) == 1 or ends_with_rest:
            out[word[-1]] = float("-inf")
    if len(outputs) < p.min_tokens:
        for t in (*p.stop_token_ids, *(() if p.ignore_eos else request.eos_token_ids)):
            out[t] = float("-inf")
    for t, b in p.logit_bias:
        out[t] += b
    counts = torch.zeros(out.shape[-1])
    for t in outputs:
        counts[t] += 1
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(outputs) | set(request.prompt_token_ids)))
        out[seen] = torch.where(out[seen] > 0, out[seen] / p.repetition_penalty, out[seen] * p.repetition_penalty)
    out -= p.frequency_penalty * counts
    out -= p.presence_penalty * (counts > 0).float()
    return out


def make(rid: str, prompt: list[int], outputs: list[int], **kw) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=20, **kw), eos_token_ids=(1,))
    for t in outputs:
        request.append_output_token(t)
    return request


def test_processor_matches_the_reference_formulas() -> None:
    gen = torch.Generator().manual_seed(0)
    proc = LogitsProcessor(V, torch.device("cpu"))
    requests = [
        make("plain", [3, 4], [5]),
        make("rep", [3, 4, 4, 9], [5, 5, 9], repetition_penalty=1.7),
        make("freq", [2], [6, 6, 6, 7], frequency_penalty=0.8, presence_penalty=-0.4),
        make("all", [10, 11], [10, 12, 12], repetition_penalty=0.6, frequency_penalty=-1.1, presence_penalty=1.5,
             logit_bias={0: 3.0, 12: -100.0, 49: 7.5}),
        make("min", [8], [9], min_tokens=4, stop_token_ids=[20, 21]),
        make("min-noeos", [8], [], min_tokens=2, ignore_eos=True, stop_token_ids=[22]),
        make("min-done", [8], [9, 9, 9, 9], min_tokens=4, stop_token_ids=[20]),
        make("bad", [8], [9, 30, 31], bad_words=[(44,), (30, 31, 32), (31, 33), (5, 40, 41)], frequency_penalty=0.1),
    ]
    # rows past tokens the requests do not hold yet: a verification's drafts
    rows = [*requests, requests[1], requests[3], requests[3], requests[7]]
    extras = [(), (), (), (), (), (), (), (), (5, 40), (12,), (12, 12), (5, 40)]
    for step in range(3):  # the counts follow the outputs appended between steps
        logits = torch.randn(len(rows), V, generator=gen) * 3
        ours = proc.apply(logits, rows, extras)
        for r, (req, extra) in enumerate(zip(rows, extras)):
            assert torch.equal(ours[r], reference(logits[r], req, extra)), (step, req.request_id)
        for req in requests:
            req.append_output_token(int(torch.randint(V, (1,), generator=gen)))
    assert proc.num_tracked == 7  # the requests that process their logits hold a slot
    untouched = torch.randn(2, V)
    assert proc.apply(untouched, [requests[0], requests[0]]) is untouched  # nothing to do: no copy, no op
    for req in requests:
        proc.release(req.request_id)
    assert proc.num_tracked == 0
    reused = make("new", [1], [2], presence_penalty=1.0)  # a released row is reused, its old counts gone
    logits = torch.randn(1, V, generator=gen)
    assert torch.allclose(proc.apply(logits, [reused]), reference(logits[0], reused))


def test_in_place_over_every_row_matches_the_reference() -> None:
    """Every row penalized (no gather of rows) and processed in place, repeated tokens among the extras."""
    gen = torch.Generator().manual_seed(1)
    proc = LogitsProcessor(V, torch.device("cpu"))
    a = make("a", [3, 3, 4], [4, 9], repetition_penalty=1.3, presence_penalty=0.7)
    b = make("b", [5], [], frequency_penalty=1.9)
    rows, extras = [a, a, a, b], [(), (9,), (9, 30), (5, 5)]
    for _ in range(2):
        logits = torch.randn(len(rows), V, generator=gen) * 2
        want = torch.stack([reference(logits[r], req, extra) for r, (req, extra) in enumerate(zip(rows, extras))])
        out = proc.apply(logits, rows, extras, in_place=True)
        assert out is logits and torch.equal(out, want)
        strided = torch.randn(V, len(rows), generator=gen).t()  # not contiguous: processed, written back
        want = torch.stack([reference(strided[r], req, extra) for r, (req, extra) in enumerate(zip(rows, extras))])
        assert proc.apply(strided, rows, extras, in_place=True) is strided and torch.equal(strided, want)
        a.append_output_token(30), b.append_output_token(5)


def test_repetition_penalty_acts_on_the_biased_logit() -> None:
    """vLLM biases first, then penalizes: a seen token with a negative logit and a positive bias is
    divided by the penalty (penalizing first would multiply it, then add the bias)."""
    proc = LogitsProcessor(V, torch.device("cpu"))
    request = make("rb", [7], [12], repetition_penalty=2.0, logit_bias={12: 3.0, 7: -1.0})
    logits = torch.zeros(1, V)
    logits[0, 12], logits[0, 7] = -1.0, 0.5
    out = proc.apply(logits, [request])
    assert out[0, 12] == (-1.0 + 3.0) / 2.0  # vLLM; the other order gives -1.0 * 2.0 + 3.0 = 1.0
    assert out[0, 7] == (0.5 - 1.0) * 2.0  # negative once biased: multiplied
    assert torch.equal(out[0], reference(logits[0], request))


def test_tables_follow_tracked_requests_and_shrink_when_the_widest_is_released() -> None:
    """Requests come and go (prompts crossing pages, extras, every kind of processing): each step equals
    the reference exactly; releasing the one wide request (4000 distinct seen tokens, 100 bias entries)
    compacts the tables to what the others need, and they stay exact."""
    vocab = 4096
    gen = torch.Generator().manual_seed(2)
    proc = LogitsProcessor(vocab, torch.device("cpu"))

    def randint(hi: int, n: int = 1) -> list[int]:
        return torch.randint(hi, (n,), generator=gen).tolist()

    kinds = [dict(repetition_penalty=1.4, frequency_penalty=0.3), dict(presence_penalty=-0.7, logit_bias={3: 2.0}),
             dict(min_tokens=15, stop_token_ids=[5, 6], bad_words=[(9,), (4, 8)]), dict(frequency_penalty=0.2)]
    wide = make("wide", list(range(4000)), [7], repetition_penalty=1.2, logit_bias={t: 0.5 for t in range(100)})
    live = {"wide": wide}
    for step in range(8):
        if step % 2 == 0:  # a new request in, an old small one out
            i = step // 2
            prompt = list(range(300, 300 + PAGE)) if i == 0 else randint(600, randint(400)[0] + 1)  # s0: a page full
            live[f"s{i}"] = make(f"s{i}", prompt, randint(300, 2), **kinds[i % 4])
            if f"s{i - 2}" in live:
                proc.release(f"s{i - 2}"), live.pop(f"s{i - 2}")
        reqs = list(live.values())
        rows = [*reqs, reqs[-1], reqs[-1]]
        extras = [() for _ in reqs] + [tuple(randint(600, 1)), tuple(randint(600, 3))]
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        out = proc.apply(logits, rows, extras)
        for r, (req, extra) in enumerate(zip(rows, extras)):
            assert torch.equal(out[r], reference(logits[r], req, extra)), (step, req.request_id)
        for req in reqs:
            for t in randint(600, 2):
                req.append_output_token(t)
    before = proc.memory_bytes
    proc.release("wide"), live.pop("wide")
    assert proc.memory_bytes < before / 4
    assert proc.tables.entry_tokens.shape[1] < 100 and proc.seen.page_tokens.shape[0] <= 4 * max(
        sum(len(s.seen.pages) for s in proc._states.values()), 4)
    reqs = list(live.values())
    logits = torch.randn(len(reqs), vocab, generator=gen)
    out = proc.apply(logits, reqs, [(1, 1)] * len(reqs))
    for r, req in enumerate(reqs):
        assert torch.equal(out[r], reference(logits[r], req, (1, 1))), req.request_id
    for rid in list(live):
        proc.release(rid)
    assert proc.num_tracked == 0 and proc.memory_bytes < 20_000


@pytest.fixture(scope="module")
def llm(tiny_ckpt, device):
    return LLM(tiny_ckpt, dtype="float32", num_blocks=128, block_size=8, max_num_batched_tokens=24, device=device)


PROMPT = [5, 17, 99, 3, 3, 3, 8, 40, 41, 42]


def test_greedy_decode_with_processing_follows_the_reference_step_by_step(llm) -> None:
    kw = dict(repetition_penalty=2.0, frequency_penalty=1.5, presence_penalty=1.0, logit_bias={257: -4.0, 3: 2.0})
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, **kw)
    out = llm.generate([PROMPT], params)[0]
    state = Request("ref", PROMPT, params)
    for _ in range(14):
        raw = engine_logits(llm, state.all_token_ids)[-1].cpu()
        state.append_output_token(int(reference(raw, state).argmax()))
    assert out.token_ids == state.output_token_ids
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True))[0]
    assert plain.token_ids != out.token_ids  # the processing changed the text


def test_processing_with_the_captured_decode_equals_eager(tiny_ckpt, llm, monkeypatch) -> None:
    """``compile=True``: the decode forward is one captured graph per bucket and the processing acts on its
    logits: the tokens and logprobs of penalized, biased, min_tokens requests (greedy and seeded) equal
    eager decoding's."""
    monkeypatch.setenv("EPSERVE_COMPILE_BACKEND", "aot_eager")  # the fullgraph trace, no codegen
    eos = llm.config.model.eos_token_ids[0]
    kw = dict(max_tokens=8, logprobs=1, repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2,
              logit_bias={eos: 50.0, 3: 2.0}, min_tokens=6)
    params = [SamplingParams(temperature=0.0, **kw), SamplingParams(temperature=0.9, seed=5, **kw)]
    prompts = [PROMPT, [7, 8, 9]]
    eager = llm.generate(prompts, params)
    captured = LLM(tiny_ckpt, dtype="float32", num_blocks=128, block_size=8, max_num_batched_tokens=24,
                   max_num_seqs=2, compile=True)
    assert captured.engine.runner.decode_graphs is not None
    for a, b in zip(eager, captured.generate(prompts, params)):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 7 and a.token_ids[-1] == eos  # held to 6
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_logprobs_stay_the_models_own(llm) -> None:
    biased = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2,
                                                   logit_bias={77: 100.0}))[0]
    assert biased.token_ids == [77, 77, 77]
    raw = torch.log_softmax(engine_logits(llm, PROMPT)[-1].cpu(), -1)
    assert biased.logprobs[0].logprob == pytest.approx(float(raw[77]), abs=1e-4)


def test_min_tokens_masks_eos_and_stop_tokens(llm) -> None:
    eos = llm.config.model.eos_token_ids[0]
    forced = {eos: 100.0, 300: 50.0}  # EOS is always the best token, then 300
    first = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, logit_bias=forced))[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop"
    held = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, logit_bias=forced, min_tokens=4))[0]
    assert held.token_ids == [300, 300, 300, 300, eos] and held.finish_reason == "stop"
    stop = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, min_tokens=3, ignore_eos=True,
                                                 stop_token_ids=[300], logit_bias={300: 100.0, 301: 50.0}))[0]
    assert stop.token_ids == [301, 301, 301, 300] and stop.finish_reason == "stop"
    sampled = llm.generate([PROMPT] * 4, SamplingParams(max_tokens=6, temperature=1.0, seed=3, min_tokens=6,
                                                        logit_bias={eos: 8.0}))
    assert all(len(o.token_ids) == 6 and eos not in o.token_ids for o in sampled)


def test_bad_words_are_never_completed(llm) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = llm.generate([PROMPT], greedy)[0].token_ids
    a, b = plain[2], plain[3]
    one = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                bad_words=[(plain[0],)]))[0].token_ids
    assert plain[0] not in one and one != plain
    two = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                bad_words=[(a, b)]))[0].token_ids
    assert two[:3] == plain[:3] and two[3] != b  # `a` may still come; `b` never right after it
    assert all(two[i : i + 2] != [a, b] for i in range(len(two) - 1))


def test_max_tokens_zero_runs_the_prompt_only(llm) -> None:
    out = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    kv = llm.engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_prompt_logprobs_match_transformers(tiny_ckpt, llm) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32).eval()
    long = list(range(100, 170))  # chunked: 24 tokens a step
    prompts = [PROMPT, long, long]  # the second copy of `long` finds its prefix cached: recomputed
    warm = llm.generate([long], SamplingParams(max_tokens=1))[0]  # caches `long`'s blocks
    assert warm.token_ids
    params = [SamplingParams(max_tokens=2, prompt_logprobs=k) for k in (3, 0, 5)]
    outs = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert out.num_cached_tokens == 0  # a request that wants its prompt's logprobs recomputes it
        for pos, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == prompt[pos]
            assert lp.logprob == pytest.approx(float(ref[pos - 1, prompt[pos]]), abs=1e-4)
            top = torch.topk(ref[pos - 1], p.prompt_logprobs)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    plain = llm.generate([long], SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0  # others still hit the cache


def test_sampled_processing_under_mtp_keeps_plain_decodings_distribution() -> None:
    """Rejection sampling over processed rows: 2 drafts from a draft model unlike the target, both draft
    rows and the 3 verification rows processed with their extra tokens (penalties, logit_bias, and
    min_tokens whose EOS mask lifts at the second row). The first token follows plain decoding's
    processed target, and the pair (first, second) where a draft was accepted follows
    min(p0, q0)(a) * p1(b | a), p1 processed after a: each frequency within 5 sigma of 4000 samples."""
    vocab, n, batch = 6, 4000, 500
    params = SamplingParams(max_tokens=50, temperature=0.9, repetition_penalty=1.6, frequency_penalty=0.4,
                            presence_penalty=0.3, logit_bias={4: 0.8}, min_tokens=2)
    request = Request("s", [0, 1], params, eos_token_ids=(5,))
    request.append_output_token(2)
    target = torch.tensor([[1.0, 0.5, 0.2, -0.3, 0.8, 1.5], [0.1, 0.9, -0.5, 0.4, 0.0, 0.3],
                           [0.3, -0.2, 0.6, 0.1, 0.5, -0.4]])
    draft = torch.tensor([[0.2, 1.2, -0.2, 0.6, -0.5, 0.9], [0.7, 0.1, 0.4, -0.6, 0.2, 0.0]])
    proc = LogitsProcessor(vocab, torch.device("cpu"))
    noise = Noise(torch.Generator().manual_seed(4321))
    pos = request.num_tokens

    def dist(logits: torch.Tensor, extra: tuple[int, ...] = ()) -> torch.Tensor:
        return filter_logits(reference(logits, request, extra)[None], [params]).softmax(-1)[0].double()

    firsts, pairs = [], []
    for _ in range(n // batch):
        same = [request] * batch
        d0, q0 = draft_tokens(proc.apply(draft[0].repeat(batch, 1), same, [()] * batch), [params] * batch,
                              [pos] * batch, noise)
        d0 = d0.tolist()
        d1, q1 = draft_tokens(proc.apply(draft[1].repeat(batch, 1), same, [(d,) for d in d0]), [params] * batch,
                              [pos + 1] * batch, noise)
        drafts = list(zip(d0, d1.tolist()))
        extras = [e for a, b in drafts for e in ((), (a,), (a, b))]
        logits = proc.apply(target.repeat(batch, 1), [request] * 3 * batch, extras)
        groups = [VerifyGroup(d, torch.stack([q0[i], q1[i]]), params, pos) for i, d in enumerate(drafts)]
        for out in verify(logits, groups, noise):
            firsts.append(out.token_ids[0])
            if out.num_accepted:
                pairs.append(out.token_ids[0] * vocab + out.token_ids[1])
    p0, q0 = dist(target[0]), dist(draft[0])
    p1 = torch.stack([dist(target[1], (a,)) for a in range(vocab)])  # [a, b]: p1(b | a)
    assert p0[5] == 0 and p1[:, 5].min() > 0  # EOS held below min_tokens at the first row only
    assert (p1 - dist(target[1])).abs().max() > 0.05  # the extra token matters: the test has power
    freq = torch.bincount(torch.tensor(firsts), minlength=vocab).double() / n
    assert ((freq - p0).abs() <= 5 * (p0 * (1 - p0) / n).sqrt() + 1e-9).all(), (freq, p0)
    joint = (torch.minimum(p0, q0)[:, None] * p1).flatten()
    joint /= joint.sum()
    m = len(pairs)
    assert m > n / 4
    freq = torch.bincount(torch.tensor(pairs), minlength=vocab * vocab).double() / m
    assert ((freq - joint).abs() <= 5 * (joint * (1 - joint) / m).sqrt() + 1e-9).all(), (freq, joint)


def test_processing_is_exact_under_mtp_verification(counter_ckpt, device) -> None:
    engine = dict(dtype="float32", num_blocks=256, block_size=8, device=device)
    prompts = [[5, 6, 7, 8], [30, 31], [12, 13, 14, 15, 16, 17]]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **kw) for kw in (
        {"repetition_penalty": 1.2, "frequency_penalty": 0.3},
        {"logit_bias": {40: 2.0}, "presence_penalty": 0.5, "prompt_logprobs": 1},
        {"min_tokens": 5, "frequency_penalty": -0.2})]
    plain = LLM(counter_ckpt, num_speculative_tokens=0, **engine).generate(prompts, params)
    mtp = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **engine)
    outs = mtp.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [lp.token_id for lp in outs[1].prompt_logprobs[1:]] == prompts[1][1:]
    stats = mtp.speculative_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # drafts accepted and rejected
    # sampled requests under MTP: reproducible with a seed and never below min_tokens
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=7, min_tokens=12, repetition_penalty=1.3,
                              logit_bias={mtp.config.model.eos_token_ids[0]: 5.0})] * 2
    a, b = mtp.generate(prompts[:2], sampled), mtp.generate(prompts[:2], sampled)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 12 for o in a)
    # a prompt-only request beside drafting ones: no token, its prompt logprobs, the others unchanged
    mixed = mtp.generate(prompts, [SamplingParams(max_tokens=0, prompt_logprobs=1), *params[1:]])
    assert mixed[0].token_ids == [] and len(mixed[0].prompt_logprobs) == len(prompts[0])
    assert [o.token_ids for o in mixed[1:]] == [o.token_ids for o in plain[1:]]
    kv = mtp.engine.scheduler.kv_manager
    assert kv.num_free_blocks == kv.num_blocks
