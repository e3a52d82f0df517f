"""The ``symm_mem`` dispatcher's host-free bookkeeping on the CPU (its exchange needs CUDA with NVSHMEM:
``benchmarks/gpu_check.sh``), and its refusals.

``compact_index`` turns the dispatch op's expert-major splits and offsets (slot groups with gaps between
them: an empty slot still gets one padding row) into the gather that gives the expert GEMM its layout:
rows of slot 0, slot 1, ..., then the zero row."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM
from epserve.config import ConfigError
from epserve.moe.dispatch.symm_mem import check_symm_mem, compact_index


def received_layout(counts: list[list[int]], pad_empty: bool = True) -> tuple[torch.Tensor, list[int]]:
    """What all_to_all_vdev_2d leaves: ``counts[e][s]`` rows of slot e from source s, the sources of one
    slot back to back, each slot group starting where the previous ended (+1 padding row if it was
    empty). Returns (splits_offsets [2, slots*ep] expert-major, the received row ids in slot order)."""
    splits, offsets, rows, at = [], [], [], 0
    for per_source in counts:
        for n in per_source:
            splits.append(n)
            offsets.append(at)
            rows.extend(range(at, at + n))
            at += n
        if pad_empty and sum(per_source) == 0:
            at += 1
    return torch.tensor([splits, offsets]), rows


@pytest.mark.parametrize("counts", [
    [[2, 1], [0, 3], [1, 0]],   # 3 slots, 2 sources
    [[0, 0], [2, 2], [0, 0]],   # empty slots around a full one: gaps of one padding row
    [[0, 0, 0], [0, 0, 0]],     # nothing received
    [[1, 0, 4, 2]],             # one slot, 4 sources
])
def test_compact_index_gathers_slot_by_slot_then_the_zero_row(counts):
    slots, ep = len(counts), len(counts[0])
    splits_offsets, rows = received_layout(counts)
    num_rows, zero_row = len(rows) + 3, 99
    index, per_slot = compact_index(splits_offsets, slots, ep, num_rows, zero_row)
    assert per_slot.tolist() == [sum(c) for c in counts]
    assert index.tolist() == rows + [zero_row] * (num_rows - len(rows))


def test_symm_mem_is_refused_off_cuda_naming_the_alternatives(make_ckpt):
    with pytest.raises(ConfigError, match="symm_mem.*CUDA.*padded"):
        check_symm_mem(torch.device("cpu"), 4, 2)
    with pytest.raises(ConfigError, match="symm_mem.*CUDA"):
        LLM(make_ckpt("tiny"), dtype="float32", dp=2, dispatch="symm_mem")
