"""The ``symm_mem`` dispatcher on the CPU: its host-free bookkeeping, and the whole dispatcher over spawned
gloo ranks through the exchange's gloo twin (its NVSHMEM exchange needs CUDA: ``test_dispatch_cuda.py``),
and its refusals.

``compact_index`` turns received blocks described expert-major (splits and offsets; blocks anywhere in the
buffer, e.g. slot groups with gaps between them) into the gather that gives the expert GEMM its layout:
rows of slot 0, slot 1, ..., then the zero row. Over gloo, at EP 2 and 4 with 20 experts per rank (past
the 16 of torch's 2-D op) and top-8 routing, in fp32, bf16 and with an FP8 payload: the experts' input
holds exactly the rows the ``local`` dispatcher gives (padding rows, poisoned with NaN, never reach the
experts' output, and the experts' padding outputs, poisoned too, never reach the combine), the output equals
the ``local`` reference, and ``comm_bytes`` counts only the real rows that leave the rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from test_dispatch import Scenario, expected_rows
from test_dispatch_fp8 import scaled_inputs

from epserve import LLM
from epserve.config import ConfigError, ModelConfig, ParallelConfig
from epserve.kernels.fp8 import act_quant
from epserve.moe.dispatch.base import ExpertInput
from epserve.moe.dispatch.exchange import GlooExchange
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.payload import packed_width
from epserve.moe.dispatch.symm_layout import BufferShape, compact_index
from epserve.moe.dispatch.symm_mem import SymmMemDispatcher, check_symm_mem
from epserve.moe.experts import GroupedExperts, dequantize_rows


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


# ---- the whole dispatcher over gloo ---------------------------------------------------------------------------

SLOTS, TOP_K, HIDDEN, INTER = 20, 8, 256, 32


def cases(world: int) -> dict[str, tuple[Scenario, bool]]:
    """name -> (scenario, FP8 payload)."""
    return {
        "fp32": (Scenario(21, SLOTS, TOP_K, tokens=(5, 0, 9, 3), hidden=HIDDEN), False),
        "bf16": (Scenario(22, SLOTS, TOP_K, tokens=(4, 7, 1, 6), hidden=HIDDEN, dtype=torch.bfloat16), False),
        "fp8": (Scenario(23, SLOTS, TOP_K, tokens=(6, 2, 0, 5), hidden=HIDDEN, dtype=torch.bfloat16), True),
        # every token of rank 0 to the last rank: it receives min(K, S) copies of each, its most
        "one_target": (Scenario(24, SLOTS, TOP_K, tokens=(9, 3, 4, 1), hidden=HIDDEN, only_to=((0, world - 1),)),
                       False),
    }


def all_experts(world: int, dtype: torch.dtype) -> GroupedExperts:
    """The same random experts on every rank: all ``world * SLOTS`` of them (the local reference's)."""
    g = torch.Generator().manual_seed(7)
    experts = GroupedExperts(world * SLOTS, HIDDEN, INTER)
    experts.w13.data = (torch.randn(experts.w13.shape, generator=g) / 16).to(dtype)
    experts.w2.data = (torch.randn(experts.w2.shape, generator=g) / 8).to(dtype)
    return experts


def local_experts(full: GroupedExperts, rank: int) -> GroupedExperts:
    mine = GroupedExperts(SLOTS, HIDDEN, INTER)
    mine.w13.data, mine.w2.data = (w[rank * SLOTS : (rank + 1) * SLOTS] for w in (full.w13.data, full.w2.data))
    return mine


def poisoned(expert_input: ExpertInput) -> ExpertInput:
    """The masked rows past the real ones made NaN: any that reaches an output shows."""
    n = int(expert_input.num_tokens_per_expert.sum())
    rows = expert_input.hidden_states.clone()
    rows.view(torch.uint8)[n:] = 0x7F  # NaN in float8 e4m3; a NaN byte pattern in fp32 and bf16 too
    scales = None if expert_input.scales is None else expert_input.scales.clone().index_fill_(
        0, torch.arange(n, rows.shape[0]), float("nan"))
    return dataclasses.replace(expert_input, hidden_states=rows, scales=scales)


def slot_scaled(expert_input: ExpertInput, first_slot: int) -> torch.Tensor:
    """Elementwise 'experts' on the real rows only: (dequantized) row * (1 + global slot id); NaN past them."""
    counts = expert_input.num_tokens_per_expert
    n = int(counts.sum())
    rows = expert_input.hidden_states[:n]
    if expert_input.scales is not None:
        rows = dequantize_rows(rows, expert_input.scales[:n], torch.float32)
    scale = torch.arange(len(counts), dtype=torch.float32).repeat_interleave(counts) + 1 + first_slot
    y = torch.full((expert_input.hidden_states.shape[0], HIDDEN), float("nan"))
    y[:n] = rows.float() * scale[:, None]
    return y


def symm_layer(disp: SymmMemDispatcher, experts: GroupedExperts, sc: Scenario, fp8: bool, world: int, rank: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer through ``disp`` (its step begun) twice, checked on the way: with the elementwise experts (in
    fp32), then with the real ones. Returns both outputs."""
    inputs = scaled_inputs(sc, world) if fp8 else sc.inputs(world)
    x, ids, w = inputs[rank]
    disp.reset_stats()
    expert_input, route = disp.dispatch(x, ids, w)
    rows, counts = expected_rows(sc, inputs, rank)
    n = sum(counts)
    assert expert_input.num_tokens_per_expert.tolist() == counts
    if disp.step_tokens <= disp.max_tokens_per_rank:
        assert expert_input.masked
        assert expert_input.hidden_states.shape[0] == world * disp.step_tokens * min(TOP_K, SLOTS)
        assert expert_input.rows_per_expert == disp.step_tokens * TOP_K / SLOTS
    got = expert_input.hidden_states[:n]
    if fp8:
        want_q, want_s = act_quant(rows)
        assert torch.equal(got.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(expert_input.scales[:n], want_s)
    else:
        assert torch.equal(got, rows)
    exact = disp.combine(slot_scaled(expert_input, rank * SLOTS).to(sc.dtype), route)
    # bytes: the real rows that leave the rank, dispatch in the payload's width, combine in the activations'
    row = packed_width(HIDDEN) if fp8 else HIDDEN * x.element_size()
    dest = [i // SLOTS for _, i, _ in inputs]
    sent = int((dest[rank] != rank).sum())
    received = sum(int((d == rank).sum()) for src, d in enumerate(dest) if src != rank)
    assert disp.comm_bytes == {"dispatch": sent * row, "combine": received * HIDDEN * x.element_size()}

    expert_input, route = disp.dispatch(x, ids, w)
    y = experts(poisoned(expert_input) if expert_input.masked else expert_input)
    assert torch.isfinite(y[:n]).all()
    if expert_input.masked:
        y[n:] = float("nan")
    return exact, disp.combine(y, route)


def local_reference(full: GroupedExperts, sc: Scenario, fp8: bool, world: int, rank: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``local`` dispatcher's outputs with the elementwise experts and with the real ones."""
    x, ids, w = (scaled_inputs(sc, world) if fp8 else sc.inputs(world))[rank]
    local = LocalDispatcher(world * SLOTS, fp8)
    expert_input, route = local.dispatch(x, ids, w)
    exact = local.combine(slot_scaled(expert_input, 0).to(sc.dtype), route)
    expert_input, route = local.dispatch(x, ids, w)
    return exact, local.combine(full(expert_input), route)


def check_symm_mem_over_gloo(rank: int, world: int) -> int:
    group, checked = dist.group.WORLD, 0
    for name, (sc, fp8) in cases(world).items():
        full = all_experts(world, sc.dtype)
        full.act_dtype = sc.dtype
        mine = local_experts(full, rank)
        most = max(sc.tokens[:world])
        disp = SymmMemDispatcher(SLOTS, group, TOP_K, most, HIDDEN, sc.dtype, torch.device("cpu"), fp8,
                                 exchange=GlooExchange(group))
        assert disp.workspace_bytes() == 2 * disp.shape.bytes() > 0
        ref_exact, ref = local_reference(full, sc, fp8, world, rank)
        for step_tokens in (most, most + 2, 2 * most + 1):  # the last: past the buffers, through all_to_all
            disp.begin_step(max(step_tokens, 1))
            exact, out = symm_layer(disp, mine, sc, fp8, world, rank)
            what = f"{name}, {step_tokens} tokens"
            torch.testing.assert_close(exact, ref_exact, rtol=0, atol=0, msg=lambda m, what=what: f"{what}: {m}")
            torch.testing.assert_close(out, ref, msg=lambda m, what=what: f"{what}: {m}")  # GEMMs batch otherwise
            checked += 1
    # two micro-batches in flight: both sends before either receive, combines received in reverse order
    sc_a, sc_b = cases(world)["fp32"][0], cases(world)["one_target"][0]
    disp = SymmMemDispatcher(SLOTS, group, TOP_K, 9, HIDDEN, torch.float32, torch.device("cpu"),
                             exchange=GlooExchange(group))
    ins = {"a": sc_a.inputs(world)[rank], "b": sc_b.inputs(world)[rank]}
    with pytest.raises(RuntimeError, match="begin_step"):
        disp.dispatch_send(*ins["b"])
    disp.begin_step(8)
    if len(ins["b"][0]) > 8:  # rank 0 of one_target: 9 tokens
        with pytest.raises(RuntimeError, match="exceed"):
            disp.dispatch_send(*ins["b"])
    disp.begin_step(9)
    sent = {k: disp.dispatch_send(*ins[k]) for k in ("a", "b")}
    combining = {}
    for k in ("a", "b"):
        expert_input, route = disp.dispatch_recv(sent[k])
        combining[k] = disp.combine_send(slot_scaled(expert_input, rank * SLOTS), route)
    with pytest.raises(RuntimeError, match="in flight"):
        disp.dispatch_send(*ins["a"])
    for k, sc in (("b", sc_b), ("a", sc_a)):
        want = local_reference(all_experts(world, torch.float32), sc, False, world, rank)[0]
        torch.testing.assert_close(disp.combine_recv(combining[k]), want, rtol=0, atol=0)
    return checked + 1


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_symm_mem_dispatcher_over_gloo_matches_local(world_size: int) -> None:
    """More than 16 experts per rank, exact against ``local``, masked padding, real bytes only."""
    assert run_ranks(check_symm_mem_over_gloo, world_size, timeout=600) == [3 * len(cases(world_size)) + 1] * world_size


def test_symm_mem_serves_deepseek_v3_at_ep8_16_32_and_names_its_limit(make_ckpt):
    """256 routed experts: 32, 16 and 8 slots per rank, past the 16 of torch's 2-D op."""
    v3 = dataclasses.replace(ModelConfig.from_hf(make_ckpt("tiny")), n_routed_experts=256, num_attention_heads=128)
    for ep in (8, 16, 32):
        ParallelConfig(dp=ep, dispatch="symm_mem").check_model(v3)
    with pytest.raises(ConfigError, match=r"symm_mem.*--dispatch symm_mem.*512.*--dispatch padded"):
        ParallelConfig(dp=1024, dispatch="symm_mem")


def _blocks_per_peer(input_bytes: int, ep: int, max_blocks: int) -> int:
    """torch's all_to_all_vdev: min(round_up(ceil(bytes / 64 KiB), ep), max_blocks) blocks, per peer."""
    chunks = -(-input_bytes // 65536)
    blocks = min(-(-chunks // ep) * ep, max_blocks)
    return max(blocks // ep, 1)


@pytest.mark.parametrize("ep", [1, 2, 4, 6, 8, 12, 16, 32, 64, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_buffer_rows_split_evenly_over_the_exchange_blocks(ep: int, fp8: bool) -> None:
    """DeepSeek-V3's rows (7168 bf16, or packed FP8) in buffers of any token count: every peer's bytes divide
    by the blocks the op gives it, within a node (64) and across nodes (16), for the dispatch and the combine."""
    for tokens in (1, 7, 256):
        shape = BufferShape(send_rows=tokens * 8, recv_rows=ep * tokens * 8, width=packed_width(7168) if fp8 else 7168,
                            payload_dtype=torch.uint8 if fp8 else torch.bfloat16, hidden=7168, dtype=torch.bfloat16,
                            slots=256 // min(ep, 256) or 1, ep=ep)
        payload, out = shape.strides()
        assert payload >= shape.width and out >= shape.hidden
        for rows, stride, item in ((shape.send_rows, payload, 1 if fp8 else 2), (shape.recv_rows, out, 2)):
            row_bytes, input_bytes = stride * item, shape.allocated(rows) * stride * item
            for max_blocks in (64, 16):
                per_peer = _blocks_per_peer(input_bytes, ep, max_blocks)
                assert all(n * row_bytes % per_peer == 0 for n in (1, 3, 17, rows)), (tokens, max_blocks, per_peer)


def test_v3_buffers_at_ep16_are_sized_for_decode_steps() -> None:
    """256 tokens per rank at EP16: about 0.5 GiB a buffer set (the payload and the combine sharing it)."""
    shape = BufferShape(send_rows=256 * 8, recv_rows=16 * 256 * 8, width=7168, payload_dtype=torch.bfloat16,
                        hidden=7168, dtype=torch.bfloat16, slots=16, ep=16)
    assert shape.bytes() == (256 * 8 + 16 * 256 * 8) * 7168 * 2 + 8 * (9 * 16 + 2 * 16 * 16)
    assert 2 * shape.bytes() < 2**30
