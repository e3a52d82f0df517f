"""The router's judgement of its instances from their ``GetInfo``/``GetLoad`` answers: roles, and (with
prefill/decode disaggregation) whether a prefill instance's KV blocks fit a decode instance's cache.
The engines here are small in-process answerers of those two calls; the real engines are in
test_serve_disagg.py."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import pytest

from epserve.router.engine_client import EngineUnavailable
from epserve.router.instances import Instance, Router
from epserve.router.policy import make_policy
from epserve.rpc.proto import engine_pb2 as pb

BF16 = pb.KVLayout(num_layers=3, block_size=16, token_bytes=1152, dtype="bfloat16")
FP8 = pb.KVLayout(num_layers=3, block_size=16, token_bytes=656, dtype="fp8_e4m3")


@dataclass
class Answers:
    index: int
    address: str
    info: pb.GetInfoResponse

    async def get_info(self, timeout: float) -> pb.GetInfoResponse:
        return self.info

    async def get_load(self, timeout: float) -> pb.GetLoadResponse:
        return pb.GetLoadResponse(num_running=self.index)


def router_over(*engines: tuple[str, str, pb.KVLayout]) -> Router:
    """A router over engines given as (listed as, engine's own role, KV layout)."""
    prefill = [f"127.0.0.1:{9000 + i}" for i, (listed, _, _) in enumerate(engines) if listed == "prefill"]
    decode = [f"127.0.0.1:{9000 + i}" for i, (listed, _, _) in enumerate(engines) if listed == "decode"]
    router = Router((), make_policy("least_load"), prefill=prefill, decode=decode)
    router.instances = [
        Instance(Answers(i, f"127.0.0.1:{9000 + i}", pb.GetInfoResponse(role=role, kv_layout=layout)), listed)
        for i, (listed, role, layout) in enumerate(engines)]
    asyncio.run(router.refresh())
    return router


def test_matching_layouts_and_roles_are_served():
    router = router_over(("prefill", "prefill", BF16), ("prefill", "both", BF16), ("decode", "decode", BF16))
    assert router.serving and all(inst.healthy for inst in router.instances)


def test_a_kv_layout_no_peer_can_take_is_refused_at_start_with_the_reason(caplog):
    caplog.set_level(logging.WARNING, logger="epserve.router.instances")
    router = router_over(("prefill", "prefill", BF16), ("decode", "decode", FP8))
    asyncio.run(router.refresh())  # said once per instance, not at every refresh
    assert [r.getMessage().split(": ")[0] for r in caplog.records] == [
        "engine 0 at 127.0.0.1:9000 is not used", "engine 1 at 127.0.0.1:9001 is not used"]
    assert not router.serving
    prefill, decode = router.instances
    assert prefill.last_error == ("no decode instance can take its KV (KV layouts differ: 3 layers x 16-token "
                                  "blocks of 1152 bytes (bfloat16) vs 3 x 16 of 656 (fp8_e4m3))")
    assert decode.last_error.startswith("no prefill instance can take its KV")
    with pytest.raises(EngineUnavailable, match="fp8_e4m3"):
        router.choose([1, 2, 3], role="prefill")


def test_a_request_goes_to_a_decode_instance_that_can_take_its_prefill_kv():
    router = router_over(("prefill", "prefill", BF16), ("prefill", "prefill", FP8),
                         ("decode", "decode", FP8), ("decode", "decode", BF16))
    assert all(inst.healthy for inst in router.instances)  # each layout has a partner
    bf16_prefill, fp8_prefill, fp8_decode, bf16_decode = router.instances
    # The FP8 decode instance is the less loaded one (load = index), but cannot take BF16 blocks.
    assert router.choose([1], role="decode") is fp8_decode
    assert router.choose([1], role="decode", kv_from=bf16_prefill) is bf16_decode
    assert router.choose([1], role="decode", kv_from=fp8_prefill) is fp8_decode
    with pytest.raises(EngineUnavailable):
        router.choose([1], exclude={3}, role="decode", kv_from=bf16_prefill)


def test_an_engine_in_another_role_is_not_used():
    router = router_over(("prefill", "decode", BF16), ("decode", "decode", BF16))
    assert [inst.last_error for inst in router.instances] == [
        "the engine's role is decode; the router uses it as prefill", ""]
    assert not router.serving
