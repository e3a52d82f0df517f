"""Decode steps as one captured forward per batch bucket: CUDA graphs on a GPU; on the CPU the step's C kernel
calls recorded and replayed from C (``kernels/cpu_graph.py``), or ``torch.compile(fullgraph=True)``, with the
same padding.

A pure-decode step of ``n`` sequences runs as the bucket ``b >= n`` (1, 2, 4, 8, then every multiple of
8 up to the maximum): rows ``n..b`` are padding (token 0 at position 0, context length 0, their KV written
to a sink block the scheduler never hands out, their experts' work left out of the expert-load counters on one
rank), so every step of one bucket has the same shapes. A step sends the device its rows' host values alone,
one copy of O(bucket) integers (:class:`DecodeStep`: tokens, positions, slots, lengths and each row's row of
the device block tables, ``engine/block_tables.py``); the bucket's ``[bucket, max_blocks]`` table is gathered
on the device, before the graph runs. Nothing in the forward reads the device on the host (routing counts,
offsets, attention lengths stay tensors; the CPU references that do read them are custom ops), so the forward
captures as one CUDA graph and compiles as one graph: ``fullgraph=True`` is the proof. Prefill and mixed steps
run eagerly.

CUDA graphs are captured at start-up (:meth:`DecodeGraphs.warm_up`, every bucket, largest first), after a
probe capture of the largest bucket measured what the graphs need so the KV pool is sized without it
(``engine/runner.py``). ``torch.compile`` graphs on the CPU compile at a bucket's first use: compiling every
bucket would take minutes of start-up. CPU graphs record at a bucket's first use too (one eager forward);
their buckets are every batch size up to the kernels' ``TILE_M`` rows, since a padding row costs the CPU
the experts it routes to, and a bucket whose forward cannot be recorded (a torch op on the step's data:
a collective, an FP8 reference) runs eagerly from then on. A CPU graph of the leader's decode holds the
model's head too (``head``): a replay leaves every row's logits beside the final hidden states, and the
sampling pipeline reads those (:attr:`DecodeGraphs.logits`) instead of running the head again; an MTP pass's
graph holds the MTP layer's head (its drafts' logits), which the proposer reads the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from epserve import env
from epserve.config import OverlapMode
from epserve.engine.block_tables import DeviceTables
from epserve.engine.decode_step import DecodeInputs, DecodeStep
from epserve.kernels import cpu as cpu_kernels
from epserve.kernels import decode_plan
from epserve.kernels.cpu_graph import CaptureError, CpuGraph, record
from epserve.model.batch import ForwardBatch
from epserve.model.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)

CaptureMode = Literal["cuda_graph", "compile", "cpu_graph"]


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """The padded batch sizes: 1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (and it)."""
    if max_batch < 1:
        raise ValueError(f"the largest captured batch must be >= 1, got {max_batch}")
    sizes = {b for b in (1, 2, 4) if b < max_batch} | set(range(8, max_batch, 8)) | {max_batch}
    return tuple(sorted(sizes))


def bucket_schedules(buckets: tuple[int, ...], schedule: Callable[[int], OverlapMode]) -> dict[int, OverlapMode]:
    """The schedule each bucket is captured with: that of the smallest step it serves (``schedule(tokens)``,
    a larger step of the bucket may run two micro-batches, eagerly). Buckets whose smallest step already
    runs micro-batches are left out: no step replays them."""
    schedules, previous = {}, 0
    for bucket in buckets:
        overlap = schedule(previous + 1)
        if overlap != "microbatch":
            schedules[bucket] = overlap
        previous = bucket
    return schedules


@dataclass(frozen=True)
class WarmUp:
    """What :meth:`DecodeGraphs.warm_up` did: the buckets run once (largest first), how long it took and
    how much more device memory is in use afterwards (CUDA: the graphs' pool and the workspaces their
    warm-up runs left in the allocator; 0 on the CPU)."""

    buckets: tuple[int, ...]
    seconds: float
    memory_bytes: int


class DecodeGraphs:
    """The model's decode forward per bucket, captured (``cuda_graph``), recorded (``cpu_graph``) or compiled
    (``compile``); with ``mtp``, the MTP layer's draft pass instead (its inputs carry the previous depth's hidden
    states). Every mode runs a bucket on its static inputs (:meth:`stage`), planned before each run
    (``kernels/decode_plan.py``: before a CUDA graph's warm-up run, its capture and every replay; before a CPU
    graph's recording and every replay; before every call of the compiled forward)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        mode: CaptureMode,
        on_bucket: Callable[[int], None] | None = None,
        mtp: bool = False,
        tables: DeviceTables | None = None,
        head: bool = False,
    ) -> None:
        """``on_bucket(bucket)`` runs before every forward of a bucket (the dispatcher's ``begin_step``);
        ``tables``: the rank's device block tables, which a step's rows are gathered from (:meth:`run`);
        ``head`` (``cpu_graph`` only): each bucket's forward computes the logits of its rows too (with ``mtp``,
        the MTP layer's head)."""
        self.model = model
        self.mtp = mtp
        self.head = head and mode == "cpu_graph"
        self.logits: torch.Tensor | None = None  # the last run's logits [bucket, V] fp32, with ``head``
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.tables = tables
        self.buckets = (tuple(range(1, min(max_batch, cpu_kernels.TILE_M) + 1)) if mode == "cpu_graph"
                        else decode_buckets(max_batch))
        self._bucket_of = tuple(next(b for b in self.buckets if b >= n) for n in range(self.buckets[-1] + 1))
        self.mode = mode
        self._fn = self._forward_mtp if mtp else self._forward  # the forward a bucket runs
        self.on_bucket = on_bucket or (lambda bucket: None)
        # each bucket's static inputs (its graphs read them), the first four rows of one [5, bucket] tensor whose
        # last row holds the step's table rows: a step's host values land in it in one copy
        self._inputs: dict[int, tuple[DecodeInputs, torch.Tensor]] = {}
        self._graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._pool: tuple[int, int] | None = None  # the CUDA graphs' shared memory pool
        # (bucket, overlap) -> the graph, and what it leaves: the hidden states and (``head``) the logits
        self._cpu_graphs: dict[tuple[int, str], tuple[CpuGraph, tuple[torch.Tensor, torch.Tensor | None]]] = {}
        self._eager: set[tuple[int, str]] = set()  # CPU buckets whose forward could not be recorded
        self._warm: set[tuple[int, str]] = set()  # (bucket, overlap) run once: captured or compiled
        self.warming_up = False  # a first run (capture or compile) is under way: a step may take minutes
        if mode == "compile":
            import torch._dynamo

            for dtype in (torch.bfloat16, torch.float32):  # decided before tracing (the forward's GEMMs ask it)
                cpu_kernels.available(dtype)

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.buckets))
            self._compiled = torch.compile(self._fn, fullgraph=True, dynamic=False, backend=env.compile_backend())

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` rows, or None above the largest (run eagerly)."""
        return self._bucket_of[num_seqs] if num_seqs < len(self._bucket_of) else None

    def _batch(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
               seq_lens: torch.Tensor, block_tables: torch.Tensor) -> ForwardBatch:
        """A bucket's rows as the model's batch. A padding row's context length is 0, a request's at least 1:
        the rows counted by the expert load are told apart on the device (a CPU graph's buckets hold no padding
        row, and its recording no torch op: it leaves them unmarked)."""
        bucket = input_ids.shape[0]
        return ForwardBatch(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, seq_lens=seq_lens,
            block_tables=block_tables, logits_indices=torch.arange(bucket, device=input_ids.device),
            num_decode_seqs=bucket, seq_lens_cpu=(0,) * bucket, query_start_loc_cpu=tuple(range(bucket + 1)),
            block_size=self.block_size, real_rows=None if self.mode == "cpu_graph" else seq_lens > 0,
        )

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        overlap: OverlapMode,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states of every row [bucket, H] (the one forward captured or compiled)."""
        return self.model(self._batch(input_ids, positions, slot_mapping, seq_lens, block_tables), self.kv_caches,
                          overlap)

    def _forward_mtp(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        overlap: OverlapMode,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The MTP layer's output of every row [bucket, H], fed ``hidden`` (a function of its own: compiled, the
        draft passes' buckets count against their own recompile limit, not the decode's)."""
        batch = self._batch(input_ids, positions, slot_mapping, seq_lens, block_tables)
        return self.model.forward_mtp(batch, self.kv_caches, hidden, overlap)  # type: ignore[arg-type]

    @staticmethod
    def _args(inputs: DecodeInputs, overlap: OverlapMode) -> tuple:
        return (*inputs.tensors()[:5], overlap, inputs.hidden)

    def stage(self, step: DecodeStep) -> DecodeInputs:
        """The bucket's static inputs holding ``step``: its host values copied to the device at once, then its
        rows' block tables gathered from the device tables (outside any graph; on the CPU both without a torch op,
        ``engine/block_tables.py``)."""
        assert self.tables is not None, "a decode step needs the device block tables"
        entry = self._inputs.get(step.bucket)
        if entry is None:
            entry = self._inputs[step.bucket] = self._static(step)
        static, packed = entry
        self.tables.stage((step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.table_rows),
                          out=packed)
        self.tables.gather(packed[4], out=static.block_tables)
        if static.hidden is not None:
            n = step.hidden.shape[0]  # type: ignore[union-attr]
            static.hidden[:n].copy_(step.hidden)  # type: ignore[arg-type]
            if n < step.bucket:
                static.hidden[n:].zero_()
        return static

    def _static(self, step: DecodeStep) -> tuple[DecodeInputs, torch.Tensor]:
        """A bucket's static inputs, its own tensors (shared by its schedules' graphs, never by two buckets:
        a kernel that plans on the host knows a bucket by them, ``kernels/decode_plan.py``), and the [5, bucket]
        tensor whose rows are the first four of them and the step's table rows."""
        assert self.tables is not None
        rows, device = step.bucket, self.tables.device
        packed = torch.zeros(5, rows, dtype=torch.long, device=device)
        hidden = None
        if self.mtp:
            assert step.hidden is not None, "an MTP pass needs the previous depth's hidden states"
            hidden = step.hidden.new_zeros(rows, step.hidden.shape[1])
        tables = torch.zeros(rows, self.tables.max_blocks, dtype=torch.long, device=device)
        return DecodeInputs(*packed[:4], tables, hidden), packed

    def _plan(self, static: DecodeInputs, step: DecodeStep) -> None:
        """The kernels that plan on the host told this step's lengths (``static`` holds the step)."""
        decode_plan.plan_replay(decode_plan.DecodeReplay(static.block_tables, static.seq_lens, step.seq_lens,
                                                         self.block_size))

    def run(self, step: DecodeStep, overlap: OverlapMode) -> torch.Tensor:
        """Hidden states [bucket, H] of a padded decode step (callers keep the real rows), in inference mode
        (entered here unless the caller is in it already: the runner's step is)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return DecodeGraphs.run(self, step, overlap)
        key = (step.bucket, overlap)
        if key in self._warm:
            return self._run(step, overlap)
        self.warming_up = True
        try:
            out = self._run(step, overlap)
        finally:
            self.warming_up = False
        self._warm.add(key)
        return out

    def warm_up(self, empty: Callable[[int], DecodeStep], schedules: dict[int, OverlapMode]) -> WarmUp:
        """Run each bucket of ``schedules`` once with its schedule, largest first, on all-padding steps
        (``empty(bucket)``): CUDA graphs are captured here, at start-up, instead of at a bucket's first
        use. Largest first, so every smaller graph fits in the memory the largest one's pool already holds.
        Every rank of an EP group calls it with the same buckets (the padded dispatch's collectives are
        inside)."""
        order = tuple(sorted(schedules, reverse=True))
        cuda = self.mode == "cuda_graph"
        if cuda:
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        for bucket in order:
            self.run(empty(bucket), schedules[bucket])
        used = 0
        if cuda:
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
        return WarmUp(order, time.perf_counter() - start, max(used, 0))

    def _run(self, step: DecodeStep, overlap: OverlapMode) -> torch.Tensor:
        self.on_bucket(step.bucket)
        static = self.stage(step)
        if self._compiled is not None:
            self._plan(static, step)
            return self._compiled(*self._args(static, overlap))
        if self.mode == "cpu_graph":
            hidden, self.logits = self._replay_cpu(static, step, overlap)
            return hidden
        graph, out = self._graph(static, step, overlap)
        self._plan(static, step)
        graph.replay()
        return out

    def _with_head(self, static: DecodeInputs, overlap: OverlapMode) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward on the bucket's static inputs, and with ``head`` the logits of its rows (an MTP pass's:
        the MTP layer's head)."""
        hidden = self._fn(*self._args(static, overlap))
        head = self.model.compute_mtp_logits if self.mtp else self.model.compute_logits
        return hidden, head(hidden) if self.head else None

    def _replay_cpu(self, static: DecodeInputs, step: DecodeStep,
                    overlap: OverlapMode) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The bucket's CPU graph replayed on its static inputs (recorded on its first use), or the eager
        forward for a bucket that cannot be recorded: the hidden states and (``head``) the logits."""
        key = (step.bucket, overlap)
        self._plan(static, step)
        if key in self._eager:
            return self._with_head(static, overlap)
        entry = self._cpu_graphs.get(key)
        if entry is not None:
            graph, out = entry
            graph.replay()
            return out
        # the modules' state a step reads or writes (the load counters are plain attributes, not buffers)
        buffers = [*self.model.buffers(), *(moe.expert_load for moe in self.model.moe_layers().values())]
        saved = [b.clone() for b in buffers]  # a failed recording's effects on them undone (the load counters)
        start = time.perf_counter()
        try:
            graph, out = record(lambda: self._with_head(static, overlap),  # type: ignore[arg-type,return-value]
                                [*static.tensors(), *self.kv_caches, *buffers])
        except CaptureError as e:
            for b, old in zip(buffers, saved):
                b.copy_(old)
            self._eager.add(key)
            logger.info("decode batch %d%s runs eagerly: %s", step.bucket, " (MTP)" if self.mtp else "", e)
            return self._with_head(static, overlap)
        self._cpu_graphs[key] = (graph, out)
        logger.debug("recorded the CPU decode of batch %d%s (%s): %d kernel calls in %.3f s", step.bucket,
                     " (MTP)" if self.mtp else "", overlap, len(graph.calls), time.perf_counter() - start)
        return out

    def _graph(self, static: DecodeInputs, step: DecodeStep,
               overlap: OverlapMode) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The bucket's CUDA graph, captured on its first use after one eager warm-up run on a side stream:
        the same static inputs, schedule and planning as the capture (kernels compiled, workspaces allocated
        by the same calls the graph then records)."""
        key = (step.bucket, overlap)
        if key not in self._graphs:
            start = time.perf_counter()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._plan(static, step)
                self._fn(*self._args(static, overlap))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            self._plan(static, step)
            with torch.cuda.graph(graph, pool=self._pool):  # one memory pool for every bucket's graph
                out = self._fn(*self._args(static, overlap))
            self._pool = graph.pool()
            self._graphs[key] = (graph, out)
            logger.debug("captured the decode graph of batch %d (%s) in %.2f s", step.bucket, overlap,
                         time.perf_counter() - start)
        return self._graphs[key]
