"""Whether MTP speculative decoding pays on this engine, measured at start-up: the default (``speculative``
not given, ``num_speculative_tokens`` not 0) on one rank, with a checkpoint that has an MTP layer. The engine
loads the layer, warms up as usual, and before it serves:

1. acceptance: greedy continuations of a few fixed prompts (:data:`MTP_PROMPTS`) at once, every step drafting
   one token (eager steps on the CPU: recording graphs would cost more); the drafts' acceptance bounds what
   drafting can gain (a drafting step yields ``1 + acceptance`` tokens a request and costs at least a plain
   step), so below :data:`PROBE_MARGIN` it is off without timing anything (a random-weight checkpoint: every
   test's model);
2. speed: short continuations with and without drafting, timed at batch 1 and at the device's drafting cap
   (``DraftRule``; within the engine's running requests), alternated run by run over a few rounds, each mode's
   step its lower quartile (steady beside other work on the host); the greedy tokens with drafts must equal
   those without (a mismatch is logged as an error and MTP stays off);
3. the decision (:func:`decide`, on the figures alone): on where MTP's tokens/s at batch 1 is at least the
   margin above plain's; the proposer's ``DraftRule`` then drafts up to the largest batch measured to pay,
   while the drafts' acceptance stays above the measured break-even (a drafting step's cost in plain steps,
   less one).

The probe leaves no trace: kept on, the engine resets what it touched (the scheduler with its prefix cache
and KV blocks, the expert-load counters; the probe puts back the acceptance counters and the unseeded
requests' generator, and keeps its steps out of the EPLB window); switched off, the engine releases its
parts (the MTP layer's weights, KV cache and draft graphs with them) and loads again as a plain engine
(``LLMEngine``). The planner's acceptance figure (``planner/calibrate_engine.py``) is
:func:`measure_acceptance` too.
"""

from __future__ import annotations

import copy
import functools
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from epserve.checkpoint import CheckpointReader
from epserve.config import EngineConfig
from epserve.engine.options import speculation_without_probe
from epserve.engine.runner import ModelRunner
from epserve.engine.sampling import SamplingPipeline
from epserve.engine.spec_manager import DraftRule
from epserve.messages.engine import AddRequest
from epserve.messages.sampling import SamplingParams
from epserve.parallel.context import ParallelContext
from epserve.tokenizer import TOKENIZER_FILE, load_tokenizer

logger = logging.getLogger(__name__)

# A few plain English openings: the drafts' acceptance on them is this engine's own figure for its model.
MTP_PROMPTS = (
    "The following section describes", "When the interpreter starts, it", "A function definition is",
    "In the example above, the value of", "It is important to note that the", "The result of the operation is",
    "Each object has an identity, a type and", "If the condition is true, the", "This chapter explains how",
    "The default value of the argument is", "For example, the expression", "An exception is raised when",
)
PROBE_MARGIN = 1.05  # MTP's tokens/s at batch 1 over plain's, at least, for the default to draft
ACCEPTANCE_PROMPTS = 12  # continuations the acceptance is counted on (at once: few steps)
ACCEPTANCE_TOKENS = 6  # tokens each of them generates
PROBE_TOKENS = 10  # tokens each timed continuation generates
PROBE_ROUNDS = 6  # timed runs per mode and batch, alternated, after one untimed
PROBE_MAX_BATCH = 16  # the largest batch timed (the device's drafting cap, the engine's running requests)


@dataclass(frozen=True)
class SpeedFigures:
    """One batch's timed continuations: decode tokens/s without and with drafting, and a drafting step's time
    in plain steps."""

    batch: int
    plain_tps: float
    mtp_tps: float
    step_cost: float

    @property
    def ratio(self) -> float:
        return self.mtp_tps / self.plain_tps


@dataclass(frozen=True)
class SpecDecision:
    """The start-up decision: drafting ``on`` or not, why (one line), the figures it rests on, the
    proposer's rule where on, and the probe's seconds."""

    on: bool
    reason: str
    acceptance: float | None = None
    speeds: tuple[SpeedFigures, ...] = ()
    rule: DraftRule | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"mtp": self.on, "reason": self.reason, "acceptance": self.acceptance,
                "speeds": [{"batch": s.batch, "plain_tps": s.plain_tps, "mtp_tps": s.mtp_tps, "ratio": s.ratio,
                            "step_cost": s.step_cost} for s in self.speeds],
                "max_requests": self.rule.max_requests if self.rule else None,
                "break_even_acceptance": self.rule.cost if self.rule else None, "probe_seconds": self.seconds}


def decide(acceptance: float, speeds: Sequence[SpeedFigures], cap: int, margin: float = PROBE_MARGIN) -> SpecDecision:
    """The decision on the measured figures: off where the acceptance alone cannot reach ``margin`` (nothing
    timed) or MTP's batch-1 tokens/s is under ``margin`` x plain's; else on, drafting for up to the largest
    batch timed at which it was not slower (``cap``, the device's, where that batch is the largest timed), while
    the acceptance stays above that batch's break-even (its drafting step's cost in plain steps, less one)."""
    forced = "; --speculative mtp forces it"
    if 1 + acceptance < margin or not speeds:
        return SpecDecision(False, f"off: MTP's drafts were accepted {acceptance:.2f} of the time, so drafting "
                            f"gains at most {1 + acceptance:.2f}x (under {margin:.2f}x){forced}", acceptance)
    first = speeds[0]
    figures = (f"acceptance {acceptance:.2f}, a drafting step costs {first.step_cost:.2f} plain ones; "
               f"{first.mtp_tps:.1f} against {first.plain_tps:.1f} tokens/s")
    if first.ratio < margin:
        return SpecDecision(False, f"off: MTP measured {first.ratio:.2f}x plain at batch 1 ({figures}){forced}",
                            acceptance, tuple(speeds))
    top = max((s for s in speeds if s.ratio >= min(margin, 1.0)), key=lambda s: s.batch)  # (batch 1's among them)
    largest = max(s.batch for s in speeds)
    rule = DraftRule(cap if top.batch == largest else top.batch, max(top.step_cost - 1.0, 0.0))
    at = ", ".join(f"{s.ratio:.2f}x at batch {s.batch}" for s in speeds)
    return SpecDecision(True, f"on: MTP measured {at} ({figures}); drafting for up to {rule.max_requests} "
                        f"request{'s' * (rule.max_requests > 1)} "
                        f"while the drafts' acceptance stays above {rule.cost:.2f}", acceptance, tuple(speeds), rule)


class ProbedEngine(Protocol):
    """What the probe drives: an engine of one rank with the MTP layer loaded (``engine.LLMEngine``)."""

    config: EngineConfig
    ctx: ParallelContext
    runner: ModelRunner
    sampling: SamplingPipeline

    def check_request(self, request: AddRequest) -> AddRequest: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self, stopping: bool = False) -> list[Any]: ...


def probes(config: EngineConfig) -> bool:
    """Whether an engine of ``config`` decides speculative decoding at start-up: the default (``speculative``
    None, ``num_speculative_tokens`` not 0), one rank, a checkpoint with the MTP layer's tensors."""
    if speculation_without_probe(config) is not None:
        return False
    return CheckpointReader(config.model_path).has(f"model.layers.{config.model.num_hidden_layers}.eh_proj.weight")


def unprobed(config: EngineConfig) -> SpecDecision:
    """The decision of an engine that does not probe (:func:`probes`): its options', or off where the
    checkpoint's MTP layer has no tensors."""
    reason = speculation_without_probe(config) or "off: the checkpoint's MTP layer has no tensors"
    return SpecDecision(bool(config.num_spec_tokens), reason)


def probe_prompts(config: EngineConfig, count: int) -> list[list[int]]:
    """``count`` prompts as token ids: :data:`MTP_PROMPTS` in turn through the checkpoint's tokenizer, or
    without one a fixed spread of the vocabulary."""
    path = Path(config.model_path) / TOKENIZER_FILE
    encoded = _encoded(str(path), path.stat().st_mtime_ns) if path.is_file() else None
    if encoded is not None:
        return [list(encoded[i % len(encoded)]) for i in range(count)]
    return [[(7 + 31 * i + 97 * j) % config.model.vocab_size for j in range(8)] for i in range(count)]


@functools.lru_cache(maxsize=8)
def _encoded(tokenizer_file: str, mtime_ns: int) -> tuple[tuple[int, ...], ...] | None:
    """:data:`MTP_PROMPTS` through the tokenizer of that file (as it was at ``mtime_ns``): loaded once a process
    (its chat template compiles in tens of milliseconds, a large part of a small engine's probe)."""
    tokenizer = load_tokenizer(Path(tokenizer_file).parent)
    return None if tokenizer is None else tuple(tuple(tokenizer.encode(t)) for t in MTP_PROMPTS)


@dataclass(frozen=True)
class _Continuations:
    """What one run of the probe's prompts gave: each prompt's tokens, and each decode step's seconds and tokens
    (the steps once every prompt had its first token)."""

    tokens: list[list[int]]
    seconds: list[float]
    decoded: list[int]


def _run(engine: ProbedEngine, prompts: list[list[int]], max_tokens: int, tag: str, rule: DraftRule) -> _Continuations:
    """The prompts' greedy continuations through the engine's own steps, the proposer drafting by ``rule``."""
    proposer = engine.runner.proposer
    assert proposer is not None
    proposer.rule = rule
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"spec-probe-{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    seconds: list[float] = []
    decoded: list[int] = []
    while engine.has_unfinished_requests():
        timed = all(tokens.values())  # (a decode step: every prompt prefilled)
        start = time.perf_counter()
        updates = engine.step()
        if timed:
            if engine.ctx.device.type == "cuda":
                torch.cuda.synchronize(engine.ctx.device)
            seconds.append(time.perf_counter() - start)
            decoded.append(sum(len(u.new_token_ids) for u in updates))
        for u in updates:
            tokens[u.request_id].extend(u.new_token_ids)
    return _Continuations([tokens[rid] for rid in ids], seconds, decoded)


def measure_acceptance(engine: ProbedEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """The drafts' acceptance rate on the prompts' greedy continuations, every step drafting (whatever the
    batch); they are counted in the engine's acceptance counters too."""
    stats = engine.sampling.stats
    assert stats is not None
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    _run(engine, prompts, max_tokens, "accept", DraftRule(max_requests=max(len(prompts), 1), sample=0))
    drafts, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    return accepted / drafts if drafts else 0.0


def measure_speed(engine: ProbedEngine, prompts: list[list[int]], rounds: int = PROBE_ROUNDS) -> SpeedFigures | str:
    """``prompts`` at once, without then with drafting on every step, alternated (one untimed round first):
    each mode's step (its lower quartile: what a step costs when the host lets it run, as steady as the host's
    other work allows) and its tokens a step, or why not (the greedy tokens with drafts differ from those
    without)."""
    batch = len(prompts)
    rules = {False: DraftRule(max_requests=0), True: DraftRule(max_requests=batch, sample=0)}
    steps: dict[bool, list[float]] = {False: [], True: []}
    decoded: dict[bool, list[int]] = {False: [], True: []}
    for r in range(rounds + 1):
        out = {draft: _run(engine, prompts, PROBE_TOKENS, f"b{batch}-{r}-{int(draft)}", rule)
               for draft, rule in rules.items()}
        if out[False].tokens != out[True].tokens:
            return f"the greedy tokens with drafts differ from those without at batch {batch}"
        for draft, run in out.items():
            if r:
                steps[draft] += run.seconds
                decoded[draft] += run.decoded
    if not steps[False] or not steps[True]:
        return f"no decode step to time at batch {batch}"
    step = {d: _lower_quartile(steps[d]) for d in steps}
    tps = {d: sum(decoded[d]) / len(decoded[d]) / step[d] for d in steps}
    return SpeedFigures(batch, tps[False], tps[True], step[True] / step[False])


def _lower_quartile(values: list[float]) -> float:
    return statistics.quantiles(values, n=4)[0] if len(values) > 1 else values[0]


def run_probe(engine: ProbedEngine, margin: float = PROBE_MARGIN) -> SpecDecision:
    """Acceptance, then (where it could pay) speed at batch 1 and at the drafting cap, and the decision; the
    acceptance counters, the EPLB window and the unseeded requests' generator as they were (the caller resets
    the rest)."""
    start = time.perf_counter()
    cap = DraftRule.for_device(engine.ctx.device.type).max_requests
    batch = max(1, min(cap, engine.config.scheduler.max_num_seqs, PROBE_MAX_BATCH))
    prompts = probe_prompts(engine.config, max(ACCEPTANCE_PROMPTS, batch))
    params = SamplingParams(max_tokens=max(ACCEPTANCE_TOKENS, PROBE_TOKENS), ignore_eos=True)
    try:
        for prompt in prompts:
            engine.check_request(AddRequest("spec-probe", tuple(prompt), params))
    except ValueError as e:  # (RequestError: a context or a KV pool too small for the probe's requests)
        return SpecDecision(False, f"off: the start-up probe does not fit this engine ({e}); --speculative mtp "
                            "forces it", seconds=time.perf_counter() - start)
    generator = engine.sampling.sampler.default_generator
    state, stats = generator.get_state(), copy.deepcopy(engine.sampling.stats)
    runner = engine.runner
    balancer, runner.balancer = runner.balancer, None  # the probe's steps neither fill the window nor rebalance
    captured = runner.captured
    try:
        if captured is not None and captured.mode != "cuda_graph":  # eager: a CPU graph records at first use, and
            runner.captured = None  # recording a bucket costs more than these few steps run eagerly
        acceptance = measure_acceptance(engine, prompts[:ACCEPTANCE_PROMPTS], ACCEPTANCE_TOKENS)
        runner.captured = captured
        speeds: list[SpeedFigures] = []
        for b in sorted({1, batch}) if 1 + acceptance >= margin else ():
            figures = measure_speed(engine, prompts[:b])
            if isinstance(figures, str):
                logger.error("speculative decoding: MTP's self-check failed: %s (verification must keep the greedy "
                             "tokens: a defect)", figures)
                decision = SpecDecision(False, f"off: {figures}", acceptance, tuple(speeds))
                break
            speeds.append(figures)
        else:
            decision = decide(acceptance, speeds, cap, margin)
    finally:
        runner.balancer, runner.captured = balancer, captured
        generator.set_state(state)
        engine.sampling.stats = stats
    return replace(decision, seconds=time.perf_counter() - start)
