"""The sampling pipeline: the only place a step's tokens are drawn, for plain and speculative decoding
and for the MTP drafts alike. One path: the rows of the chunks that reach their last known token →
``LogitsProcessor`` (penalties, ``logit_bias``, ``min_tokens``, bad words) → the grammar masks
(``Constraints``) → the draw → the grammar takes the tokens kept.

Plain decoding is verification with zero drafts: a chunk verifying ``d`` drafts has ``d + 1`` rows, row
``j`` after its first ``j`` drafts, and gets the accepted drafts then one token drawn after them (with no
drafts: one token from the target distribution). Where the draw's randomness comes from is the engine's
one choice: without speculative decoding a seeded request draws each token in turn from its own
generator (``Sampler``: a batch's unseeded rows in one draw from the engine's generator); with it, every
draw is keyed by the position it decides (``spec_decode.Noise``), so how steps group a request's
positions does not change its tokens. The proposer asks the same pipeline for its drafts
(:meth:`SamplingPipeline.draft`): processed and masked as their verification rows will be, drawn from
the filtered draft distribution, which the pipeline keeps for the verification.

A request whose masks leave no token to draw fails rather than drawing token 0: up front where that
is decidable from its parameters (:func:`no_token_left`: its one-token ``bad_words``, with its stop
tokens and EOS under ``min_tokens``, cover the vocabulary), else at the step whose row has none left
(the sampler reads that back with the tokens; :meth:`SamplingPipeline.take_failures`).

The common step takes a shortcut through that path: when every row it samples is plain greedy
(:func:`plain_greedy`: nothing processes, masks or reads its logits but the argmax), its tokens are the
argmax of the logits and nothing else runs: with drafts, each request's drafts while they equal the argmax,
then the argmax after them (``spec_decode.verify_greedy``). The path's result for such rows is that too
(with no mask, no row is left without a token). The logits themselves come from the
forward where a recorded CPU step computed them (``engine/graphs.py``), else from the model's head here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from epserve.config import EngineConfig
from epserve.engine.batch_plan import BatchPlan, StepResult
from epserve.engine.constraints import Constraints
from epserve.engine.logits_processor import LogitsProcessor
from epserve.engine.prompt_logprobs import prompt_logprobs
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.sampler import Sampler, argmax_rows
from epserve.engine.spec_decode import Noise, SpecStats, VerifyGroup, draft_tokens, verify, verify_greedy
from epserve.messages.sampling import SamplingParams, TokenLogprobs

NO_TOKEN_LEFT = ("the sampling parameters leave no token allowed (bad_words, logit_bias, the structured-output "
                 "constraint or the stop tokens and EOS under min_tokens mask every token of the vocabulary)")


def argmax_only(params: SamplingParams) -> bool:
    """Whether a request's token is the argmax of the logits as they are: greedy, no logits processing
    (``LogitsProcessor``), no grammar (what an MTP draft of it is, whatever it asks of the target's logits)."""
    return params.is_greedy and params.structured is None and not params.processes_logits


def plain_greedy(params: SamplingParams) -> bool:
    """Whether a request's next token is the argmax of the model's logits and nothing more is asked of them:
    :func:`argmax_only`, and no logprobs."""
    return params.logprobs is None and argmax_only(params)


def no_token_left(params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int]) -> str | None:
    """Why no token could ever be drawn for a request with these parameters, naming the fields (None if
    one can): its one-token ``bad_words`` alone, or with its ``stop_token_ids`` and EOS (unless
    ``ignore_eos``) while below ``min_tokens``, cover the vocabulary."""
    if params.max_tokens == 0:
        return None
    banned = {word[0] for word in params.bad_words if len(word) == 1 and word[0] < vocab_size}
    if len(banned) >= vocab_size:
        return f"bad_words ban every token of the {vocab_size}-token vocabulary: no token can be drawn"
    if params.min_tokens:
        stops = {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}
        if len(banned | {t for t in stops if t < vocab_size}) >= vocab_size:
            return (f"min_tokens {params.min_tokens}: stop_token_ids"
                    + ("" if params.ignore_eos else " and EOS") + (" with bad_words" if banned else "")
                    + f" cover every token of the {vocab_size}-token vocabulary, so none can be drawn before "
                    "min_tokens")
    return None


class SamplingPipeline:
    """One engine's sampling (``compute_logits``: the model's head, final hidden states -> logits). Every
    rank holds one; only leaders sample."""

    def __init__(self, config: EngineConfig, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                 device: torch.device) -> None:
        mc = config.model
        self.vocab_size = mc.vocab_size
        self.compute_logits = compute_logits
        self.sampler = Sampler(device)
        self.noise = Noise(self.sampler.default_generator)  # speculative decoding's draws
        self.logits_processor = LogitsProcessor(mc.vocab_size, device)
        self.constraints = Constraints(config.model_path, mc.vocab_size, mc.eos_token_ids)
        self.stats = SpecStats(config.num_spec_tokens) if config.num_spec_tokens else None  # with drafts
        self._generators: dict[str, torch.Generator] = {}  # seeded requests' (plain decoding)
        self._draft_probs: dict[str, list[torch.Tensor | None]] = {}  # pending drafts' distributions
        self._failures: dict[str, str] = {}  # requests whose row had no token left, and why

    @property
    def speculative(self) -> bool:
        return self.stats is not None

    def speculative_stats(self) -> dict[str, object] | None:
        return None if self.stats is None else self.stats.as_dict()

    # ---- a step's tokens ------------------------------------------------------------------------
    def sample(self, chunks: list[ScheduledChunk], hidden: torch.Tensor, plan: BatchPlan,
               logits: torch.Tensor | None = None) -> StepResult:
        """Leader only: the tokens of the chunks that reach their last known token (the rows
        ``plan.logits_indices`` of the forward's ``hidden`` states, in chunk order), their drafts verified,
        and the prompt logprobs the step computed. ``logits``: those of every row of ``hidden``, where the
        forward computed them (else the head runs here, on the rows sampled). In inference mode."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return SamplingPipeline.sample(self, chunks, hidden, plan, logits)
        decodes = plan.num_decode_seqs and plan.num_decode_seqs == len(plan.seq_lens)  # (no prompt positions)
        prompt = {} if decodes else prompt_logprobs(self.compute_logits, chunks, hidden)
        sampling: list[ScheduledChunk] = []
        rows: list[int] = []  # of plan.logits_indices: a request with max_tokens 0 samples nothing
        first = 0
        plain = True  # every row plain greedy, so far
        for c in chunks:
            if not c.needs_sample:
                continue
            n = c.num_tokens if c.drafts else 1
            params = c.request.sampling_params
            if params.max_tokens:
                sampling.append(c)
                rows.extend(plan.logits_indices[first : first + n])
                plain = plain and plain_greedy(params)
            first += n
        if not sampling:
            return StepResult({}, {}, prompt)
        raw = self._raw_logits(hidden, rows, logits)
        if plain:  # (the path below would draw the same: nothing to process or mask)
            ids = argmax_rows(raw)
            if self.stats is None:
                return StepResult({c.request.request_id: t for c, t in zip(sampling, ids)}, {}, prompt)
            verified = {}
            for c, out in zip(sampling, verify_greedy(ids, [c.drafts for c in sampling])):
                self.stats.record(len(c.drafts), out.num_accepted)
                verified[c.request.request_id] = out.token_ids
            return StepResult(verified, {}, prompt)
        requests: list[Request] = []  # row r follows requests[r]'s outputs, then extras[r]
        extras: list[tuple[int, ...]] = []
        for c in sampling:
            for j in range(len(c.drafts) + 1):  # row j follows the request's first j drafts
                requests.append(c.request)
                extras.append(c.drafts[:j])
        # (the unprocessed logits are kept only for logprobs, which are the model's own)
        in_place = all(c.request.sampling_params.logprobs is None for c in sampling)
        logits = self.logits_processor.apply(raw, requests, extras, in_place=in_place)
        constrained: list[str] = []
        if self.constraints.num_matchers:  # each row masked by its grammar after the drafts before it
            firsts = itertools.accumulate((len(c.drafts) + 1 for c in sampling), initial=0)
            logits, constrained = self.constraints.mask_groups(
                logits, raw, in_place, [(c.request.request_id, f, c.drafts) for c, f in zip(sampling, firsts)],
                requests, extras)
        if self.stats is None:
            sampled, logprobs = self._draw(logits, sampling, raw)
            for rid in constrained:  # (a request whose row had no token left fails: take_failures)
                self.constraints.accept(rid, [sampled[rid]])
        else:
            sampled, logprobs = self._verify(logits, sampling, raw)
            for rid in constrained:
                self.constraints.accept(rid, list(sampled[rid]))
        return StepResult(sampled, logprobs, prompt)

    def _raw_logits(self, hidden: torch.Tensor, rows: list[int], logits: torch.Tensor | None) -> torch.Tensor:
        """The model's logits of ``rows`` (increasing rows of ``hidden``): of ``logits`` where the forward
        computed them, else the head's; every row's as they are, no rows gathered."""
        whole = len(rows) == hidden.shape[0]  # (then rows is every row, in order)
        if logits is not None:
            return logits if whole else logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        if whole and hidden.is_contiguous():
            return self.compute_logits(hidden)
        return self.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])

    def _draw(self, logits: torch.Tensor, sampling: list[ScheduledChunk],
              raw: torch.Tensor) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """No drafts: one token a request, each seeded request from its own generator in turn."""
        requests = [c.request for c in sampling]
        out = self.sampler.sample(logits, [r.sampling_params for r in requests],
                                  [self._generator(r) for r in requests], raw)
        ids = [r.request_id for r in requests]
        for row in out.empty_rows:
            self._failures[ids[row]] = NO_TOKEN_LEFT
        return (dict(zip(ids, out.token_ids)),
                {rid: lp for rid, lp in zip(ids, out.logprobs) if lp is not None})

    def _verify(self, logits: torch.Tensor, sampling: list[ScheduledChunk], raw: torch.Tensor,
                ) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[TokenLogprobs, ...]]]:
        """Each chunk's accepted drafts then the token after them (draws keyed by position), the acceptance
        counted."""
        assert self.stats is not None
        groups = []
        for c in sampling:
            rid, params = c.request.request_id, c.request.sampling_params
            probs = self._pending_probs(rid, len(c.drafts)) if c.drafts and not params.is_greedy else None
            groups.append(VerifyGroup(c.drafts, probs, params, c.start + c.num_known))
        sampled: dict[str, tuple[int, ...]] = {}
        logprobs: dict[str, tuple[TokenLogprobs, ...]] = {}
        for c, out in zip(sampling, verify(logits, groups, self.noise, raw)):
            self.stats.record(len(c.drafts), out.num_accepted)
            sampled[c.request.request_id] = out.token_ids
            if out.no_token_left:
                self._failures[c.request.request_id] = NO_TOKEN_LEFT
            if out.logprobs is not None:
                logprobs[c.request.request_id] = out.logprobs
        return sampled, logprobs

    def take_failures(self) -> dict[str, str]:
        """The requests that cannot go on since the last call, and why: a row left without a token to
        draw (its token this step is 0, to be dropped), or their constraint's failures
        (``Constraints.take_failures``). The engine aborts them."""
        failures, self._failures = self._failures, {}
        return {**self.constraints.take_failures(), **failures}

    def _generator(self, request: Request) -> torch.Generator | None:
        params = request.sampling_params
        if params.seed is None:
            return None
        gen = self._generators.get(request.request_id)
        if gen is None:
            # A sampled request's first token was drawn from this seed by its prefill instance.
            drawn = int(request.kv_transfer == "receive" and not params.is_greedy)
            gen = self._generators[request.request_id] = self.sampler.make_generator(
                params.seed, self.vocab_size, drawn)
        return gen

    # ---- the drafts (the MTP proposer, leader only) -----------------------------------------------
    @torch.inference_mode()
    def draft(self, logits: torch.Tensor, requests: Sequence[Request], extras: Sequence[tuple[int, ...]],
              before: Sequence[tuple[int, ...]], positions: Sequence[int],
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft per row of the draft model's ``logits`` [D, V], processed in place as its verification
        row will be: row ``i`` follows ``requests[i]``'s outputs then ``extras[i]`` (this step's tokens, then
        ``before[i]``, the drafts before it, which its grammar has not taken), and proposes the token at
        ``positions[i]``. Returns the drafts and each row's filtered draft distribution (None for greedy
        rows), for :meth:`keep_drafts`."""
        logits = self.logits_processor.apply(logits, requests, extras, in_place=True)
        if self.constraints.num_matchers:  # (the grammar has taken the step's tokens: the drafts before remain)
            self.constraints.mask_drafts(logits, [(r.request_id, i, before[i]) for i, r in enumerate(requests)],
                                         requests, extras)
        ids, q = draft_tokens(logits, [r.sampling_params for r in requests], positions, self.noise)
        return ids.tolist(), q

    def keep_drafts(self, chunks: list[ScheduledChunk], probs: dict[str, list[torch.Tensor | None]]) -> None:
        """After the step's draft passes: the distributions of each drafting request's drafts, which its next
        verification reads; a request that stepped without drafting has none pending."""
        for chunk in chunks:  # stepped without drafting (finishing, or at its limits): nothing pending
            if chunk.needs_sample and chunk.request.request_id not in probs:
                self._draft_probs.pop(chunk.request.request_id, None)
        self._draft_probs.update(probs)  # (a request this step did not run keeps its pending drafts' distributions)

    def _pending_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """[num_drafts, V]: the distributions the request's pending drafts were drawn from (None if greedy)."""
        probs = self._draft_probs.get(request_id)
        if not probs or probs[0] is None:
            return None
        return torch.stack(probs[:num_drafts])  # type: ignore[arg-type]

    def release(self, request_id: str) -> None:
        """Forget a finished request's state: its generator, token counts, matcher, pending drafts and
        failure."""
        self._generators.pop(request_id, None)
        self.logits_processor.release(request_id)
        self.constraints.release(request_id)
        self._draft_probs.pop(request_id, None)
        self._failures.pop(request_id, None)
