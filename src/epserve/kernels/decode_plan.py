"""Planning a captured decode step before it replays: the hook between the captured decode (``engine/graphs.py``)
and the kernels that plan on the host (FlashInfer's MLA decode in its CUDA-graph mode, which must be told the
step's lengths outside the graph, as vLLM and SGLang plan it before each replay).

The captured decode calls :func:`plan_replay` with the bucket's static inputs, the device tensors the graph reads
(already holding this step's values), and the step's lengths on the host, once before capturing a bucket and
once before every replay, outside the graph. Kernels that plan register a planner once (:func:`register`); a
kernel that reads its lengths on the device needs none. Nothing here reads the device. FlashInfer's planner
(``kernels.mla_flashinfer_graph.plan_captured``) is registered when that module is imported: on CUDA, when
``kernels.backends`` first decides ``mla_decode`` (at start-up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeReplay:
    """One captured decode step about to replay: ``block_tables`` [bucket, max_blocks] and ``seq_lens``
    [bucket] are the static device tensors the graph reads (this step's values); ``host_seq_lens`` the same
    lengths on the host (padding rows 0); ``block_size`` the cache's tokens per block."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    host_seq_lens: tuple[int, ...]
    block_size: int

    @property
    def bucket(self) -> int:
        return len(self.host_seq_lens)


Planner = Callable[[DecodeReplay], None]
_planners: list[Planner] = []


def register(planner: Planner) -> None:
    """Add a planner (once: registering the same one again does nothing)."""
    if planner not in _planners:
        _planners.append(planner)


def unregister(planner: Planner) -> None:
    if planner in _planners:
        _planners.remove(planner)


def plan_replay(replay: DecodeReplay) -> None:
    """Every registered planner, in registration order, on this step (outside the graph)."""
    for planner in tuple(_planners):
        planner(replay)
