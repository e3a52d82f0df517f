"""A serving rank's options, as the command line gives them (torch-free: the CLI builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from epserve.config import EngineRole, LoopOptions


@dataclass(frozen=True)
class ServeOptions:
    """A serving rank's options: its gRPC service's and its step loop's (:meth:`loop_options`)."""

    host: str = "127.0.0.1"  # where leaders listen for gRPC
    port: int = 0  # the leader of DP group i listens on port + i; 0 = any free port
    ports: tuple[int, ...] = ()  # if set, DP group i's leader listens on ports[i] (a restart's old ports)
    drain_timeout_s: float = LoopOptions.drain_timeout_s  # after a stop, running requests get this long
    stats_every: int = LoopOptions.stats_every  # forward steps between expert-load gathers; 0: none
    token: str | None = field(default=None, repr=False)  # required as gRPC call metadata (None: no check)
    step_timeout_s: float = LoopOptions.step_timeout_s  # a leader whose loop makes no progress this long stops serving
    dist_timeout_s: float | None = None  # collectives give up after this while serving (None: step_timeout_s)
    restarts: int = LoopOptions.restarts  # times the supervisor restarted this group (reported in GetLoad)
    role: EngineRole = LoopOptions.role  # prefill/decode disaggregation (see service.py)
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
        return LoopOptions(drain_timeout_s=self.drain_timeout_s, stats_every=self.stats_every,
                           step_timeout_s=self.step_timeout_s, restarts=self.restarts, role=self.role)
