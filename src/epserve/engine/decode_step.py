"""What a captured decode step carries (``engine/graphs.py`` replays it): the step's rows on the host, padded to
their bucket (:class:`DecodeStep`), and the bucket's static device inputs its graphs read (:class:`DecodeInputs`),
into which a step's rows are staged before every run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.engine.block_tables import PAD_ROW


@dataclass(frozen=True)
class DecodeInputs:
    """A bucket's static device inputs, what its graph reads: one token per row. [bucket] each, tables
    [bucket, max_blocks]."""

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


@dataclass(frozen=True)
class DecodeStep:
    """A decode step as it reaches the captured decode: its rows on the host, padded to the bucket (token 0 at
    position 0, context length 0, writing ``sink_slot``, reading the padding table row), each naming its row of
    the device block tables; with ``hidden`` the MTP pass's input ([real rows, H] on the device)."""

    input_ids: tuple[int, ...]
    positions: tuple[int, ...]
    slot_mapping: tuple[int, ...]
    seq_lens: tuple[int, ...]
    table_rows: tuple[int, ...]
    hidden: torch.Tensor | None = None

    @property
    def bucket(self) -> int:
        return len(self.input_ids)

    @classmethod
    def pad(cls, input_ids: tuple[int, ...], positions: tuple[int, ...], slot_mapping: tuple[int, ...],
            seq_lens: tuple[int, ...], table_rows: tuple[int, ...], bucket: int, sink_slot: int,
            hidden: torch.Tensor | None = None) -> DecodeStep:
        """The ``n`` decode rows padded to ``bucket`` rows."""
        n = len(input_ids)
        if n > bucket:
            raise ValueError(f"{n} decode rows do not fit bucket {bucket}")
        if len(table_rows) != n:
            raise ValueError(f"{n} decode rows name {len(table_rows)} device-table rows")
        if n == bucket:  # (every CPU step: a bucket per batch size)
            return cls(input_ids, positions, slot_mapping, seq_lens, table_rows, hidden)
        pad = (0,) * (bucket - n)
        return cls((*input_ids, *pad), (*positions, *pad), (*slot_mapping, *(sink_slot,) * len(pad)),
                   (*seq_lens, *pad), (*table_rows, *(PAD_ROW,) * len(pad)), hidden)

