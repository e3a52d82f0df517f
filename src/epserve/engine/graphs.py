"""Decode steps as one captured forward per batch bucket: CUDA graphs on a GPU; on the CPU the step's C kernel
calls recorded and replayed from C (``kernels/cpu_graph.py``), or ``torch.compile(fullgraph=True)``, with the
same padding.

A pure-decode step of ``n`` sequences runs as the bucket ``b >= n`` (1, 2, 4, 8, then every multiple of
8 up to the maximum): rows ``n..b`` are padding (token 0 at position 0, context length 0, their KV written
to a sink block the scheduler never hands out), so every step of one bucket has the same shapes. Nothing in
the forward reads the device on the host (routing counts, offsets, attention lengths stay tensors; the CPU
references that do read them are custom ops), so the forward captures as one CUDA graph and compiles as
one graph: ``fullgraph=True`` is the proof. Prefill and mixed steps run eagerly.

CUDA graphs are captured at start-up (:meth:`DecodeGraphs.warm_up`, every bucket, largest first), after a
probe capture of the largest bucket measured what the graphs need so the KV pool is sized without it
(``engine/runner.py``). ``torch.compile`` graphs on the CPU compile at a bucket's first use: compiling every
bucket would take minutes of start-up. CPU graphs record at a bucket's first use too (one eager forward);
their buckets are every batch size up to the kernels' ``TILE_M`` rows, since a padding row costs the CPU
the experts it routes to, and a bucket whose forward cannot be recorded (a torch op on the step's data:
a collective, an FP8 reference) runs eagerly from then on.
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
from epserve.kernels import cpu as cpu_kernels
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


@dataclass(frozen=True)
class DecodeInputs:
    """A decode batch padded to its bucket: one token per row. [bucket] each, tables [bucket, max_blocks]."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    hidden: torch.Tensor | None = None  # [bucket, H] for the MTP layer: the previous depth's hidden states

    @property
    def bucket(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> tuple[torch.Tensor, ...]:
        base = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)
        return base if self.hidden is None else (*base, self.hidden)


def pad_decode(
    input_ids: tuple[int, ...],
    positions: tuple[int, ...],
    slot_mapping: tuple[int, ...],
    seq_lens: tuple[int, ...],
    block_tables: tuple[tuple[int, ...], ...],  # one width for every row
    bucket: int,
    max_blocks: int,
    sink_slot: int,
    device: torch.device,
    hidden: torch.Tensor | None = None,
) -> DecodeInputs:
    """The ``n`` decode rows (one token each) padded to ``bucket`` rows (context length 0); with ``hidden``
    ([n, H] on the device, an MTP pass's input) zero rows padding it too."""
    n = len(input_ids)
    if n > bucket:
        raise ValueError(f"{n} decode rows do not fit bucket {bucket}")
    pad = bucket - n
    tables = torch.zeros(bucket, max_blocks, dtype=torch.long)
    if n:  # the plan's rows share one width (BatchPlan pads them), at most the model's blocks per sequence
        rows = torch.tensor(block_tables, dtype=torch.long)
        tables[:n, : rows.shape[1]] = rows

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    host = DecodeInputs(
        input_ids=t([*input_ids, *[0] * pad]),
        positions=t([*positions, *[0] * pad]),
        slot_mapping=t([*slot_mapping, *[sink_slot] * pad]),
        seq_lens=t([*seq_lens, *[0] * pad]),
        block_tables=tables,
    )
    moved = (x.to(device, non_blocking=True) for x in host.tensors())
    if hidden is not None:
        hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])]) if pad else hidden
    return DecodeInputs(*moved, hidden=hidden)


class DecodeGraphs:
    """The model's decode forward per bucket, captured (``cuda_graph``) or compiled (``compile``); with
    ``mtp``, the MTP layer's draft pass instead (its inputs carry the previous depth's hidden states)."""

    def __init__(
        self,
        model: DeepseekV3ForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_batch: int,
        mode: CaptureMode,
        on_bucket: Callable[[int], None] | None = None,
        mtp: bool = False,
    ) -> None:
        """``on_bucket(bucket)`` runs before every forward of a bucket (the dispatcher's ``begin_step``)."""
        self.model = model
        self.mtp = mtp
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = (tuple(range(1, min(max_batch, cpu_kernels.TILE_M) + 1)) if mode == "cpu_graph"
                        else decode_buckets(max_batch))
        self.mode = mode
        self.on_bucket = on_bucket or (lambda bucket: None)
        self._graphs: dict[tuple[int, str], tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor]] = {}
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._pool: tuple[int, int] | None = None  # the CUDA graphs' shared memory pool
        self._cpu_graphs: dict[tuple[int, str], tuple[CpuGraph, DecodeInputs, torch.Tensor]] = {}
        self._eager: set[tuple[int, str]] = set()  # CPU buckets whose forward could not be recorded
        self._warm: set[tuple[int, str]] = set()  # (bucket, overlap) run once: captured or compiled
        self.warming_up = False  # a first run (capture or compile) is under way: a step may take minutes
        if mode == "compile":
            import torch._dynamo

            for dtype in (torch.bfloat16, torch.float32):  # decided before tracing (the forward's GEMMs ask it)
                cpu_kernels.available(dtype)

            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 2 * len(self.buckets))
            self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False, backend=env.compile_backend())

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` rows, or None above the largest (run eagerly)."""
        return next((b for b in self.buckets if b >= num_seqs), None)

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
        """Final hidden states of every row [bucket, H] (the one forward captured or compiled); the MTP
        layer's output with ``mtp``."""
        bucket = input_ids.shape[0]
        batch = ForwardBatch(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, seq_lens=seq_lens,
            block_tables=block_tables, logits_indices=torch.arange(bucket, device=input_ids.device),
            num_decode_seqs=bucket, seq_lens_cpu=(0,) * bucket, query_start_loc_cpu=tuple(range(bucket + 1)),
            block_size=self.block_size,
        )
        if self.mtp:
            return self.model.forward_mtp(batch, self.kv_caches, hidden, overlap)  # type: ignore[arg-type]
        return self.model(batch, self.kv_caches, overlap)

    @staticmethod
    def _args(inputs: DecodeInputs, overlap: OverlapMode) -> tuple:
        return (*inputs.tensors()[:5], overlap, inputs.hidden)

    @torch.inference_mode()
    def run(self, inputs: DecodeInputs, overlap: OverlapMode) -> torch.Tensor:
        """Hidden states [bucket, H] of a padded decode batch (callers keep the real rows)."""
        key = (inputs.bucket, overlap)
        if key in self._warm:
            return self._run(inputs, overlap)
        self.warming_up = True
        try:
            out = self._run(inputs, overlap)
        finally:
            self.warming_up = False
        self._warm.add(key)
        return out

    def warm_up(self, empty_inputs: Callable[[int], DecodeInputs], schedules: dict[int, OverlapMode]) -> WarmUp:
        """Run each bucket of ``schedules`` once with its schedule, largest first, on all-padding inputs
        (``empty_inputs(bucket)``): CUDA graphs are captured here, at start-up, instead of at a bucket's first
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
            self.run(empty_inputs(bucket), schedules[bucket])
        used = 0
        if cuda:
            torch.cuda.synchronize()
            used = free_before - torch.cuda.mem_get_info()[0]
        return WarmUp(order, time.perf_counter() - start, max(used, 0))

    def _run(self, inputs: DecodeInputs, overlap: OverlapMode) -> torch.Tensor:
        self.on_bucket(inputs.bucket)
        if self._compiled is not None:
            return self._compiled(*self._args(inputs, overlap))
        if self.mode == "cpu_graph":
            return self._replay_cpu(inputs, overlap)
        graph, static, out = self._graph(inputs, overlap)
        for dst, src in zip(static.tensors(), inputs.tensors()):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return out

    def _replay_cpu(self, inputs: DecodeInputs, overlap: OverlapMode) -> torch.Tensor:
        """The bucket's CPU graph replayed on ``inputs`` (recorded on its first use), or the eager forward
        for a bucket that cannot be recorded."""
        key = (inputs.bucket, overlap)
        if key in self._eager:
            return self._forward(*self._args(inputs, overlap))
        entry = self._cpu_graphs.get(key)
        if entry is not None:
            graph, static, out = entry
            for dst, src in zip(static.tensors(), inputs.tensors()):
                dst.copy_(src)
            graph.replay()
            return out
        static = DecodeInputs(*(t.clone() for t in inputs.tensors()[:5]),
                              hidden=None if inputs.hidden is None else inputs.hidden.clone())
        # the modules' state a step reads or writes (the load counters are plain attributes, not buffers)
        buffers = [*self.model.buffers(), *(moe.expert_load for moe in self.model.moe_layers().values())]
        saved = [b.clone() for b in buffers]  # a failed recording's effects on them undone (the load counters)
        start = time.perf_counter()
        try:
            graph, out = record(lambda: self._forward(*self._args(static, overlap)),
                                [*static.tensors(), *self.kv_caches, *buffers])
        except CaptureError as e:
            for b, old in zip(buffers, saved):
                b.copy_(old)
            self._eager.add(key)
            logger.info("decode batch %d%s runs eagerly: %s", inputs.bucket, " (MTP)" if self.mtp else "", e)
            return self._forward(*self._args(inputs, overlap))
        self._cpu_graphs[key] = (graph, static, out)
        logger.debug("recorded the CPU decode of batch %d%s (%s): %d kernel calls in %.3f s", inputs.bucket,
                     " (MTP)" if self.mtp else "", overlap, len(graph.calls), time.perf_counter() - start)
        return out

    def _graph(self, inputs: DecodeInputs,
               overlap: OverlapMode) -> tuple[torch.cuda.CUDAGraph, DecodeInputs, torch.Tensor]:
        """The bucket's CUDA graph, captured on its first use (after one eager warm-up on a side stream)."""
        key = (inputs.bucket, overlap)
        if key not in self._graphs:
            start = time.perf_counter()
            static = DecodeInputs(*(t.clone() for t in inputs.tensors()[:5]),
                                  hidden=None if inputs.hidden is None else inputs.hidden.clone())
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(*self._args(static, overlap))  # warm-up: kernels compiled, workspaces allocated
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):  # one memory pool for every bucket's graph
                out = self._forward(*self._args(static, overlap))
            self._pool = graph.pool()
            self._graphs[key] = (graph, static, out)
            logger.debug("captured the decode graph of batch %d (%s) in %.2f s", inputs.bucket, overlap,
                         time.perf_counter() - start)
        return self._graphs[key]
