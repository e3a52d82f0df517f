"""One step's batch on the host (``BatchPlan``, what a leader broadcasts to its TP peers) and what the
leader sampled from it (``StepResult``); ``BatchPlan.to_batch`` makes the forward's tensors.

A plan built with the leader's ``TableRows`` (``engine/block_tables.py``) names each sequence row's row of the
device block tables and carries only the blocks appended since the last step; one built without carries every
row's whole block table (``block_tables``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epserve.engine.block_tables import DeviceTables, TableAppends, TableRows
from epserve.engine.kv_handoff import KVWrite
from epserve.engine.request import ScheduledChunk
from epserve.messages.sampling import TokenLogprobs
from epserve.model.batch import ForwardBatch


@dataclass(frozen=True)
class StepResult:
    """What the leader sampled: one token per request, or with speculative decoding the accepted drafts
    then the token after them (and one logprobs entry per token)."""

    sampled: dict[str, int | tuple[int, ...]]
    logprobs: dict[str, TokenLogprobs | tuple[TokenLogprobs, ...]]
    # the prompt positions' logprobs the step computed, for requests that asked (``request.prompt_logprobs``)
    prompt_logprobs: dict[str, tuple[TokenLogprobs, ...]] = field(default_factory=dict)


def block_tables(block_ids: list[list[int]], seq_lens: list[int], block_size: int) -> tuple[tuple[int, ...], ...]:
    """Each sequence's blocks, as many as the longest context needs, padded with 0 to one width."""
    width = max((-(-n // block_size) for n in seq_lens), default=0)
    return tuple((*ids[:width], *(0,) * (width - len(ids[:width]))) for ids in block_ids)


@dataclass(frozen=True)
class BatchPlan:
    """One step's batch on the host, as the leader broadcasts it to its TP peers (see ForwardBatch
    for the fields). An idle DP group runs the empty plan. Either ``block_tables`` (every row's blocks) or
    ``table_rows`` (each sequence row's row of the device tables, a decode's rows sharing its request's) with
    ``table_appends`` (the blocks the step adds to them, scattered on every rank before the forward)."""

    input_ids: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    slot_mapping: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    logits_indices: tuple[int, ...] = ()
    query_start_loc: tuple[int, ...] = (0,)
    num_decode_seqs: int = 0
    kv_writes: tuple[KVWrite, ...] = ()  # KV arrived from a prefill instance, written before the forward
    table_rows: tuple[int, ...] = ()
    table_appends: TableAppends = TableAppends()

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], block_size: int, table: TableRows | None = None) -> BatchPlan:
        """``chunks`` as the scheduler orders them: decodes (``ScheduledChunk.is_decode``) first. A decode
        with drafts becomes one decode row per token, each attending to the cache up to its own position
        (causal inside the query), all of them sampled (the target rows that verify the drafts). With
        ``table`` (the leader's device-table bookkeeping) the plan names table rows and carries the step's
        appends instead of whole block tables."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        row_chunks: list[ScheduledChunk] = []  # the chunk of each sequence row
        table_rows: list[int] = []
        num_decode = 0
        for chunk in chunks:
            row = table.row(chunk.request) if table is not None else 0
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(chunk.slot_ids(block_size))
            rows = chunk.num_tokens if chunk.drafts else 1
            for j in range(rows):
                query_start.append(query_start[-1] + (1 if chunk.drafts else chunk.num_tokens))
                seq_lens.append(chunk.start + j + 1 if chunk.drafts else chunk.end)
                row_chunks.append(chunk)
                table_rows.append(row)
                if chunk.needs_sample:
                    logits_idx.append(query_start[-1] - 1)
            num_decode += rows if chunk.is_decode else 0
        head = (tuple(input_ids), tuple(positions), tuple(slots), tuple(seq_lens))
        tail = (tuple(logits_idx), tuple(query_start), num_decode)
        if table is None:
            return cls(*head, block_tables([c.request.block_ids for c in row_chunks], seq_lens, block_size), *tail)
        return cls(*head, (), *tail, table_rows=tuple(table_rows), table_appends=table.take_appends())

    def to_batch(self, device: torch.device, block_size: int, tables: DeviceTables | None = None) -> ForwardBatch:
        """The forward's tensors on ``device``; a plan naming table rows reads its block tables from ``tables``
        (its appends already applied)."""
        def t(values: object) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        if self.table_rows:
            if tables is None:
                raise ValueError("a plan naming device table rows needs the device tables")
            width = -(-max(self.seq_lens) // block_size)
            block_ids = tables.select(self.table_rows, width)
        elif self.block_tables:
            block_ids = t(self.block_tables)
        else:
            block_ids = torch.zeros(0, 0, dtype=torch.long, device=device)
        return ForwardBatch(
            input_ids=t(self.input_ids),
            positions=t(self.positions),
            slot_mapping=t(self.slot_mapping),
            seq_lens=t(self.seq_lens),
            block_tables=block_ids,
            logits_indices=t(self.logits_indices),
            num_decode_seqs=self.num_decode_seqs,
            seq_lens_cpu=self.seq_lens,
            query_start_loc_cpu=self.query_start_loc,
            block_size=block_size,
        )
