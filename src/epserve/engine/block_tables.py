"""Block tables kept on the device and updated as requests grow: a step moves to the device only the blocks
appended since the last step and, for a captured decode, one table row index per batch row.

Every request that has run a step holds one row of a rank's device table (``DeviceTables``) for its life: the
row's column ``i`` is the request's block ``i``. A DP group's leader keeps the bookkeeping (``TableRows``, owned
by its KV cache manager, which is where blocks are allocated, trimmed and freed): which row each request holds,
how many of its blocks that row holds already, which rows are free again. Building a step's plan
(``BatchPlan.from_chunks``) asks it for each chunk's row; the blocks a request gained since its last step
become (row, column, block) appends in the plan, which every rank of the group scatters into its table before
the step's forward. A row freed (the request finished, was preempted or handed its KV off) is reused by a later
request: its new blocks overwrite the columns it reads, and a row's columns past its length are never read.

Row 0 is the padding row: every column the sink block (the block past those the scheduler hands out), length
0 wherever it is used. A captured decode gathers the rows its batch needs into the bucket's static table on the
device (``DeviceTables.gather``), outside the graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from epserve.engine.request import Request

PAD_ROW = 0


@dataclass(frozen=True)
class TableAppends:
    """Blocks a step adds to the device tables: ``blocks[i]`` at row ``rows[i]``, column ``columns[i]``."""

    rows: tuple[int, ...] = ()
    columns: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)


class TableRows:
    """The leader's bookkeeping of the device tables: a row per request that has been in a plan and still
    holds its blocks, and how many of those blocks the row holds."""

    def __init__(self) -> None:
        self._row: dict[str, int] = {}
        self._held: dict[str, int] = {}  # blocks of the request its row holds
        self._free: list[int] = []  # released rows, reused before new ones
        self.num_rows = PAD_ROW + 1  # rows ever handed out, the padding row included
        self._rows: list[int] = []
        self._columns: list[int] = []
        self._blocks: list[int] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._row

    def row(self, request: Request) -> int:
        """The request's row (a free one the first time), its blocks past those the row holds recorded as
        appends (:meth:`take_appends`)."""
        rid = request.request_id
        row = self._row.get(rid)
        if row is None:
            row = self._free.pop() if self._free else self.num_rows
            self.num_rows = max(self.num_rows, row + 1)
            self._row[rid], self._held[rid] = row, 0
        blocks, held = request.block_ids, self._held[rid]
        if len(blocks) > held:
            new = range(held, len(blocks))
            self._rows.extend([row] * len(new))
            self._columns.extend(new)
            self._blocks.extend(blocks[held:])
            self._held[rid] = len(blocks)
        return row

    def truncate(self, request_id: str, keep: int) -> None:
        """The request kept only its first ``keep`` blocks (the rest freed): later blocks are appended again."""
        if request_id in self._held:
            self._held[request_id] = min(self._held[request_id], keep)

    def release(self, request_id: str) -> None:
        """The request freed its blocks: its row is free for another request."""
        row = self._row.pop(request_id, None)
        if row is not None:
            del self._held[request_id]
            self._free.append(row)

    def take_appends(self) -> TableAppends:
        """The appends recorded since the last call (one step's)."""
        appends = TableAppends(tuple(self._rows), tuple(self._columns), tuple(self._blocks))
        self._rows, self._columns, self._blocks = [], [], []
        return appends


class DeviceTables:
    """One rank's block tables on the device: ``table`` [rows, max_blocks] (grown when a row past it is
    appended), row 0 the padding row. Every host value a step sends it goes through :meth:`stage`."""

    def __init__(self, max_blocks: int, sink_block: int, device: torch.device, rows: int = 1) -> None:
        self.max_blocks = max_blocks
        self.sink_block = sink_block
        self.device = device
        self.table = torch.full((max(rows, PAD_ROW + 1), max_blocks), sink_block, dtype=torch.long, device=device)
        self.staged_bytes = 0  # bytes of host tensors staged to the device so far

    def stage(self, columns: Sequence[Sequence[int]], out: torch.Tensor | None = None) -> torch.Tensor:
        """Equal-length host columns as one int64 tensor [len(columns), n] on the device (into ``out`` when
        given): a step's one copy of its host values (counted in ``staged_bytes``). On the CPU into ``out``
        through numpy: no torch op (each costs tens of microseconds after a replay has streamed the weights
        through the caches)."""
        if out is not None and self.device.type == "cpu":
            values = out.numpy()
            values[:] = columns
            self.staged_bytes += values.nbytes
            return out
        host = torch.tensor(columns, dtype=torch.long)
        self.staged_bytes += host.numel() * host.element_size()
        staged = host.to(self.device, non_blocking=True)
        return staged if out is None else out.copy_(staged)

    def apply(self, appends: TableAppends) -> None:
        """Scatter a step's appends into the table (columns past ``max_blocks``, never read, are dropped)."""
        if not appends:
            return
        rows, columns, blocks = appends.rows, appends.columns, appends.blocks
        if max(columns) >= self.max_blocks:
            kept = [i for i, c in enumerate(columns) if c < self.max_blocks]
            rows, columns, blocks = ([v[i] for i in kept] for v in (rows, columns, blocks))
            if not kept:
                return
        need = max(rows) + 1
        if need > self.table.shape[0]:  # every rank grows alike: the same appends
            grown = self.table.new_full((max(need, 2 * self.table.shape[0]), self.max_blocks), self.sink_block)
            grown[: self.table.shape[0]] = self.table
            self.table = grown
        staged = self.stage((rows, columns, blocks))
        self.table.index_put_((staged[0], staged[1]), staged[2])

    def gather(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The tables of ``rows`` (a device index, one per batch row) into ``out`` [len(rows), max_blocks] (on the
        CPU through numpy, as :meth:`stage`)."""
        if self.device.type == "cpu":
            np.take(self.table.numpy(), rows.numpy(), axis=0, out=out.numpy())
            return out
        return torch.index_select(self.table, 0, rows, out=out)

    def select(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """An eager step's tables: the first ``width`` columns of ``rows``, [len(rows), width]."""
        index = self.stage((rows,))[0]
        return self.table[:, :width].index_select(0, index)
