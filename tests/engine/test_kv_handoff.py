"""Prefill/decode disaggregation inside the engine: a prefill engine's blocks handed to a decode engine
(in one process, copied by hand; the gRPC transport is tested in test_serve_disagg.py) give the tokens
of one engine; prefix hits on the decode side send fewer blocks; aborts free blocks on both sides;
a decode engine out of blocks makes transfers wait, never drops them."""

from __future__ import annotations

import itertools
import re
from dataclasses import replace

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.engine.engine import LLMEngine, RequestError
from epserve.messages.engine import AddRequest
from epserve.messages.sampling import StructuredOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SHARED = list(range(40, 90))
PROMPTS = [SHARED + [i, i + 1] for i in range(3, 7)] + [[9, 8, 7], list(range(200, 237))]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("tiny", dtype="float32")


def _engine(ckpt, device, **kw) -> LLMEngine:
    options = dict(dtype="float32", device=device, num_blocks=256, block_size=16)
    options.update(kw)
    return LLM(ckpt, **options).engine


def _run_prefill(prefill: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, first_block: int):
    prefill.enqueue(prefill.check_request(AddRequest(rid, tuple(prompt), params, "send", first_block)))
    while True:
        for update in prefill.step():
            if update.request_id == rid and update.finished:
                return prefill.export_kv(rid)


def disaggregated(prefill: LLMEngine, decode: LLMEngine, prompts, params: SamplingParams,
                  abort_in_transit: str | None = None) -> tuple[dict[str, list[int]], int]:
    """Every prompt prefilled on ``prefill`` and decoded on ``decode``; the tokens and blocks sent."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        decode.enqueue(decode.check_request(AddRequest(rid, tuple(prompt), params, "receive")))
        tokens[rid] = []
    sent = 0
    while decode.has_unfinished_requests() or decode.scheduler.handoff.num_receiving:
        for update in decode.step():
            tokens[update.request_id].extend(update.new_token_ids)
        for wanted in decode.take_kv_wanted():
            prompt = prompts[int(wanted.request_id[1:])]
            export = _run_prefill(prefill, wanted.request_id, prompt, params, wanted.first_block)
            assert export.first_block == wanted.first_block and export.data.shape[1] == wanted.num_blocks
            sent += wanted.num_blocks
            if wanted.request_id == abort_in_transit:
                assert decode.abort_request(wanted.request_id)
            decode.receive_kv(replace(export, request_id=wanted.request_id))
    return tokens, sent


@pytest.fixture(scope="module")
def colocated(ckpt, device):
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=256, block_size=16, enable_prefix_caching=False)
    return {f"r{i}": o.token_ids for i, o in enumerate(llm.generate(PROMPTS, GREEDY))}


def test_handed_off_kv_gives_the_tokens_of_one_engine(ckpt, device, colocated):
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device, enable_prefix_caching=False)
    tokens, sent = disaggregated(prefill, decode, PROMPTS, GREEDY)
    assert tokens == colocated
    assert sent == sum(-(-len(p) // 16) for p in PROMPTS)  # every prompt block, nothing more
    # Nothing is left behind: the prefill engine's held blocks were freed once copied out.
    for engine in (prefill, decode):
        assert engine.scheduler.kv_manager.num_free_blocks == engine.scheduler.kv_manager.num_blocks
        assert not engine.scheduler.handoff.held and not engine.scheduler.handoff.receiving


def test_decode_prefix_hits_send_fewer_blocks(ckpt, device, colocated):
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device)
    _, first = disaggregated(prefill, decode, PROMPTS[:1], GREEDY)
    tokens, second = disaggregated(prefill, decode, PROMPTS[1:4], GREEDY)
    assert [tokens[f"r{i}"] for i in range(3)] == [colocated[f"r{i}"] for i in range(1, 4)]
    # The 50 shared tokens fill 3 blocks the decode engine already holds: 1 of 4 blocks sent each.
    assert first == 4 and second == 3 * 1


def test_seeded_sampling_and_logprobs_match_one_engine(ckpt, device):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=256, block_size=16)
    alone = llm.generate([PROMPTS[0]], params)[0]
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device)
    rid = "r0"
    decode.enqueue(decode.check_request(AddRequest(rid, tuple(PROMPTS[0]), params, "receive")))
    tokens = []
    while len(tokens) < 8:
        for update in decode.step():
            tokens.extend(update.new_token_ids)
        for wanted in decode.take_kv_wanted():
            export = _run_prefill(prefill, rid, PROMPTS[0], params, wanted.first_block)
            decode.receive_kv(replace(export, request_id=rid))
    assert tokens == alone.token_ids
    assert export.logprobs is not None and export.logprobs.token_id == tokens[0]
    assert export.logprobs.logprob == pytest.approx(alone.logprobs[0].logprob, abs=1e-5)


def test_abort_in_transit_frees_blocks_and_keeps_others_exact(ckpt, device, colocated):
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device, enable_prefix_caching=False)
    tokens, _ = disaggregated(prefill, decode, PROMPTS, GREEDY, abort_in_transit="r2")
    assert tokens.pop("r2") == []  # its KV arrived after the abort and was dropped
    assert tokens == {k: v for k, v in colocated.items() if k != "r2"}
    for engine in (prefill, decode):
        kv = engine.scheduler.kv_manager
        assert kv.num_free_blocks == kv.num_blocks


def test_receiving_requests_wait_for_blocks_never_dropped(ckpt, device, colocated):
    # 9 blocks: the two 4-block prompts and their decodes cannot all hold blocks at once.
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device, num_blocks=9, enable_prefix_caching=False)
    tokens, _ = disaggregated(prefill, decode, PROMPTS, GREEDY)
    assert tokens == colocated


def test_prefill_request_checks(ckpt, device):
    engine = _engine(ckpt, device)
    with pytest.raises(RequestError, match="past the prompt"):
        engine.check_request(AddRequest("x", (1, 2, 3), GREEDY, "send", 2))
    request = engine.check_request(AddRequest("y", (1, 2, 3), GREEDY, "send"))
    assert request.params.max_tokens == 1  # the decode side checks the real stop conditions
    assert torch.equal(engine.runner.read_kv([0]), engine.runner.read_kv([0]))


def test_mtp_layer_kv_travels_and_drafts_continue(counter_ckpt, device):
    """With MTP on both sides the draft layer's cache is one more layer of every block: the decode
    side's drafts (and so its tokens and acceptance) are those of one engine."""
    from tests.engine.test_mtp_engine import ENGINE

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7], list(range(10, 40))]
    one = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **ENGINE)
    want = {f"r{i}": o.token_ids for i, o in enumerate(one.generate(prompts, params))}
    prefill = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **ENGINE).engine
    decode = LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, **ENGINE).engine
    assert prefill.runner.kv_layout().num_layers == prefill.config.model.num_hidden_layers + 1
    tokens, _ = disaggregated(prefill, decode, prompts, params)
    assert tokens == want
    assert decode.sampling.speculative_stats()["num_accepted_tokens"] > 0


def test_fp8_kv_travels_as_stored(ckpt, device):
    """An FP8 latent cache moves as its e4m3 bytes (half a bf16 block's, a quarter of fp32's): the
    decode side's tokens are those of one engine with the same FP8 cache."""
    one = LLM(ckpt, dtype="float32", device=device, num_blocks=256, block_size=16, kv_cache_dtype="fp8")
    want = {f"r{i}": o.token_ids for i, o in enumerate(one.generate(PROMPTS[:3], GREEDY))}
    prefill = _engine(ckpt, device, kv_cache_dtype="fp8")
    decode = _engine(ckpt, device, kv_cache_dtype="fp8", enable_prefix_caching=False)
    layout = decode.runner.kv_layout()
    assert layout.dtype == "fp8_e4m3" and layout.token_bytes == decode.config.model.kv_cache_dim
    assert layout.mismatch(_engine(ckpt, device).runner.kv_layout()) is not None  # fp32 blocks cannot land here
    tokens, _ = disaggregated(prefill, decode, PROMPTS[:3], GREEDY)
    assert tokens == want


class _Recorder:
    """A frontend that keeps what the step loop hands it."""

    def __init__(self) -> None:
        self.outputs: list = []

    def deliver(self, outputs: list) -> None:
        self.outputs.extend(outputs)

    def set_draining(self) -> None:
        pass


def test_each_streamed_update_carries_its_own_tokens_logprobs(ckpt, device):
    """Through the step loop (what the gRPC service streams): the step a request's KV arrives in reports
    the prefill's first token and the token it samples after it, as two updates; each carries the
    logprobs of its own token, those of one engine (not the second token's twice)."""
    from epserve.engine.loop import EngineLoop
    from epserve.messages.engine import GeneratedTokens, KVReceived
    from epserve.messages.kv import KVWanted

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    alone = LLM(ckpt, dtype="float32", device=device, num_blocks=256, block_size=16).generate([PROMPTS[0]], params)[0]
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device)
    loop, frontend = EngineLoop(decode), _Recorder()
    loop.submit(AddRequest("r0", tuple(PROMPTS[0]), params, "receive"))
    loop.run(frontend, until_idle=True)  # its blocks allocated: the transfer to start
    [wanted] = [o for o in frontend.outputs if isinstance(o, KVWanted)]
    export = _run_prefill(prefill, "r0", PROMPTS[0], params, wanted.first_block)
    loop.submit(KVReceived(replace(export, request_id="r0")))
    loop.run(frontend, until_idle=True)
    generated = [o for o in frontend.outputs if isinstance(o, GeneratedTokens)]
    assert len(generated[0].token_ids) == 1 and generated[-1].finish_reason == "length"
    assert all(len(o.logprobs) == len(o.token_ids) for o in generated)
    tokens = [t for o in generated for t in o.token_ids]
    logprobs = [lp for o in generated for lp in o.logprobs]
    assert tokens == alone.token_ids
    assert [lp.token_id for lp in logprobs] == tokens
    # and each says how many output tokens the request had as of it (the arrival's: 1, not 2)
    assert [o.num_output_tokens for o in generated] == list(itertools.accumulate(len(o.token_ids) for o in generated))
    for got, want in zip(logprobs, alone.logprobs, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-5)


def test_structured_output_continues_across_the_handoff(ckpt, device):
    """The prefill instance draws the first token under the grammar; the decode instance's matcher takes
    it on arrival and constrains the rest: the text of one engine, and it follows the grammar."""
    structured = StructuredOutput("regex", "[a-z]{2,4}-[0-9]{2,3}")
    params = SamplingParams(max_tokens=24, temperature=0.0, structured=structured)
    alone = LLM(ckpt, dtype="float32", device=device, num_blocks=256, block_size=16).generate([PROMPTS[0]], params)[0]
    prefill, decode = _engine(ckpt, device), _engine(ckpt, device)
    for engine in (prefill, decode):
        engine.constraints.add("r0", engine.constraints.compile(structured))
    tokens, _ = disaggregated(prefill, decode, PROMPTS[:1], params)
    assert tokens["r0"] == alone.token_ids and alone.finish_reason == "stop"
    assert re.fullmatch("[a-z]{2,4}-[0-9]{2,3}", alone.text)
