"""A serving rank's options, as the command line gives them (torch-free: the CLI builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from epserve.engine.loop import LoopOptions

Role = Literal["both", "prefill", "decode"]


@dataclass(frozen=True)
class ServeOptions:
    """A serving rank's options: its gRPC service's and its step loop's (:attr:`loop`)."""

    host: str = "127.0.0.1"  # where leaders listen for gRPC
    port: int = 0  # the leader of DP group i listens on port + i; 0 = any free port
    ports: tuple[int, ...] = ()  # if set, DP group i's leader listens on ports[i] (a restart's old ports)
    drain_timeout_s: float = 30.0  # after a stop, running requests get this long before they are aborted
    stats_every: int = 64  # forward steps between expert-load gathers (also when going idle); 0: none
    token: str | None = field(default=None, repr=False)  # required as gRPC call metadata (None: no check)
    step_timeout_s: float = 60.0  # a leader whose loop makes no progress this long stops serving (watchdog)
    dist_timeout_s: float | None = None  # collectives give up after this while serving (None: step_timeout_s)
    restarts: int = 0  # times the supervisor restarted this group (reported in GetLoad)
    role: Role = "both"  # prefill/decode disaggregation (see service.py)
    kv_transfer_timeout_s: float = 30.0  # a decode instance gives up a request's KV transfer after this

    def port_of(self, dp_rank: int) -> int:
        if self.ports:
            return self.ports[dp_rank]
        return self.port + dp_rank if self.port else 0

    @property
    def collective_timeout_s(self) -> float:
        return self.step_timeout_s if self.dist_timeout_s is None else self.dist_timeout_s

    def loop_options(self) -> LoopOptions:
        """The step loop's share."""
        from epserve.engine.loop import LoopOptions  # the loop imports torch; these options do not

        return LoopOptions(drain_timeout_s=self.drain_timeout_s, stats_every=self.stats_every,
                           step_timeout_s=self.step_timeout_s, restarts=self.restarts, role=self.role)
