"""``--dispatch-dtype fp8``: the multi-rank dispatchers send FP8 rows with their scales, quantized as the FP8
expert GEMM would, over two spawned gloo ranks (one spawn runs every check of both backends).

What arrives must equal ``act_quant`` of the rows the ``local`` dispatcher hands its experts (bit for bit,
scales in the layout ``act_quant`` returns); padding rows are zero bytes; the dispatch sends at most 0.55x
the bytes of the same dispatch in bf16; the combine, in bf16, equals the ``local`` reference running the same
experts on the same FP8 rows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from test_dispatch import Scenario, expected_rows

from epserve.config import ConfigError
from epserve.kernels.fp8 import BLOCK, act_quant
from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import Dispatcher, ExpertInput
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.dispatch.payload import packed_width, unpack, use_fp8_payload

BACKENDS = {"all_to_all": AllToAllDispatcher, "padded": PaddedDispatcher}
HIDDEN = 256  # two 128-column scale groups
CASES = (
    Scenario(11, num_local_slots=2, top_k=2, tokens=(6, 3), hidden=HIDDEN, dtype=torch.bfloat16),
    # every copy of rank 0's tokens crosses: the padded buffers are full, so padded moves no padding
    Scenario(12, num_local_slots=2, top_k=2, tokens=(5, 5), hidden=HIDDEN, dtype=torch.bfloat16,
             only_to=((0, 1), (1, 0))),
    Scenario(13, num_local_slots=3, top_k=1, tokens=(0, 4), hidden=HIDDEN, dtype=torch.bfloat16),
)


def scaled_inputs(sc: Scenario, world: int) -> list:
    """The scenario's inputs with rows of very different magnitudes (per row and per 128 columns), so a
    scale taken from the wrong row or group shows."""
    out = []
    for x, ids, w in sc.inputs(world):
        mags = torch.logspace(-3, 3, x.shape[0] * 2).view(-1, 2) if x.shape[0] else torch.empty(0, 2)
        out.append(((x.float() * mags.repeat_interleave(BLOCK, dim=1)).to(x.dtype), ids, w))
    return out


def dequant_experts(expert_input: ExpertInput, first_slot: int) -> torch.Tensor:
    """The 'experts' on FP8 rows: dequantized row * (1 + global slot id), in bf16; padding rows give 0."""
    q, s = expert_input.hidden_states, expert_input.scales
    assert s is not None
    x = (q.float().view(q.shape[0], HIDDEN // BLOCK, BLOCK) * s[:, :, None]).view(q.shape[0], HIDDEN)
    counts = expert_input.num_tokens_per_expert
    scale = torch.arange(len(counts), dtype=torch.float32).repeat_interleave(counts) + 1 + first_slot
    scale = torch.cat([scale, scale.new_zeros(x.shape[0] - scale.shape[0])])
    return (x * scale[:, None]).to(torch.bfloat16)


def check_fp8_layer(backend: str, sc: Scenario, world: int, rank: int) -> None:
    group, slots = dist.group.WORLD, sc.num_local_slots
    inputs = scaled_inputs(sc, world)
    x, ids, w = inputs[rank]
    fp8, bf16 = BACKENDS[backend](slots, group, fp8=True), BACKENDS[backend](slots, group)
    for d in (fp8, bf16):
        d.begin_step(max(sc.tokens))
    expert_input, route = fp8.dispatch(x, ids, w)
    bf16.dispatch(x, ids, w)

    # what arrives: act_quant of the rows the local dispatcher gives, bit for bit
    rows, counts = expected_rows(sc, inputs, rank)
    want_q, want_s = act_quant(rows)
    assert expert_input.num_tokens_per_expert.tolist() == counts
    q, s = expert_input.hidden_states, expert_input.scales
    assert q.dtype == torch.float8_e4m3fn and s is not None and s.dtype == torch.float32
    assert s.shape == (q.shape[0], HIDDEN // BLOCK) and s.is_contiguous()  # act_quant's layout on the CPU
    n = sum(counts)
    assert torch.equal(q[:n].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s[:n], want_s)
    assert not q[n:].view(torch.uint8).any() and not s[n:].any()  # padding rows: zero bytes

    # bytes: the packed rows (+ the slot ids where they travel), at most 0.55x the bf16 dispatch
    assert fp8.comm_bytes["dispatch"] <= 0.55 * bf16.comm_bytes["dispatch"]
    if backend == "all_to_all":
        crossing = int((ids // slots != rank).sum())
        assert fp8.comm_bytes["dispatch"] == crossing * packed_width(HIDDEN)
    else:
        capacity = max(sc.tokens) * min(sc.top_k, slots)
        assert fp8.comm_bytes["dispatch"] == (world - 1) * capacity * (packed_width(HIDDEN) + 8)

    # combine in bf16 against the local reference on the same FP8 rows
    out = fp8.combine(dequant_experts(expert_input, rank * slots), route)
    local = LocalDispatcher(world * slots, fp8=True)
    ref_input, ref_route = local.dispatch(x, ids, w)
    ref = local.combine(dequant_experts(ref_input, 0), ref_route)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def check_all(rank: int, world: int) -> int:
    checked = 0
    for backend in sorted(BACKENDS):
        for sc in CASES:
            check_fp8_layer(backend, sc, world, rank)
            checked += 1
    # the micro-batch path: two FP8 dispatches in flight, received in order
    disp: Dispatcher = PaddedDispatcher(2, dist.group.WORLD, fp8=True)
    a, b = scaled_inputs(CASES[0], world)[rank], scaled_inputs(CASES[1], world)[rank]
    disp.begin_step(max(CASES[0].tokens + CASES[1].tokens))
    sent = [disp.dispatch_send(*a), disp.dispatch_send(*b)]
    for handle in sent:
        expert_input, _ = disp.dispatch_recv(handle)
        assert expert_input.scales is not None and int(expert_input.num_tokens_per_expert.sum()) > 0
    return checked + 1


def test_fp8_dispatch_over_two_ranks() -> None:
    assert run_ranks(check_all, 2) == [2 * len(CASES) + 1] * 2


def test_local_fp8_quantizes_tokens_once_as_the_gemm_would() -> None:
    """EP 1: the local dispatcher's FP8 rows are act_quant of its bf16 rows (quantized per token, then copied)."""
    sc = CASES[0]
    x, ids, w = scaled_inputs(sc, 1)[0]
    plain, _ = LocalDispatcher(4).dispatch(x, ids, w)
    fp8, _ = LocalDispatcher(4, fp8=True).dispatch(x, ids, w)
    q, s = act_quant(plain.hidden_states)
    assert torch.equal(fp8.hidden_states.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fp8.scales, s)


def test_unpack_checks_and_zero_rows() -> None:
    assert packed_width(HIDDEN) == HIDDEN + 4 * 2
    q, s = unpack(torch.zeros(3, packed_width(HIDDEN), dtype=torch.uint8), HIDDEN)
    assert q.dtype == torch.float8_e4m3fn and not q.float().any() and not s.any()
    with pytest.raises(ValueError, match=r"uint8 \[N, 264\]"):
        unpack(torch.zeros(3, HIDDEN, dtype=torch.uint8), HIDDEN)


def test_fp8_payload_needs_fp8_expert_weights() -> None:
    assert not use_fp8_payload("auto", True) and not use_fp8_payload("model", True)
    assert use_fp8_payload("fp8", True)
    with pytest.raises(ConfigError, match="--dispatch-dtype fp8.*FP8 routed-expert weights"):
        use_fp8_payload("fp8", False)


@pytest.mark.slow
def test_engine_fp8_dispatch_keeps_tokens_and_halves_the_bytes(make_ckpt) -> None:
    """dp 2 with FP8 expert weights: ``--dispatch-dtype fp8`` gives the tokens of the FP8 runtime in one
    process (the rows are quantized as its expert GEMM quantizes them), while the dispatch of each step
    moves at most 0.55x the bytes of the same all_to_all dispatch in bf16 (``llm.comm_bytes()``)."""
    from epserve import LLM, SamplingParams

    ckpt = make_ckpt("tiny128", fp8=True, dtype="bfloat16", logit_margin=4.0)
    engine = dict(dtype="bfloat16", quantization="fp8", num_blocks=64, max_num_seqs=4)
    prompts = [[5, 17, 99, 3], [100, 200, 300, 7, 8], list(range(40, 52))]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = [o.token_ids for o in LLM(ckpt, **engine).generate(prompts, params)]
    sent = {}
    for dtype in ("fp8", "auto"):
        with LLM(ckpt, dp=2, dispatch="all_to_all", dispatch_dtype=dtype, **engine) as llm:
            llm.reset_comm_stats()
            assert [o.token_ids for o in llm.generate(prompts, params)] == want, dtype
            sent[dtype] = sum(r["dispatch"] for r in llm.comm_bytes())
    assert 0 < sent["fp8"] <= 0.55 * sent["auto"], sent
