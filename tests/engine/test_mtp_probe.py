"""MTP by default where it pays: the start-up probe's decision on given figures, a random-weight checkpoint
decided off and left exactly as a plain engine (tokens, expert load, prefix cache, KV pool), the probe turned
on by its margin and then drafting, and the option combinations the CLI refuses."""

from __future__ import annotations

import pytest

from epserve import LLM, SamplingParams
from epserve.cli import main
from epserve.engine.engine import LLMEngine
from epserve.engine.options import build_engine_config
from epserve.engine.spec_manager import DraftRule
from epserve.engine.spec_probe import MTP_PROMPTS, SpeedFigures, decide

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", num_blocks=96, max_num_seqs=8, enable_eplb=True, eplb_step_interval=4,
              eplb_window_size=4)


def test_the_decision_follows_the_figures():
    """Off below the margin (acceptance alone, or batch 1's measured speed), the reason naming the figures;
    on above it, drafting up to the largest batch timed that was not slower, above that batch's break-even."""
    low = decide(0.02, [], cap=8)
    assert not low.on and "accepted 0.02" in low.reason and "--speculative mtp forces it" in low.reason
    slow = decide(0.93, [SpeedFigures(1, 100.0, 88.0, 2.2), SpeedFigures(8, 400.0, 300.0, 2.6)], cap=8)
    assert not slow.on and slow.rule is None
    assert "MTP measured 0.88x plain at batch 1 (acceptance 0.93, a drafting step costs 2.20 plain ones" in slow.reason
    both = decide(0.9, [SpeedFigures(1, 100.0, 150.0, 1.25), SpeedFigures(8, 400.0, 440.0, 1.7)], cap=8)
    assert both.on and both.rule == DraftRule(8, pytest.approx(0.7))
    first = decide(0.9, [SpeedFigures(1, 100.0, 150.0, 1.25), SpeedFigures(8, 400.0, 300.0, 2.5)], cap=8)
    assert first.on and first.rule == DraftRule(1, pytest.approx(0.25))
    assert not decide(0.9, [SpeedFigures(1, 100.0, 104.0, 1.8)], cap=8).on  # 1.04x: under the 1.05 margin
    assert decide(0.9, [SpeedFigures(1, 100.0, 104.0, 1.8)], cap=8, margin=1.0).on


def _state(llm: LLM) -> tuple:
    engine = llm.engine
    kv = engine.scheduler.kv_manager
    prefix = kv.prefix_cache
    balancer = engine.runner.balancer
    return (len(prefix), kv.num_free_blocks, kv.num_prefix_query_tokens, kv.num_prefix_hit_tokens,
            engine.num_forwards, balancer.num_steps, balancer.num_rebalances, llm.expert_load(), llm.cache_info(),
            llm.speculative_stats(), len(engine.runner.kv_caches), len(engine.runner.model.mtp),
            engine.runner.capture_shape.max_batch, engine.runner.captured.drafts,
            sorted(engine.runner.decode_graphs._cpu_graphs))


def test_a_random_checkpoint_decides_off_and_is_the_plain_engine(tiny_ckpt):
    """The default on the random ``tiny`` checkpoint (its MTP layer's drafts almost never accepted): off by the
    acceptance alone, nothing timed; the probed engine released and loaded again without the MTP layer; then
    the same tokens, expert load (EPLB on), prefix cache, KV pool (sized by memory) and recorded graphs as
    ``num_speculative_tokens=0``, before and after requests (the probe's own prompts find nothing cached)."""
    sized = {**ENGINE, "num_blocks": None, "memory_budget_bytes": 48 * 2**20}  # the KV pool sized by memory
    auto, plain = LLM(tiny_ckpt, **sized), LLM(tiny_ckpt, num_speculative_tokens=0, **sized)
    decision = auto.speculative_decision()
    assert not decision["mtp"] and decision["speeds"] == [] and decision["acceptance"] < 0.05
    assert decision["reason"].startswith("off: MTP's drafts were accepted") and decision["probe_seconds"] > 0
    assert plain.speculative_decision() == {**decision, "reason": "off (num_speculative_tokens 0)",
                                            "acceptance": None, "probe_seconds": 0.0}
    assert auto.engine.runner.proposer is None and auto.engine.config == plain.engine.config
    assert _state(auto) == _state(plain)
    prompts = [MTP_PROMPTS[0], MTP_PROMPTS[1], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
    for _ in range(2):  # (the second time from the prefix cache)
        outs = [llm.generate(prompts, GREEDY) for llm in (auto, plain)]
        assert [(o.token_ids, o.num_cached_tokens) for o in outs[0]] == [
            (o.token_ids, o.num_cached_tokens) for o in outs[1]]
        assert _state(auto) == _state(plain)
    assert outs[0][0].num_cached_tokens > 0 and auto.engine.runner.balancer.num_rebalances > 0


def test_a_probe_whose_margin_it_passes_turns_mtp_on(tiny_ckpt):
    """With the margin at 0 (a parameter of the engine) the probe times both modes and keeps MTP: the engine
    drafts (acceptance counted from zero, after the probe's own drafts), its tokens those of plain decoding."""
    engine = LLMEngine(build_engine_config(tiny_ckpt, **ENGINE), spec_margin=0.0)
    decision = engine.speculation
    assert decision.on and [s.batch for s in decision.speeds] == [1, 8] and decision.rule is not None
    assert engine.runner.proposer.rule == decision.rule and engine.config.num_spec_tokens == 1
    assert engine.sampling.speculative_stats()["num_drafts"] == 0 and engine.num_forwards == 0
    assert engine.runner.balancer.num_steps == 0 and int(engine.runner.balancer.counters().sum()) == 0
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("a", prompt, GREEDY)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for u in engine.step() for t in u.new_token_ids]
    assert engine.sampling.speculative_stats()["num_drafts"] > 0
    plain = LLM(tiny_ckpt, num_speculative_tokens=0, **ENGINE)
    assert tokens == plain.generate([prompt], GREEDY)[0].token_ids


def test_a_budget_the_mtp_layer_does_not_fit_starts_plain(tiny_ckpt):
    """The default asked for nothing: where the memory budget holds the plain engine but not the MTP layer's
    weights too, the engine starts plain (no probe) and says why; ``--speculative mtp`` is refused there."""
    import torch

    from epserve.config import ModelConfig, OutOfMemoryError
    from epserve.model.load_plan import plan_weight_bytes
    from epserve.parallel.context import ParallelContext

    weights = plan_weight_bytes(ModelConfig.from_hf(str(tiny_ckpt)), ParallelContext.single(torch.device("cpu")),
                                fp8=False, dtype=torch.float32)
    sized = {**ENGINE, "num_blocks": None, "memory_budget_bytes": weights + 2**18}  # + 0.25 MiB: the MTP layer is 0.75
    decision = LLM(tiny_ckpt, **sized).speculative_decision()
    assert not decision["mtp"] and decision["probe_seconds"] == 0.0
    assert decision["reason"].startswith("off: the MTP layer does not fit (") and "forces it" in decision["reason"]
    with pytest.raises(OutOfMemoryError):
        LLM(tiny_ckpt, speculative="mtp", **sized)


def test_speculative_option_combinations(capsys, tiny_ckpt):
    """``--speculative auto`` spells the default; a draft count it cannot go with is a one-line CLI error; an
    engine too small for the probe's requests says so and does not draft."""
    from epserve.cli import build_parser
    from epserve.engine.args import engine_options

    options = engine_options(build_parser().parse_args(["serve", "--speculative", "auto"]))
    assert options["speculative"] == "auto" and build_engine_config(**options) == build_engine_config()
    cases = [(["--speculative", "auto", "--num-speculative-tokens", "2"], "speculative 'auto' (--speculative auto) "
              "probes one draft token"),
             (["--speculative", "auto", "--num-speculative-tokens", "0"], "0 with neither (off)"),
             (["--num-speculative-tokens", "3"], "num_speculative_tokens 3 (--num-speculative-tokens 3) drafts with "
              "--speculative mtp")]
    for args, message in cases:
        code = main(["serve", *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    small = LLM(tiny_ckpt, dtype="float32", num_blocks=1).speculative_decision()
    assert not small["mtp"] and small["reason"].startswith("off: the start-up probe does not fit this engine (")
