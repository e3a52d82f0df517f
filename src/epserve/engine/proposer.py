"""The draft side of MTP speculative decoding: after every step's target forward, ``k`` passes of the
checkpoint's MTP layer on every rank of the EP group (its MoE runs through the same dispatcher, so every
rank runs exactly ``k`` passes each step, possibly empty ones, in lockstep).

Pass 1 runs over the step's own positions and slots whose target KV the step keeps (a verification's
accepted rows; rejected rows are left out): at each position the token after it (the next prompt
token, or what the step accepted and sampled) and the target's final hidden state there. It writes the
MTP layer's latent KV for every position whose target KV the step computed (so the MTP cache always
covers the same positions as the target's, which the prefix cache relies on), and the row of each
request's last accepted position drafts its first token. Pass ``j > 1`` chains the layer on its own
output: one row per request still drafting, at the next position, fed the previous draft and the
previous pass's hidden state (as vLLM and SGLang chain one MTP module for ``k > 1``). Chained passes
write KV past the request's computed tokens; the next step overwrites it,
and the scheduler frees the blocks it no longer needs (``SpecManager.verified``).

A DP group's leader builds each pass and broadcasts it to its TP peers (``DraftPass``); only the leader
holds the head, so only it draws drafts, from the engine's sampling pipeline
(``SamplingPipeline.draft``: processed and masked as their verification rows will be), except where every
drafting request is plain greedy (nothing processes or masks its logits): its drafts are the argmax. A pass
that replays a recorded CPU graph leaves its rows' draft logits beside its output (the MTP head inside the
recording, ``engine/graphs.py``); an eager pass's drafting rows go through the MTP head here.

The leader also decides whether the step drafts at all (``spec_manager.DraftRule``: few enough
requests, drafts accepted often enough). A step that does not draft, in an engine of one DP
group, runs no pass (its TP peers follow the leader's broadcast): it costs what a plain step costs, and
the MTP layer's cache keeps no KV for its positions, which later drafts of those requests then read as
they find it (a draft's quality, never the output, depends on it). With several DP groups every rank
still runs the ``k`` passes, empty ones where its group does not draft (their MoE collectives pair up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from epserve.engine.batch_plan import BatchPlan, StepResult
from epserve.engine.block_tables import DeviceTables
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.sampling import SamplingPipeline, argmax_only, argmax_rows
from epserve.engine.spec_manager import DraftRule, draft_room
from epserve.model.deepseek_v3 import DeepseekV3ForCausalLM
from epserve.moe.dispatch.base import Dispatcher
from epserve.parallel.comm import broadcast_from_leader
from epserve.parallel.context import ParallelContext


@dataclass(frozen=True)
class DraftPass:
    """One pass of the MTP layer, as a leader broadcasts it: the batch (``input_ids``: the token after
    each position; ``logits_indices``: the rows that draft, one per drafting request) and the row of the
    previous depth's hidden states feeding each token (the target's at depth 1, the previous pass's
    output when chained)."""

    plan: BatchPlan
    hidden_rows: tuple[int, ...]


@dataclass(frozen=True)
class _Drafting:
    """A request drafting this step: how many drafts, and the position of the token sampled last."""

    request: Request
    num_drafts: int
    next_position: int
    table_row: int  # its row of the device block tables


class MTPProposer:
    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: list[torch.Tensor],
        dispatcher: Dispatcher,
        ctx: ParallelContext,
        block_size: int,
        num_spec: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.dispatcher = dispatcher
        self.ctx = ctx
        self.block_size = block_size
        self.num_spec = num_spec
        self.max_model_len = max_model_len
        # A pure-decode step's passes through the captured draft graph: (plan, hidden, bucket, overlap) -> the
        # layer's output rows; set by the runner when the decode is captured.
        self.replay: Callable[[BatchPlan, torch.Tensor, int, str], torch.Tensor] | None = None
        # the last replayed pass's draft logits, every row (None where its graph left the head out)
        self.replay_logits: Callable[[], torch.Tensor | None] = lambda: None
        self.tables: DeviceTables | None = None  # the rank's device block tables (set by the runner)
        self.rule = DraftRule.for_device(ctx.device.type)  # when a step drafts (the leader decides)
        self.steps_without_drafts = 0  # steps the rule switched drafting off (the leader's count)

    @torch.inference_mode()
    def propose(
        self, chunks: list[ScheduledChunk], plan: BatchPlan, result: StepResult | None, hidden: torch.Tensor,
        max_tokens_per_rank: int, overlap: str, bucket: int | None, sampling: SamplingPipeline,
    ) -> dict[str, list[int]]:
        """Every rank, after the step's forward (``hidden``: its final hidden states, every row) and the
        leader's sampling (``result``). Returns the leader's drafts per request (empty elsewhere), drawn by
        ``sampling``, which keeps their distributions for the next verification.
        ``bucket``: every pass replays the captured draft graph of that bucket (a pure-decode step, the same
        bucket on every rank), else runs eagerly."""
        leader = self.ctx.is_leader
        drafting: list[_Drafting] = []
        first = None
        if leader:
            draft = self._pays(chunks, sampling)
            self.steps_without_drafts += not draft
            if draft or self.ctx.dp > 1:  # (else no pass on any rank: the step costs what a plain one does)
                first, drafting = self._first_pass(chunks, plan, result, draft)
        step = self._share(first)
        if step is None:
            sampling.keep_drafts(chunks, {})
            return {}
        h, replayed = self._run(step, hidden, max_tokens_per_rank, overlap, bucket)
        drafts: dict[str, list[int]] = {d.request.request_id: [] for d in drafting}
        probs: dict[str, list[torch.Tensor | None]] = {d.request.request_id: [] for d in drafting}
        rows, active = step.plan.logits_indices, drafting
        greedy = all(argmax_only(d.request.sampling_params) for d in drafting)
        for depth in range(self.num_spec):
            if active:
                logits = self._draft_logits(h, rows, replayed)
                if greedy:  # nothing to process or mask: the argmax, no distributions kept
                    ids, q = argmax_rows(logits), [None] * len(active)
                else:  # (each draft follows this step's tokens and the drafts before it, not yet the request's)
                    positions = [d.next_position + 1 + depth for d in active]  # where each draft would sit
                    before = [tuple(drafts[d.request.request_id]) for d in active]
                    extras = [(*_tokens(result, d.request.request_id), *b) for d, b in zip(active, before)]
                    ids, q = sampling.draft(logits, [d.request for d in active], extras, before, positions)
                for d, t, qq in zip(active, ids, q):
                    drafts[d.request.request_id].append(t)
                    probs[d.request.request_id].append(qq)
            if depth == self.num_spec - 1:
                break
            chained = None
            if leader:
                keep = [i for i, d in enumerate(active) if d.num_drafts > depth + 1]
                chained = self._chained_pass([active[i] for i in keep], [rows[i] for i in keep], drafts, depth + 1)
                active = [active[i] for i in keep]
            step = self._share(chained)
            assert step is not None
            h, replayed = self._run(step, h, max_tokens_per_rank, overlap, bucket)
            rows = step.plan.logits_indices
        sampling.keep_drafts(chunks, probs)
        return drafts

    # ---- building the passes (a DP group's leader) ---------------------------------------------
    def _pays(self, chunks: list[ScheduledChunk], sampling: SamplingPipeline) -> bool:
        """Whether this step drafts: the rule, on the requests it samples and the acceptance so far."""
        stats = sampling.stats
        verified, accepted = (0, 0) if stats is None else (stats.num_drafts, stats.num_accepted_tokens)
        return self.rule.pays(sum(c.needs_sample for c in chunks), self.num_spec, verified, accepted)

    def _first_pass(
        self, chunks: list[ScheduledChunk], plan: BatchPlan, result: StepResult | None, draft: bool = True
    ) -> tuple[DraftPass, list[_Drafting]]:
        """The plan's rows whose target KV the step keeps (a verification's accepted rows only: the
        rejected ones' KV rolls back anyway), each fed the token after its position; with ``draft``, the
        row of each sampling request's last accepted position drafts."""
        ids: list[int] = []
        keep: list[int] = []  # token rows of the plan (and of the target's hidden states) kept
        seqs: list[int] = []  # sequence rows of the plan kept (a decode row is a sequence of its own)
        query_start = [0]
        draft_rows: list[int] = []
        drafting: list[_Drafting] = []
        token, seq = 0, 0
        for chunk in chunks:
            request = chunk.request
            known = request.all_token_ids
            sampled = chunk.needs_sample and request.sampling_params.max_tokens > 0  # (0: the prompt only)
            if sampled:  # (a leader with chunks has sampled them: ``result`` is set)
                got = result.sampled[request.request_id]  # type: ignore[union-attr]  # a tuple with drafts on
                tokens = [*known[chunk.start + 1 : chunk.start + chunk.num_known], *got]  # type: ignore[misc]
            else:  # a prompt chunk short of the end: the token after its last position is a prompt token
                tokens = known[chunk.start + 1 : chunk.end + 1]
                if chunk.needs_sample:  # a prompt-only request (max_tokens 0) ends here: nothing follows its
                    tokens.append(known[chunk.end - 1])  # last position, whose MTP KV no token will read
            if chunk.drafts:  # one decode row per verified position: keep the accepted ones
                rows = len(tokens)
                keep.extend(range(token, token + rows))
                seqs.extend(range(seq, seq + rows))
                query_start.extend(range(query_start[-1] + 1, query_start[-1] + rows + 1))
                seq += chunk.num_tokens
            else:
                rows = chunk.num_tokens
                keep.extend(range(token, token + rows))
                seqs.append(seq)
                query_start.append(query_start[-1] + rows)
                seq += 1
            ids.extend(tokens[:rows])
            token += chunk.num_tokens
            if sampled and draft:
                n = min(self.num_spec, draft_room(request, self.max_model_len, len(got)))
                if n > 0:
                    draft_rows.append(len(ids) - 1)
                    drafting.append(_Drafting(request, n, chunk.start + chunk.num_known + len(got) - 1,
                                              plan.table_rows[seqs[-1]]))
        first = BatchPlan(
            input_ids=tuple(ids),
            positions=tuple(plan.positions[i] for i in keep),
            slot_mapping=tuple(plan.slot_mapping[i] for i in keep),
            seq_lens=tuple(plan.seq_lens[i] for i in seqs),
            logits_indices=tuple(draft_rows),
            query_start_loc=tuple(query_start),
            num_decode_seqs=sum(1 for i in seqs if i < plan.num_decode_seqs),
            table_rows=tuple(plan.table_rows[i] for i in seqs),
        )
        return DraftPass(first, tuple(keep)), drafting

    def _chained_pass(
        self, active: list[_Drafting], hidden_rows: list[int], drafts: dict[str, list[int]], depth: int
    ) -> DraftPass:
        """Depth ``depth`` (>= 1): each request's last draft at the position after the previous pass's."""
        bs = self.block_size
        positions = [d.next_position - 1 + depth for d in active]
        seq_lens = [p + 1 for p in positions]
        plan = BatchPlan(
            input_ids=tuple(drafts[d.request.request_id][-1] for d in active),
            positions=tuple(positions),
            slot_mapping=tuple(d.request.block_ids[p // bs] * bs + p % bs for d, p in zip(active, positions)),
            seq_lens=tuple(seq_lens),
            logits_indices=tuple(range(len(active))),
            query_start_loc=tuple(range(len(active) + 1)),
            num_decode_seqs=len(active),
            table_rows=tuple(d.table_row for d in active),
        )
        return DraftPass(plan, tuple(hidden_rows))

    # ---- every rank ------------------------------------------------------------------------------
    def _share(self, step: DraftPass | None) -> DraftPass | None:
        """The leader's pass on every TP rank of its DP group (None: the step runs none)."""
        if self.ctx.tp > 1:
            step = broadcast_from_leader(step, self.ctx)  # type: ignore[assignment]
        return step

    def _run(self, step: DraftPass, hidden: torch.Tensor, max_tokens_per_rank: int, overlap: str,
             bucket: int | None) -> tuple[torch.Tensor, bool]:
        """The pass's output rows, and whether it replayed the captured draft graph."""
        hidden = _take(hidden, step.hidden_rows)
        if bucket is not None and self.replay is not None:
            return self.replay(step.plan, hidden, bucket, overlap), True
        self.dispatcher.begin_step(max_tokens_per_rank)
        batch = step.plan.to_batch(hidden.device, self.block_size, self.tables)
        return self.model.forward_mtp(batch, self.kv_caches, hidden, overlap), False  # type: ignore[arg-type]

    def _draft_logits(self, h: torch.Tensor, rows: tuple[int, ...], replayed: bool) -> torch.Tensor:
        """The drafting rows' MTP logits [D, V] fp32: those the replayed pass's graph computed (its head inside
        the recording), else the MTP head's, run here."""
        logits = self.replay_logits() if replayed else None
        return self.model.compute_mtp_logits(_take(h, rows)) if logits is None else _take(logits, rows)


def _tokens(result: StepResult | None, request_id: str) -> tuple[int, ...]:
    """The tokens a request got from this step's sampling (none for a request that did not sample)."""
    sampled = result.sampled.get(request_id, ()) if result is not None else ()
    return (sampled,) if isinstance(sampled, int) else tuple(sampled)


def _take(t: torch.Tensor, rows: tuple[int, ...] | list[int]) -> torch.Tensor:
    """``t[rows]``: a view where the rows are consecutive (a decode's kept rows, one drafting row), else a gather."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and all(b == a + 1 for a, b in zip(rows, rows[1:])):
        return t[rows[0] : rows[-1] + 1]
    return t[torch.tensor(rows, dtype=torch.long, device=t.device)]
