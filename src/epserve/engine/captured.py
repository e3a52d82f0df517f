"""The captured decode of one rank: the decode forward's graphs and, with MTP, the draft passes' (a
pure-decode step's MTP passes are decode-shaped too: one row per kept position or drafting request), the
bucket every rank replays, and their start-up: a probe capture that measures what the graphs need before
the KV pool is sized, then every bucket captured largest first (``engine/graphs.py`` holds one set). A step's
block tables come from the rank's device tables (``engine/block_tables.py``): a plan names each row's table row,
the step copies only its O(bucket) host values to the device. A CPU graph of the leader's decode (the rank that
holds the model's head) computes its rows' logits too (:meth:`CapturedDecode.logits`), and a recorded MTP pass its
rows' draft logits (:meth:`CapturedDecode.draft_logits`)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from epserve.config import OverlapMode
from epserve.engine.batch_plan import BatchPlan
from epserve.engine.block_tables import DeviceTables
from epserve.engine.graphs import CaptureMode, DecodeGraphs, DecodeStep, bucket_schedules, decode_buckets
from epserve.kernels import mla_flashinfer_graph, ops
from epserve.model.deepseek_v3 import DeepseekV3ForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureShape:
    """What every graph of a rank is built for: the largest bucket, the padding rows' blocks and sink, the
    MTP pass's hidden states, the schedule a step of ``n`` tokens runs, the dispatcher's step hook."""

    max_batch: int
    block_size: int
    max_blocks_per_seq: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    schedule: Callable[[int], OverlapMode]
    begin_step: Callable[[int], None]  # the dispatcher's, with the rows of a bucket


class CapturedDecode:
    def __init__(self, model: DeepseekV3ForCausalLM, kv_caches: list[torch.Tensor], mode: CaptureMode,
                 shape: CaptureShape, mtp: bool, tables: DeviceTables | None = None, head: bool = True) -> None:
        """``tables``: the rank's device block tables (the runner's, which every step's appends reach); a
        probe's own when None. ``head``: the leader's CPU graphs hold the model's head (False: it runs after
        them, in the sampling pipeline, as every other capture mode's does)."""
        self.mode = mode
        self.shape = shape
        sink = kv_caches[0].shape[0] - 1  # the pool's last block
        self.sink_slot = sink * shape.block_size
        self.tables = tables or DeviceTables(shape.max_blocks_per_seq, sink, shape.device)
        head = head and mode == "cpu_graph" and model.lm_head.shape[0] > 0
        self.sets = [DecodeGraphs(model, kv_caches, shape.block_size, shape.max_batch, mode, on_bucket=shape.begin_step,
                                  mtp=draft, tables=self.tables, head=head) for draft in (False, True)[: 1 + mtp]]
        self.graphs = self.sets[0]
        self.drafts = self.sets[1] if mtp else None

    def schedules(self, graphs: DecodeGraphs) -> dict[int, OverlapMode]:
        return bucket_schedules(graphs.buckets, self.shape.schedule)

    def empty(self, bucket: int, mtp: bool = False) -> DecodeStep:
        """``bucket`` padding rows (what a capture runs on)."""
        s = self.shape
        hidden = torch.zeros(0, s.hidden_size, dtype=s.dtype, device=s.device) if mtp else None
        return DecodeStep.pad((), (), (), (), (), bucket, self.sink_slot, hidden)

    def pad(self, plan: BatchPlan, bucket: int, hidden: torch.Tensor | None = None) -> DecodeStep:
        """The plan's rows padded to ``bucket``, each reading its request's row of the device tables."""
        return DecodeStep.pad(plan.input_ids, plan.positions, plan.slot_mapping, plan.seq_lens, plan.table_rows,
                              bucket, self.sink_slot, hidden)

    def forward(self, plan: BatchPlan, bucket: int, overlap: OverlapMode) -> torch.Tensor:
        """The step's final hidden states, its real rows (the plan's appends already in the tables)."""
        hidden = self.graphs.run(self.pad(plan, bucket), overlap)
        return hidden if bucket == plan.num_tokens else hidden[: plan.num_tokens]

    def logits(self, rows: int) -> torch.Tensor | None:
        """The last :meth:`forward`'s logits of its ``rows`` real rows [rows, V] fp32 (the recorded CPU step
        computed them), or None (the head runs after the forward)."""
        logits = self.graphs.logits
        return logits if logits is None or logits.shape[0] == rows else logits[:rows]

    def draft(self, plan: BatchPlan, hidden: torch.Tensor, bucket: int, overlap: OverlapMode) -> torch.Tensor:
        """An MTP pass of a pure-decode step (the proposer's hook): the layer's output, its real rows. A draft
        row reads its request's table row (the step's appends cover the blocks the passes write). ``bucket``:
        the step's, which every rank replays; the CPU graph's rank replays alone, a bucket per size: there the
        pass runs the bucket of its own rows (a verification's rejected rows leave none: no padding row's
        experts to run, nor to count), and a pass of no rows runs nothing, as an eager one would."""
        assert self.drafts is not None
        if self.mode == "cpu_graph":
            if not plan.num_tokens:
                return hidden[:0]
            bucket = self.drafts.bucket_for(plan.num_tokens)  # type: ignore[assignment]
        return self.drafts.run(self.pad(plan, bucket, hidden), overlap)[: plan.num_tokens]

    def draft_logits(self) -> torch.Tensor | None:
        """The last :meth:`draft` pass's MTP logits, every row of its bucket [bucket, V] fp32 (the recorded pass
        computed them, the MTP layer's head included), or None (the proposer runs the MTP head)."""
        return None if self.drafts is None else self.drafts.logits

    def warm_up(self, largest_only: bool = False) -> tuple[int, float, int]:
        """Every bucket of every set run once, largest first (CUDA: captured); with ``largest_only`` only
        the largest of each. Returns (graphs, seconds, device memory bytes they added)."""
        count, seconds, memory = 0, 0.0, 0
        for graphs in self.sets:
            schedules = self.schedules(graphs)
            if largest_only and schedules:
                schedules = {max(schedules): schedules[max(schedules)]}
            warm = graphs.warm_up(partial(self.empty, mtp=graphs.mtp), schedules)
            count, seconds, memory = count + len(warm.buckets), seconds + warm.seconds, memory + warm.memory_bytes
        return count, seconds, memory


def probe_graph_memory(model: DeepseekV3ForCausalLM, kv_pool: Callable[[int], list[torch.Tensor]],
                       shape: CaptureShape, mtp: bool) -> int:
    """Device memory the captured decode needs, measured before the KV pool is sized: the largest bucket of
    each set captured over a one-block pool (a graph's memory does not depend on the pool's size: attention
    reads the pool in place), then released. Every rank of the EP group probes the same buckets."""
    probe = CapturedDecode(model, kv_pool(2), "cuda_graph", shape, mtp)
    measured = probe.warm_up(largest_only=True)[2]
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    return measured


def side_buffer_bytes(shape: CaptureShape, mode: CaptureMode | None, mtp: bool, kv_dtype: torch.dtype,
                      table_rows: int) -> int:
    """Device memory the decode allocates after the KV pool is sized, outside the graphs' pool, for the memory
    plan: the device block tables (``table_rows`` rows as wide as a sequence's blocks) and, where FlashInfer
    decodes MLA in the captured decode, each captured bucket's graph-mode wrapper (one per set: the MTP passes
    have their own; the largest bucket's is also in the probe's measurement, so this errs by one wrapper high)."""
    table = table_rows * shape.max_blocks_per_seq * torch.empty((), dtype=torch.long).element_size()
    if mode != "cuda_graph":
        return table
    targets = ops.mla_decode.chosen(shape.device.type, kv_dtype)
    if not any(t.startswith("epserve.kernels.mla_flashinfer:") for t in targets):
        return table
    wrappers = sum(mla_flashinfer_graph.wrapper_bytes(b, shape.max_blocks_per_seq)
                   for b in decode_buckets(shape.max_batch))
    return table + (1 + mtp) * wrappers


def capture_at_start(captured: CapturedDecode, probed_bytes: int) -> None:
    """Every bucket captured now, before serving (CUDA graphs); logged: how many, how long, how much."""
    count, seconds, memory = captured.warm_up()
    buckets = captured.graphs.buckets
    logger.info("captured %d decode graphs (batch %d..%d%s) in %.1f s: %.1f MiB of device memory (the probe "
                "had measured %.1f MiB)", count, buckets[0], buckets[-1],
                ", MTP passes too" if captured.drafts else "", seconds, memory / 2**20, probed_bytes / 2**20)
