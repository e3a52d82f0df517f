"""Structured outputs with xgrammar: a request's constraint (``StructuredOutput``) compiled into a
grammar, one matcher per constrained request on the leader that samples, and each step's token bitmask
applied to the constrained rows' logits before sampling.

Compiling happens off the step loop (``GrammarCompiler.submit``: in the grammar worker's processes,
``engine/grammar_worker.py``, a few at once, each bounded in size, time and memory and killed when its
request goes away; the last compiled grammars are cached by their constraint), so a request waits for
its grammar without holding others back and no constraint can crash or exhaust the rank: the loop queues
it once it compiled (``engine/loop.py``), and a constraint that does not compile, crashes its compile or
exceeds a bound (``engine/grammars.py``) fails its request as invalid, naming the problem. So does a JSON
schema that uses what xgrammar would silently ignore (``engine/json_schema.py``: the keyword and its JSON
pointer), and the string formats xgrammar gets wrong are replaced by exact patterns there. A structural
tag's tokens given by their text (a forced tool call's DeepSeek markers, ``router/tools.py``) become the
ids of the tokenizer's added tokens, so the model writes each marker as the one token it was trained on
(``grammars._resolve_tokens``). A request whose constraint and
sampling parameters leave a row no token, or whose grammar refuses a sampled token, fails alone
(``GrammarMasks.accept``; the engine aborts it, the loop reports why), never the step; where the grammar
can only end, it ends whatever ``min_tokens`` says. The matcher allows EOS only where the grammar can end, and
advances on every token the request keeps; it lives until the request finishes (a preemption recomputes
the KV, not the tokens, so the matcher stays right). With MTP, verification row ``j`` is masked by the
grammar after the first ``j`` drafts (accepted tentatively, then rolled back): a draft the grammar
refuses has probability 0 there and is rejected, so the output is exactly plain decoding's; the MTP
draft rows are masked likewise (``apply_after``), so the drafts follow the grammar too.

xgrammar (and through it transformers) is imported on first use: engines that never see a constraint
do not pay for it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from epserve.engine.grammar_worker import GrammarWorker
from epserve.engine.grammars import CompileLimits, check_bounds, compile_constraint, compile_grammar, load_compiler
from epserve.messages.sampling import StructuredOutput

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer and vocabulary: a serving engine's in its grammar
    worker (:meth:`submit`: at most ``limits.parallel`` at once, each bounded in size, time and memory,
    cancellable), offline ones on the caller's thread (:meth:`compile`, bounded in size). The last
    ``cache_size`` compiled grammars are kept by their constraint (a request whose constraint compiled
    before does not compile again)."""

    def __init__(self, model_path: str | Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = 256, limits: CompileLimits | None = None) -> None:
        self.model_path = Path(model_path)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.limits = limits if limits is not None else CompileLimits()
        self.num_compiled = 0  # constraints compiled (not taken from the cache)
        self.worker = GrammarWorker(model_path, vocab_size, eos_token_ids)
        self._compiler: Any = None  # (offline: from the tokenizer; serving: ``_from_worker``)
        self._from_worker: Any = None
        self._added: dict[str, int] = {}  # the tokenizer's added tokens (their text: their id)
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()  # (the compiler's threads and callers of ``compile``)
        self._jobs: dict[Future, int] = {}  # submitted, not done: their compile's id in the worker
        self._ids = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=self.limits.parallel, thread_name_prefix="epserve-grammar")
        weakref.finalize(self, self.worker.close)

    @property
    def available(self) -> bool:
        return (self.model_path / "tokenizer.json").is_file()

    def submit(self, constraint: StructuredOutput) -> Future:
        """The compiled grammar, later, from the grammar worker (the future raises ValueError naming what
        does not compile or which bound it exceeds); :meth:`cancel` stops it."""
        grammar = self._cached(constraint)
        if grammar is not None:
            done: Future = Future()
            done.set_result(grammar)
            return done
        job = next(self._ids)
        future = self._pool.submit(self.compile_in_worker, constraint, job)
        with self._lock:
            self._jobs[future] = job
        future.add_done_callback(self._forget)
        return future

    def cancel(self, future: Future) -> None:
        """Stop a submitted compile: dropped while it waits for a thread, killed while it compiles."""
        if future.cancel():
            return
        with self._lock:
            job = self._jobs.get(future)
        if job is not None:
            self.worker.cancel(job)

    @property
    def num_pending(self) -> int:
        """Submitted compiles not done (waiting for a thread or compiling)."""
        with self._lock:
            return len(self._jobs)

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._jobs.pop(future, None)

    def compile_in_worker(self, constraint: StructuredOutput, job: int) -> Any:
        """The compiled grammar of ``constraint``, on one of the compiler's threads: its EBNF grammar from
        the grammar worker (compile ``job`` there, which compiled it within the limits), compiled here;
        ValueError naming what does not compile or which bound it exceeds."""
        grammar = self._cached(constraint)
        if grammar is None:
            check_bounds(constraint.kind, constraint.spec, self.limits)
            ebnf = self.worker.compile(job, constraint.kind, constraint.spec, self.limits)
            kind = "json_schema" if constraint.kind == "json_object" else constraint.kind
            grammar = self._store(constraint, compile_grammar(self._worker_compiler(), kind, ebnf))
        return grammar

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint`` on the caller's thread (from the cache when it compiled
        before); ValueError naming what does not compile, would not be enforced or exceeds a bound."""
        grammar = self._cached(constraint)
        if grammar is None:
            check_bounds(constraint.kind, constraint.spec, self.limits)
            grammar = self._store(constraint, compile_constraint(self._get_compiler(), self._added, self.vocab_size,
                                                                 constraint.kind, constraint.spec))
        return grammar

    def _cached(self, constraint: StructuredOutput) -> Any:
        with self._lock:
            grammar = self._cache.get(constraint)
            if grammar is not None:
                self._cache.move_to_end(constraint)
            return grammar

    def _store(self, constraint: StructuredOutput, grammar: Any) -> Any:
        with self._lock:
            self.num_compiled += 1
            self._cache[constraint] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _worker_compiler(self) -> Any:
        """xgrammar's compiler for the grammar worker's tokenizer info (no tokenizer loaded here)."""
        with self._lock:
            if self._from_worker is None:
                import xgrammar as xgr

                self._from_worker = xgr.GrammarCompiler(self.worker.tokenizer_info, max_threads=1,
                                                        cache_enabled=False)
            return self._from_worker

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                self._compiler, self._added, _ = load_compiler(self.model_path, self.vocab_size,
                                                               self.eos_token_ids)
                logger.info("structured outputs: xgrammar compiler ready (%d entries)", self.vocab_size)
            return self._compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.worker.close()


class GrammarMasks:
    """The leader's matchers, one per constrained request, and the per-step bitmask.

    Where the constraints of a request leave a row no token at all, that request fails alone: the
    grammar wins over ``min_tokens`` (a row whose grammar allows nothing but its end gets EOS back,
    though ``min_tokens`` masked it: the output ends shorter than ``min_tokens``); where ``bad_words``,
    ``logit_bias`` or the stop tokens under ``min_tokens`` mask every token the grammar allows, or the
    matcher refuses a token it is given, :meth:`accept` records the request's failure (``take_failures``;
    the engine aborts it and its client gets the reason) instead of raising: nothing one request asks
    for fails the step. Whether a masked row kept a token is computed on the device with the mask and
    read after sampling (whose own transfer has synchronized by then).
    """

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None
        # this step's masked rows: per request the index, in ``_empty``, of its row ``j`` (after its first
        # ``j`` drafts), and whether each masked row was left without any token ([rows] bool, device)
        self._rows: dict[str, list[int]] = {}
        self._empty: torch.Tensor | None = None
        self._empty_host: list[bool] | None = None
        self._failures: dict[str, str] = {}

    def add(self, request_id: str, grammar: Any) -> None:
        import xgrammar as xgr

        # (-1: unbounded rollback, for the drafts a verification tries tentatively)
        self._matchers[request_id] = xgr.GrammarMatcher(grammar, max_rollback_tokens=-1)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._failures.pop(request_id, None)

    def constrains(self, request_id: str) -> bool:
        return request_id in self._matchers

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def apply(self, logits: torch.Tensor, request_ids: list[str], held: Collection[int] = ()) -> None:
        """Mask, in place, what each constrained row's grammar does not allow next (rows of other
        requests untouched): the bitmask is filled on the host, applied on the logits' device. ``held``:
        the rows whose EOS ``min_tokens`` masked (``constraints.min_tokens_rows``)."""
        self.apply_groups(logits, [(rid, r, ()) for r, rid in enumerate(request_ids)], held)

    def apply_groups(self, logits: torch.Tensor, groups: list[tuple[str, int, tuple[int, ...]]],
                     held: Collection[int] = ()) -> None:
        """The same for a verification's rows: ``(request, first row, drafts)``, rows ``first + j`` follow
        the request's first ``j`` drafts. Each row's mask is its grammar after those drafts (accepted
        tentatively, then rolled back); rows after a draft the grammar refuses are left as they are (that
        draft has probability 0 under its masked row, so verification stops there)."""
        self._rows, self._empty, self._empty_host = {}, None, None
        groups = [g for g in groups if g[0] in self._matchers]
        if not groups:
            return
        bitmask = self._buffer(logits.shape[0])
        rows: list[int] = []
        for rid, first, drafts in groups:
            matcher, tried = self._matchers[rid], 0
            mine = self._rows[rid] = []
            for j in range(len(drafts) + 1):
                self._fill(matcher, bitmask, first + j)
                mine.append(len(rows))
                rows.append(first + j)
                if j == len(drafts) or matcher.is_terminated() or not matcher.accept_token(drafts[j]):
                    break
                tried += 1
            if tried:
                matcher.rollback(tried)
        self._empty = self._mask(logits, bitmask, rows, held)

    def apply_after(self, logits: torch.Tensor, rows: list[tuple[str, int, tuple[int, ...]]],
                    held: Collection[int] = ()) -> None:
        """Mask row ``row`` by the request's grammar after ``tokens`` it does not hold yet (an MTP draft row:
        the drafts before it), accepted tentatively and rolled back; a row whose tokens the grammar
        refuses is left as it is. A row left without any token is made uniform instead (its draft is
        rejected by a verification row as empty, which fails the request): no NaN reaches the drafts'
        distributions."""
        rows = [r for r in rows if r[0] in self._matchers]
        if not rows:
            return
        bitmask = self._buffer(logits.shape[0])
        masked = []
        for rid, row, tokens in rows:
            matcher, tried = self._matchers[rid], 0
            for token in tokens:
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                tried += 1
            if tried == len(tokens):
                self._fill(matcher, bitmask, row)
                masked.append(row)
            if tried:
                matcher.rollback(tried)
        if masked:
            empty = self._mask(logits, bitmask, masked, held)
            index = torch.tensor(masked, dtype=torch.long, device=logits.device)
            logits[index] = logits[index].masked_fill(empty[:, None], 0.0)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The host bitmask for ``num_rows`` rows (grown as needed, kept between steps)."""
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        return self._bitmask[:num_rows]

    def _mask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int],
              held: Collection[int]) -> torch.Tensor:
        """The filled ``rows`` of ``bitmask`` applied to the logits, on their device; in the ``held`` rows
        whose grammar allows only its end, EOS unmasked again (``min_tokens`` masked it). Returns, for each
        of ``rows``, whether it was left without any token ([len(rows)] bool, on the device; not read)."""
        import xgrammar as xgr

        device = logits.device
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True), indices=rows)
        ends = [(r, t) for r in rows if r in held for t in self._only_ends(bitmask[r])]
        if ends:
            at = (torch.tensor([r for r, _ in ends], device=device), torch.tensor([t for _, t in ends], device=device))
            values = logits[at]
            logits[at] = values.masked_fill(torch.isneginf(values), 0.0)
        index = torch.tensor(rows, dtype=torch.long, device=device)
        return torch.isneginf(logits.index_select(0, index)).all(dim=-1)

    def _only_ends(self, words: torch.Tensor) -> list[int]:
        """The EOS tokens a bitmask row ``words`` allows if it allows nothing else, else none."""
        allowed = [t for t in self.eos_token_ids if t < self.vocab_size and int(words[t // 32]) >> (t % 32) & 1]
        if not allowed:
            return []
        rest = words.clone()
        for t in allowed:
            bit = 1 << (t % 32)
            rest[t // 32] &= ~(bit - (1 << 32) if bit >= 1 << 31 else bit)  # (an int32 word)
        return [] if bool(rest.any()) else allowed

    def _fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        if matcher.is_terminated():  # complete (a request that ignores EOS goes on): EOS only
            bitmask[row] = 0
            for t in self.eos_token_ids:
                bit = 1 << (t % 32)
                bitmask[row, t // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # (an int32 word)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, request_id: str, tokens: list[int] | tuple[int, ...]) -> bool:
        """The tokens the request keeps, in order, after this step's sampling (a verification's: the
        accepted drafts and the token after them). False, with the request's failure recorded and its
        matcher dropped, where a row they were drawn from had no token left or the grammar refuses one."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return request_id not in self._failures
        rows = self._rows.pop(request_id, None)
        if rows is not None and self._empty is not None:
            if self._empty_host is None:
                self._empty_host = self._empty.tolist()
            if any(self._empty_host[i] for i in rows[: len(tokens)]):
                return self._fail(request_id, "the structured-output constraint and the sampling parameters "
                                  "leave no token allowed (bad_words, logit_bias or the stop tokens under "
                                  "min_tokens mask every token the grammar allows next)")
        for token in tokens:
            if matcher.is_terminated():
                return True
            if not matcher.accept_token(token):
                return self._fail(request_id, f"the sampled token {token} breaks the structured-output grammar")
        return True

    def _fail(self, request_id: str, why: str) -> bool:
        logger.warning("request %s fails: %s", request_id, why)
        del self._matchers[request_id]
        self._failures[request_id] = why
        return False

    def take_failures(self) -> dict[str, str]:
        """The requests :meth:`accept` failed since the last call, and why."""
        failures, self._failures = self._failures, {}
        return failures
