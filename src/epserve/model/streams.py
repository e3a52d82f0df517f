"""A second CUDA stream for work that is independent of the main stream's next kernels (the shared expert
beside the dispatch and the routed experts, as TensorRT-LLM runs it).

:meth:`SideStream.start` forks: the side stream waits for an event recorded on the current stream, then
runs the function there; :meth:`SideStream.join` makes the current stream wait for the side stream's event
before the result is used. Inside ``torch.cuda.graph`` capture the two events become edges of the graph,
so the captured decode keeps the two branches concurrent on replay. Off CUDA, in a trace, or while an
op hook times each op (the profiler), the function simply runs in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from epserve.kernels.device import side_stream_usable


@dataclass(frozen=True)
class Forked:
    """A side-stream result and the event that says it is ready (None: computed in place)."""

    value: torch.Tensor | None
    done: torch.cuda.Event | None = None


class SideStream:
    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def usable(self, x: torch.Tensor) -> bool:
        return side_stream_usable(x)

    def start(self, fn: Callable[[torch.Tensor], torch.Tensor | None], x: torch.Tensor) -> Forked:
        """``fn(x)`` on the side stream once the current stream's work so far is done (in place off CUDA)."""
        if not self.usable(x):
            return Forked(fn(x))
        main = torch.cuda.current_stream(x.device)
        side = self._streams.get(x.device)
        if side is None:
            side = self._streams[x.device] = torch.cuda.Stream(x.device)
        side.wait_stream(main)
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing:
            x.record_stream(side)  # the allocator must not hand x's memory out before the side stream is done
        with torch.cuda.stream(side):
            value = fn(x)
            done = torch.cuda.Event()
            done.record(side)
        if value is not None and not capturing:
            value.record_stream(main)
        return Forked(value, done)

    @staticmethod
    def join(forked: Forked) -> torch.Tensor | None:
        """The result, with the current stream ordered after the side stream's work."""
        if forked.done is not None:
            torch.cuda.current_stream().wait_event(forked.done)
        return forked.value
