"""The tensors one forward step needs, built by the runner (the only place sequences become tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.model.layers import RopeTable


@dataclass(frozen=True)
class ForwardBatch:
    """A flattened batch of ``T`` tokens from ``B`` sequences; decode sequences (one new token each)
    come first, then prefill chunks.

    - ``input_ids``/``positions``/``slot_mapping``: ``[T]``; a token's KV goes to flat cache slot
      ``slot_mapping[t]`` = ``block_id * block_size + position % block_size``.
    - ``seq_lens``: ``[B]`` context length after this step (cached + new tokens).
    - ``block_tables``: ``[B, max_blocks]`` block ids per sequence (padded with 0).
    - ``logits_indices``: ``[S]`` flat token indices whose logits are wanted (chunks that sample).
    - ``seq_lens_cpu``: the same as a tuple; ``query_start_loc_cpu``: ``B + 1`` offsets of each
      sequence's tokens in the flat batch (host-side, for per-sequence loops).
    - ``real_rows``: ``[T]`` bool, False at a captured bucket's padding rows (``engine/graphs.py``), which the
      expert-load counters leave out; None: every row is a request's.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    num_decode_seqs: int
    seq_lens_cpu: tuple[int, ...]
    query_start_loc_cpu: tuple[int, ...]
    block_size: int
    real_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_prefill_seqs(self) -> int:
        return self.num_seqs - self.num_decode_seqs

    def split_point(self) -> int:
        """The sequence index that splits the batch into two micro-batches of about equal tokens."""
        half = self.num_tokens / 2
        starts = self.query_start_loc_cpu
        return min(range(len(starts)), key=lambda i: (abs(starts[i] - half), i))

    def select(self, first: int, last: int) -> ForwardBatch:
        """Sequences ``[first, last)`` as a batch of their own (a micro-batch)."""
        starts = self.query_start_loc_cpu
        lo, hi = starts[first], starts[last]
        logits = self.logits_indices
        logits = logits[(logits >= lo) & (logits < hi)] - lo
        return ForwardBatch(
            input_ids=self.input_ids[lo:hi],
            positions=self.positions[lo:hi],
            slot_mapping=self.slot_mapping[lo:hi],
            seq_lens=self.seq_lens[first:last],
            block_tables=self.block_tables[first:last],
            logits_indices=logits,
            num_decode_seqs=max(0, min(self.num_decode_seqs, last) - first),
            seq_lens_cpu=self.seq_lens_cpu[first:last],
            query_start_loc_cpu=tuple(s - lo for s in starts[first : last + 1]),
            block_size=self.block_size,
            real_rows=None if self.real_rows is None else self.real_rows[lo:hi],
        )


@dataclass(frozen=True)
class MicroBatch:
    """What every decoder layer reads for one (micro-)batch besides the residual stream: the batch, its
    rotary rows (looked up once per forward) and the latent KV cache of every layer."""

    batch: ForwardBatch
    rope: RopeTable
    kv_caches: list[torch.Tensor]

    def split(self) -> tuple[MicroBatch, MicroBatch]:
        """Two micro-batches of whole sequences with about half the tokens each (the first one's
        tokens come first in the flat batch)."""
        cut_seq = self.batch.split_point()
        cut = self.batch.query_start_loc_cpu[cut_seq]
        return (
            MicroBatch(self.batch.select(0, cut_seq), self.rope.rows(0, cut), self.kv_caches),
            MicroBatch(self.batch.select(cut_seq, self.batch.num_seqs), self.rope.rows(cut, self.batch.num_tokens),
                       self.kv_caches),
        )
