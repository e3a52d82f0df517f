"""The router's view of its engine instances: health, load, and where each request goes.

Every ``refresh_interval_s`` (and on demand, before ``/metrics`` is rendered) the router asks each
instance for ``GetLoad``; an instance that does not answer, or is draining, is unhealthy: it gets no
new requests and the policy forgets what it knew of its cache. A request's load signal is the larger
of the router's own in-flight count for the instance (exact and immediate) and the instance's
running + waiting count (which also sees requests from other routers). A request that an instance
refuses as unavailable before streaming anything is retried on another healthy instance; when none is
healthy (an engine group being restarted by its supervisor) it waits up to ``engine_wait_s`` for one.
An instance restarted on another port (its old one was taken meanwhile) is moved there
(:meth:`Router.move`, which ``epserve serve``'s supervisor asks for).

Prefill/decode disaggregation (``--prefill`` and ``--decode`` instances): the policy picks a prefill
instance (cache-aware: prefix hits save prefill compute) and the least-loaded decode instance gets the
request, naming its prefill instance; the two engines move the KV between them and the decode instance
streams the tokens (the prefill's first token first). A request whose prefill instance fails before
its first token is retried on another prefill instance.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from epserve.config import EngineRole
from epserve.messages.engine import GeneratedTokens
from epserve.messages.expert_load import ExpertLoad
from epserve.messages.sampling import SamplingParams
from epserve.router.engine_client import EngineClient, EngineUnavailable, PrefillUnavailable
from epserve.router.policy import NoInstanceError, Policy
from epserve.rpc.convert import expert_load_from_proto, layout_from_proto
from epserve.rpc.proto import engine_pb2 as pb

logger = logging.getLogger(__name__)

_SERVES = {"both": ("both",), "prefill": ("prefill", "both"), "decode": ("decode", "both")}  # listed as -> may be


def _cancelled_here() -> bool:
    """Whether the current task itself is being cancelled (not merely a call on a closed channel);
    always True before Python 3.11, which cannot tell."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return cancelling is None or cancelling() > 0


def _moved(address: str) -> str:
    return f"moved to {address}; not contacted there yet"


@dataclass(frozen=True)
class EngineMoved:
    """Supervisor -> router process: instance ``index`` (in the router's order: engines, then prefill,
    then decode instances) now listens at ``address``."""

    index: int
    address: str


@dataclass
class Instance:
    client: EngineClient
    role: EngineRole = "both"  # what the router uses it for (``--engine``, ``--prefill``, ``--decode``)
    healthy: bool = False
    in_flight: int = 0
    requests_total: int = 0
    load: pb.GetLoadResponse | None = None
    info: pb.GetInfoResponse | None = None
    last_error: str = field(default="not contacted yet")

    @property
    def index(self) -> int:
        return self.client.index

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def load_signal(self) -> int:
        engine = self.load.num_running + self.load.num_waiting if self.load is not None else 0
        return max(self.in_flight, engine)


class Router:
    def __init__(self, addresses: Sequence[str], policy: Policy, refresh_interval_s: float = 1.0,
                 token: str | None = None, engine_wait_s: float = 20.0, prefill: Sequence[str] = (),
                 decode: Sequence[str] = ()) -> None:
        if (prefill or decode) and not (prefill and decode):
            raise ValueError("a disaggregated router needs both --prefill and --decode instances")
        if addresses and prefill:
            raise ValueError("--engine instances cannot be mixed with --prefill/--decode instances")
        if not (addresses or prefill):
            raise ValueError("the router needs at least one engine address (--engine HOST:PORT)")
        roles: list[tuple[str, EngineRole]] = [(a, "both") for a in addresses]
        roles += [(a, "prefill") for a in prefill] + [(a, "decode") for a in decode]
        for a, _ in roles:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"engine address {a!r} is not HOST:PORT")
        self.roles = roles
        self.disaggregated = bool(prefill)
        self.addresses = [a for a, _ in roles]
        self.policy = policy
        self.refresh_interval_s = refresh_interval_s
        self.token = token  # sent to the engines as call metadata
        self.engine_wait_s = engine_wait_s
        self.instances: list[Instance] = []
        self.decisions: collections.Counter[str] = collections.Counter()  # why requests went where they went
        self._task: asyncio.Task | None = None
        self._closing: set[asyncio.Future] = set()  # old clients of moved instances, closing
        self._control: Connection | None = None
        self._control_closed: Callable[[], None] = lambda: None

    def follow(self, control: Connection, on_closed: Callable[[], None]) -> None:
        """Once started, read the supervisor's messages (:class:`EngineMoved`) from ``control`` on the
        event loop; ``on_closed()`` when it ends (the supervisor is gone)."""
        self._control, self._control_closed = control, on_closed

    def _read_control(self) -> None:
        try:
            message = self._control.recv()  # type: ignore[union-attr]
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self._control.fileno())  # type: ignore[union-attr]
            self._control_closed()
            return
        if isinstance(message, EngineMoved):
            self.move(message.index, message.address)
        else:
            logger.warning("ignoring an unknown message from the supervisor: %r", message)

    async def start(self) -> None:
        self.instances = [Instance(EngineClient(i, a, self.token), role) for i, (a, role) in enumerate(self.roles)]
        if self._control is not None:
            asyncio.get_running_loop().add_reader(self._control.fileno(), self._read_control)
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    def move(self, index: int, address: str) -> None:
        """Instance ``index`` now listens at ``address`` (its engine group was restarted and its old port
        was taken): talk to it there. Calls in flight to the old address fail and are retried; until
        the next refresh finds it healthy it gets no new request."""
        role = self.roles[index][1]
        self.roles[index] = (address, role)
        self.addresses[index] = address
        if index >= len(self.instances):  # not started yet: start() uses the new address
            return
        inst = self.instances[index]
        old = inst.client
        logger.warning("engine %d moved from %s to %s", index, old.address, address)
        self._mark_down(inst, _moved(address))
        inst.client = EngineClient(index, address, self.token)
        inst.info = inst.load = None
        task = asyncio.ensure_future(old.close())
        self._closing.add(task)  # (held until done: the loop keeps only weak references to tasks)
        task.add_done_callback(self._closing.discard)

    async def _stream(self, inst: Instance, *call: object) -> AsyncIterator[GeneratedTokens]:
        """``inst.client.generate(*call)``'s messages. A call that a move of the instance cut short (the
        old address's channel was closed under it) raises EngineUnavailable, so it is retried."""
        client = inst.client
        try:
            async with contextlib.aclosing(client.generate(*call)) as stream:  # type: ignore[arg-type]
                async for msg in stream:
                    yield msg
        except asyncio.CancelledError:
            if client is inst.client or _cancelled_here():
                raise
            raise EngineUnavailable(_moved(inst.address)) from None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for inst in self.instances:
            await inst.client.close()

    # ---- health and load ---------------------------------------------------------------------
    async def refresh(self) -> None:
        errors = await asyncio.gather(*(self._poll(inst) for inst in self.instances))
        for inst, error in zip(self.instances, errors):
            refusal = None if error else self._unusable(inst)
            why = error or refusal
            if why and why != inst.last_error and not inst.healthy:  # say it once, even at start
                logger.warning("engine %d at %s is not used: %s", inst.index, inst.address, why)
            if error or refusal:
                self._mark_down(inst, error or refusal)
                continue
            if not inst.healthy:
                logger.info("engine %d at %s is healthy", inst.index, inst.address)
            inst.healthy, inst.last_error = True, ""

    async def _poll(self, inst: Instance) -> str | None:
        """Ask for the instance's info (once) and load; why it cannot be asked (None: it answered)."""
        client = inst.client
        try:
            if inst.info is None:
                info = await client.get_info(timeout=2.0)
                if client is inst.client:
                    inst.info = info
            load = await client.get_load(timeout=2.0)
        except asyncio.CancelledError:
            if client is inst.client or _cancelled_here():
                raise
            return _moved(inst.address)  # the move closed the old address's channel
        except Exception as e:  # unreachable, or an answer we cannot use: either way not routable
            return str(e)
        if client is not inst.client:  # it moved meanwhile: this answer came from the old address
            return _moved(inst.address)
        inst.load = load
        return None

    def _unusable(self, inst: Instance) -> str | None:
        """Why an instance that answered cannot take requests in the role it is listed in (None: it can)."""
        assert inst.load is not None and inst.info is not None
        if inst.load.draining or inst.load.stalled:
            return "draining" if inst.load.draining else "stalled (a rank hung or died)"
        role = inst.info.role or "both"
        if role not in _SERVES[inst.role]:
            return f"the engine's role is {role}; the router uses it as {inst.role}"
        if inst.role in ("prefill", "decode"):  # its KV must fit some instance of the other pool
            other = "decode" if inst.role == "prefill" else "prefill"
            peers = [peer for peer in self.instances if peer.role == other and peer.info is not None]
            if peers and not any(self._kv_fits(inst, peer) for peer in peers):
                mismatch = layout_from_proto(peers[0].info.kv_layout).mismatch(layout_from_proto(inst.info.kv_layout))
                return f"no {other} instance can take its KV ({mismatch})"
        return None

    @staticmethod
    def _kv_fits(a: Instance, b: Instance) -> bool:
        """Whether KV blocks of one instance can be copied into the other's cache (same layout)."""
        return a.info is not None and b.info is not None and a.info.kv_layout == b.info.kv_layout

    def _mark_down(self, inst: Instance, why: str) -> None:
        if inst.healthy:
            logger.warning("engine %d at %s is unavailable: %s", inst.index, inst.address, why)
            self.policy.forget(inst.index)
        inst.healthy, inst.last_error = False, why

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                await self.refresh()
            except Exception:  # keep refreshing whatever happened
                logger.exception("refreshing engine loads failed")

    @property
    def healthy(self) -> list[Instance]:
        return [inst for inst in self.instances if inst.healthy]

    @property
    def serving(self) -> bool:
        """Whether a request can be served now (disaggregated: a prefill and a decode instance are up)."""
        roles = {inst.role for inst in self.healthy}
        return {"prefill", "decode"} <= roles if self.disaggregated else bool(roles)

    @property
    def info(self) -> pb.GetInfoResponse | None:
        """Model facts from any instance that answered (they all serve the same model)."""
        return next((inst.info for inst in self.instances if inst.info is not None), None)

    async def expert_loads(self) -> list[ExpertLoad]:
        """The expert load of each EP group behind the router: every DP group's leader reports its whole
        world's, so only the first DP group of each world is asked (instances that do not answer are
        left out)."""
        leaders = [inst for inst in self.healthy if inst.info is not None and inst.info.dp_rank == 0]
        replies = await asyncio.gather(*(inst.client.get_expert_load() for inst in leaders), return_exceptions=True)
        return [expert_load_from_proto(r) for r in replies
                if isinstance(r, pb.GetExpertLoadResponse) and r.layers]

    # ---- requests ----------------------------------------------------------------------------
    def choose(self, token_ids: list[int], exclude: Collection[int] = (), role: EngineRole = "both",
               kv_from: Instance | None = None) -> Instance:
        """An instance of the ``role`` pool: by the policy, or the least loaded decode instance (one that
        can take the KV of ``kv_from``, the request's prefill instance)."""
        loads = {inst.index: inst.load_signal for inst in self.healthy
                 if inst.index not in exclude and inst.role == role
                 and (kv_from is None or self._kv_fits(inst, kv_from))}
        try:
            if role == "decode":
                if not loads:
                    raise NoInstanceError
                return self.instances[min(loads, key=lambda i: (loads[i], i))]
            index = self.policy.choose(token_ids, loads)
        except NoInstanceError:
            down = "; ".join(f"{inst.address}: {inst.last_error}" for inst in self.instances
                             if not inst.healthy and inst.role == role)
            what = "engine" if role == "both" else role
            raise EngineUnavailable(f"no {what} instance is available ({down})") from None
        self.decisions[getattr(self.policy, "last_decision", "") or self.policy.name] += 1
        return self.instances[index]

    async def _choose_or_wait(self, token_ids: list[int], tried: set[int], deadline: float,
                              role: EngineRole = "both", kv_from: Instance | None = None) -> Instance:
        """An instance for a request that has not started: one not tried yet, else (none healthy) the
        first to become healthy before ``deadline`` (loop time), tried or not (it may have restarted)."""
        while True:
            try:
                return self.choose(token_ids, tried, role, kv_from)
            except EngineUnavailable:
                if asyncio.get_running_loop().time() >= deadline:
                    raise
            tried.clear()
            await asyncio.sleep(min(0.25, self.refresh_interval_s))

    async def generate(
        self, request_id: str, token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[GeneratedTokens]:
        """Route and stream one request. Closing the iterator cancels it on the engine. Raises
        EngineUnavailable (no instance could take it, or the serving one died mid-stream) or
        EngineRequestError (the instance refused the request). Disaggregated: a prefill instance by the
        policy, the least-loaded decode instance (which streams); a prefill that fails before the first
        token is retried on another prefill instance. Each attempt has an id of its own on the engines
        (``request_id``, then ``request_id.1``, …): an instance may still be stopping a failed attempt
        when the next one reaches it, and must not take one for the other."""
        tried: set[int] = set()  # instances that failed the request before its first token
        tried_prefill: set[int] = set()
        deadline = asyncio.get_running_loop().time() + self.engine_wait_s
        for attempt in itertools.count():
            engine_id = request_id if attempt == 0 else f"{request_id}.{attempt}"
            prefill = None
            if self.disaggregated:
                prefill = await self._choose_or_wait(token_ids, tried_prefill, deadline, "prefill")
            inst = await self._choose_or_wait(token_ids, tried, deadline, "decode" if prefill else "both", prefill)
            for held in filter(None, (prefill, inst)):
                held.in_flight += 1
                held.requests_total += 1
            started = False
            try:
                stream = self._stream(inst, engine_id, token_ids, params, prefill.address if prefill else "")
                async with contextlib.aclosing(stream) as stream:
                    async for msg in stream:
                        if prefill is not None and not started:
                            prefill.in_flight -= 1  # its part is done
                        started = True
                        yield msg
                return
            except EngineUnavailable as e:
                if prefill is not None and isinstance(e, PrefillUnavailable):  # the decode instance let it go
                    logger.warning("request %s: prefill on engine %d failed (%s); retrying", request_id,
                                   prefill.index, e)
                    self._mark_down(prefill, str(e))
                    tried_prefill.add(prefill.index)
                    continue
                self._mark_down(inst, str(e))
                if started:
                    raise
                tried.add(inst.index)
            finally:
                if prefill is not None and not started:
                    prefill.in_flight -= 1
                inst.in_flight -= 1
