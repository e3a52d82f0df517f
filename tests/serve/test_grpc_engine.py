"""The gRPC engine service of one instance (one rank, in this process): streaming, status codes,
abort and cancellation freeing KV blocks, load figures, health, and draining on stop."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epserve import LLM, SamplingParams
from epserve.engine.options import build_engine_config
from epserve.engine.worker import EngineWorker
from epserve.engine_server.options import ServeOptions
from epserve.engine_server.server import EngineServer
from epserve.messages.engine import ITERATION_TOKENS_BUCKETS, AbortRequest
from epserve.router.engine_client import EngineClient, EngineRequestError, EngineUnavailable
from epserve.rpc.convert import SERVICE_NAME
from epserve.rpc.proto import engine_pb2 as pb

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")


def start(ckpt: Path, **options) -> tuple[EngineServer, threading.Thread]:
    worker = EngineWorker(build_engine_config(ckpt, dtype="float32", num_blocks=64))
    server = EngineServer(worker, ServeOptions(**options))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while server.address is None:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    return server, thread


@pytest.fixture(scope="module")
def engine(ckpt):
    server, thread = start(ckpt)
    yield server
    server.request_stop()
    thread.join(30)
    assert not thread.is_alive()


class StepGate:
    """Holds an in-process instance's step loop between two steps, so that a request is unfinished by
    construction when an abort, a cancel or a stop lands (not by racing a fast machine through its
    tokens): after the step that gives ``request_id`` its first token the loop waits, before its next
    step, until :meth:`let_one_step` lets one through or the ``with`` block ends (it runs on freely).
    It wraps ``engine.step`` for the block; a step let through votes as the loop would at that
    moment (``stop_requested``). Held for well under the step timeout (60 s), no watchdog fires."""

    def __init__(self, server: EngineServer, request_id: str) -> None:
        self.loop, self.engine = server.loop, server.loop.engine
        self.request_id: str | None = request_id
        self._step = self.engine.step
        self._cond = threading.Condition()
        self._budget: int | None = None  # steps that may start before the loop waits (None: any number)
        self._waiting = False

    def __enter__(self) -> StepGate:
        self.engine.step = self._gated
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._budget = None
            self._cond.notify_all()
        del self.engine.step  # the method again

    def _gated(self, stopping: bool = False):
        with self._cond:
            while self._budget == 0:
                self._waiting = True
                self._cond.notify_all()
                self._cond.wait()
            self._waiting = False
            if self._budget is not None:
                self._budget -= 1
        updates = self._step(stopping or self.loop.stop_requested)
        with self._cond:
            if any(u.request_id == self.request_id and u.new_token_ids for u in updates):
                self.request_id, self._budget = None, 0
        return updates

    def let_one_step(self, timeout: float = 30.0) -> None:
        """Let one step run; return once the loop waits before the next one."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._waiting, timeout), "the loop is not held"
            self._budget, self._waiting = 1, False
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self._waiting, timeout), "the loop did not come back"

    def wait_held(self, timeout: float = 30.0) -> None:
        """Until the loop waits at the gate: it has taken its inbox for the held step, so whatever
        arrives from now on stays queued until the gate opens."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._waiting, timeout), "the loop is not held"

    async def wait_queued_abort(self, request_id: str, timeout: float = 30.0) -> None:
        """Until an abort of ``request_id`` (a cancelled call's) waits in the held loop's inbox (call
        :meth:`wait_held` before the cancel: a loop between two steps would take the abort at once).
        It sleeps in the event loop, which may still be sending the cancel."""
        deadline = time.monotonic() + timeout
        while not any(isinstance(m, AbortRequest) and m.request_id == request_id for m in list(self.loop.inbox)):
            assert time.monotonic() < deadline, f"no abort of {request_id} was queued"
            await asyncio.sleep(0.005)


def run(coro):
    return asyncio.run(coro)


async def collect(client: EngineClient, rid: str, prompt: list[int], params: SamplingParams) -> list:
    return [msg async for msg in client.generate(rid, prompt, params)]


def test_generated_code_matches_the_proto(tmp_path):
    import importlib.util
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        from gen_proto import generate
    finally:
        sys.path.pop(0)
    generate(tmp_path)
    fresh = (tmp_path / "epserve/rpc/proto/engine_pb2.py").read_text()
    spec_bytes = fresh.split("AddSerializedFile(", 1)[1].split(")\n", 1)[0]
    committed = Path(pb.__file__).read_text().split("AddSerializedFile(", 1)[1].split(")\n", 1)[0]
    assert spec_bytes == committed, "engine.proto changed: run `python scripts/gen_proto.py`"
    assert importlib.util.find_spec("epserve.rpc.proto.engine_pb2_grpc") is not None


def test_stream_matches_offline_engine(engine, ckpt):
    prompt = [5, 17, 99, 230, 7]
    want = LLM(ckpt, dtype="float32", num_blocks=64).generate([prompt], GREEDY)[0].token_ids

    async def go():
        client = EngineClient(0, engine.address)
        msgs = await collect(client, "same", prompt, SamplingParams(**{**GREEDY.__dict__, "logprobs": 2}))
        await client.close()
        return msgs

    msgs = run(go())
    assert [t for m in msgs for t in m.token_ids] == want
    # one message per step, counted; a reader that fell behind gets the pile-up merged into one message
    # (engine_server/streams.py), so each message's tokens are the steps since the one before
    counts = [m.num_output_tokens for m in msgs]
    assert counts[-1] == 10 and all(len(m.token_ids) == c - p for m, c, p in zip(msgs, counts, [0, *counts]))
    assert [m.finish_reason for m in msgs] == [None] * (len(msgs) - 1) + ["length"]
    assert all(m.num_prompt_tokens == 5 for m in msgs)
    assert all(len(m.logprobs) == len(m.token_ids) and len(m.logprobs[0].top) == 2 for m in msgs)


@pytest.mark.parametrize("prompt,params,code", [
    ([1, 2, 100000], GREEDY, "outside the vocabulary"),
    ([], GREEDY, "empty"),
    ([1] * 5000, GREEDY, "context"),
    ([1, 2], SamplingParams(max_tokens=2000, temperature=0.0), "KV blocks"),
])
def test_bad_requests_are_invalid_argument(engine, prompt, params, code):
    async def go():
        client = EngineClient(0, engine.address)
        try:
            with pytest.raises(EngineRequestError, match=code):
                await collect(client, "bad", prompt, params)
        finally:
            await client.close()

    run(go())


def test_status_codes_for_bad_rpcs(engine):
    async def go():
        async with grpc.aio.insecure_channel(engine.address) as channel:
            from epserve.rpc.proto import engine_pb2_grpc as pb_grpc

            stub = pb_grpc.EngineStub(channel)
            bad_params = pb.SamplingParams(max_tokens=1, min_tokens=5)  # SamplingParams refuses it
            codes = []
            for req in (pb.GenerateRequest(request_id="", prompt_token_ids=[1]),
                        pb.GenerateRequest(request_id="z", prompt_token_ids=[1], sampling_params=bad_params)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(req):
                        pass
                codes.append(info.value.code())
            # a second call with a running request's id
            with StepGate(engine, "dup"):  # "dup" keeps running, whatever the machine's speed
                first = stub.Generate(pb.GenerateRequest(request_id="dup", prompt_token_ids=[1, 2],
                                                         sampling_params=pb.SamplingParams(max_tokens=100,
                                                                                           ignore_eos=True)))
                await first.read()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(pb.GenerateRequest(request_id="dup", prompt_token_ids=[1],
                                                                    sampling_params=pb.SamplingParams(max_tokens=1))):
                        pass
                codes.append(info.value.code())
                first.cancel()
            return codes

    assert run(go()) == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT,
                         grpc.StatusCode.ALREADY_EXISTS]


def test_abort_and_cancel_free_the_blocks(engine):
    async def go():
        client = EngineClient(0, engine.address)
        # Abort RPC: the stream ends with finish_reason "abort" (the gate keeps the request running until
        # the abort is queued: 200 tokens may take less than the round trip on a fast machine)
        with StepGate(engine, "to-abort"):
            stream = client.generate("to-abort", list(range(50, 90)), LONG)
            first = await stream.__anext__()
            assert first.token_ids
            assert await client.abort("to-abort") is True
        rest = [m async for m in stream]
        assert rest[-1].finish_reason == "abort"
        assert await client.abort("to-abort") is False  # finished: unknown now
        # cancelling the call (the client went away) aborts it too
        with StepGate(engine, "to-cancel") as gate:
            stream = client.generate("to-cancel", list(range(100, 140)), LONG)
            await stream.__anext__()
            busy = await client.get_load()
            gate.wait_held()  # (a slow loop may still be taking its inbox after the first token went out)
            await stream.aclose()
            await gate.wait_queued_abort("to-cancel")
        for _ in range(100):
            load = await client.get_load()
            if load.num_running == 0 and load.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.05)
        await client.close()
        return busy, load

    busy, load = run(go())
    assert busy.num_running == 1 and busy.kv_blocks_used >= 3
    assert load.num_running == 0 and load.kv_blocks_used == 0 and load.kv_blocks_total == 64


def test_load_counts_prefix_hits_and_tokens(engine):
    async def go():
        client = EngineClient(0, engine.address)
        before = await client.get_load()
        prompt = list(range(300, 340))
        await collect(client, "p1", prompt, GREEDY)
        second = await collect(client, "p2", prompt, GREEDY)
        after = await client.get_load()
        info = await client.get_info()
        await client.close()
        return before, second, after, info

    before, second, after, info = run(go())
    assert second[-1].num_cached_tokens == 32  # two full blocks of 16
    assert after.prefix_query_tokens - before.prefix_query_tokens == 80
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == 32
    assert after.prompt_tokens_total - before.prompt_tokens_total == 80
    assert after.generation_tokens_total - before.generation_tokens_total == 20
    assert after.expert_imbalance >= 1.0
    assert (info.max_model_len, info.vocab_size, info.dp, info.tp, info.num_blocks) == (2048, 512, 1, 1, 64)


def test_load_counts_tokens_per_step_and_info_has_the_cache_config(engine):
    """One request of a 40-token prompt and 10 tokens: a 40-token step, then 9 steps of one token."""
    async def go():
        client = EngineClient(0, engine.address)
        before = await client.get_load()
        msgs = await collect(client, "steps", list(range(440, 480)), GREEDY)
        after = await client.get_load()
        info = await client.get_info()
        await client.close()
        return before, msgs, after, info

    before, msgs, after, info = run(go())
    assert msgs[-1].num_cached_tokens == 0  # (a prompt no other test sends: all 40 tokens computed)
    # the router's per-request histograms: the engine's times, on the last message only
    last = msgs[-1].times
    assert last.prefill_s > 0 and last.decode_s > 0 and last.queued_s >= 0
    # the first message with a token has the queue and prefill times, no decode time yet; the ones between none
    first = next(m for m in msgs if m.token_ids)
    assert first is not msgs[-1] and first.times.prefill_s == last.prefill_s and not first.times.decode_s
    assert first.times.queued_s == last.queued_s
    assert not any(m.times for m in msgs[1:-1] if m is not first)
    grew = dict(zip(ITERATION_TOKENS_BUCKETS, (b - a for a, b in zip(before.iteration_tokens_buckets,
                                                                      after.iteration_tokens_buckets))))
    assert (grew[1], grew[8], grew[32], grew[64], grew[16384]) == (9, 9, 9, 10, 10)
    assert after.iteration_steps_total - before.iteration_steps_total == 10
    assert after.iteration_tokens_sum - before.iteration_tokens_sum == 40 + 9
    assert (info.block_size, info.cache_dtype, info.enable_prefix_caching) == (16, "auto", True)


def test_health_and_drain_on_stop(ckpt):
    server, thread = start(ckpt, drain_timeout_s=30.0)

    async def go():
        client = EngineClient(0, server.address)
        health = health_pb2_grpc.HealthStub(client.channel)
        serving = (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status
        with StepGate(server, "running") as gate:  # "running" is unfinished while the stop lands
            stream = client.generate("running", [1, 2, 3],
                                     SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
            await stream.__anext__()
            server.request_stop()
            gate.let_one_step()  # the step whose all-reduce carries the vote
            for _ in range(100):
                if server.draining:
                    break
                await asyncio.sleep(0.02)
            with pytest.raises(EngineUnavailable, match="shutting down"):
                await collect(client, "late", [4, 5], GREEDY)
            draining = (await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status
        rest = [m async for m in stream]  # the running request is finished, not cut
        await client.close()
        return serving, draining, rest

    serving, draining, rest = run(go())
    assert serving == health_pb2.HealthCheckResponse.SERVING
    assert draining == health_pb2.HealthCheckResponse.NOT_SERVING
    assert rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == 30
    thread.join(30)
    assert not thread.is_alive()


def test_drain_timeout_aborts_what_is_left(ckpt):
    server, thread = start(ckpt, drain_timeout_s=0.2)

    async def go():
        client = EngineClient(0, server.address)
        with StepGate(server, "slow") as gate:  # 1000 tokens may take less than 0.2 s on a fast machine
            stream = client.generate("slow", [1, 2, 3],
                                     SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True))
            await stream.__anext__()
            server.request_stop()
            gate.let_one_step()  # the vote: draining, 0.2 s from now
            await asyncio.sleep(0.3)  # past the drain timeout, with the loop held (no token meanwhile)
        rest = [m async for m in stream]
        await client.close()
        return rest

    rest = run(go())
    assert rest[-1].finish_reason == "abort" and rest[-1].num_output_tokens < 1000
    thread.join(30)
    assert not thread.is_alive()


def test_the_engine_token_is_required_on_every_call(ckpt):
    """Mutual TLS under the token (rpc/security.py): a plaintext caller and one with another token are
    refused in the handshake, health checks included; the right token gets everything."""
    server, thread = start(ckpt, token="s3cret")

    async def go():
        anonymous, wrong, right = (EngineClient(0, server.address, token) for token in (None, "guess", "s3cret"))
        for client, match in ((anonymous, None), (wrong, "TLS handshake failed")):
            with pytest.raises(EngineUnavailable, match=match):
                await client.get_load()
            with pytest.raises(EngineUnavailable, match=match):
                await collect(client, "x", [1, 2], GREEDY)
        serving = [await c.is_serving() for c in (anonymous, wrong, right)]
        load = await right.get_load()
        out = await collect(right, "ok", [1, 2, 3], GREEDY)
        for client in (anonymous, wrong, right):
            await client.close()
        return serving, load, out

    serving, load, out = run(go())
    assert serving == [False, False, True]
    assert load.kv_blocks_total == 64 and not load.stalled and out[-1].finish_reason
    server.request_stop()
    thread.join(30)
    assert not thread.is_alive()
