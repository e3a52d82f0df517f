"""``--dispatch-dtype nvfp4``: every dispatcher sends each token row as NVFP4 (e2m1 codes, e4m3 scales per 16
columns, one fp32 scale per token) and its experts get it unpacked; the combine stays in the activation dtype.

The rows quantized per token are the same wherever they go: what the ``local`` dispatcher (EP 1) hands its
experts is what the multi-rank backends deliver (``all_to_all``, ``padded`` and ``symm_mem`` through its gloo
twin, over two spawned ranks), bit for bit, and the combines agree. Bytes: H = 512 (the shape the ratio is
checked on), where a row costs H/2 + H/16 + 4 = 292 bytes against 1024 in bf16 (0.285; the fixed 4 bytes of
the token's scale, and ``padded``'s 8 of the slot id, weigh less as H grows: at H = 64 the row alone would be
0.31x)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks
from test_dispatch import Scenario, expected_rows

from epserve import LLM
from epserve.checkpoint.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from epserve.config import ConfigError, ModelConfig
from epserve.engine.options import build_engine_config
from epserve.kernels.nvfp4_act import nvfp4_act_dequant, nvfp4_act_quant, nvfp4_token_scale
from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import ExpertInput
from epserve.moe.dispatch.exchange import GlooExchange
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.dispatch.payload import (
    Payload,
    nvfp4_width,
    payload_kind,
    quantize_nvfp4_packed,
    unpack_nvfp4,
)
from epserve.moe.dispatch.select import nvfp4_routed_experts
from epserve.moe.dispatch.symm_mem import SymmMemDispatcher
from epserve.moe.experts import GroupedExperts

HIDDEN = 512
CASES = (
    Scenario(21, num_local_slots=2, top_k=2, tokens=(6, 3), hidden=HIDDEN, dtype=torch.bfloat16),
    # every copy of rank 0's tokens crosses
    Scenario(22, num_local_slots=2, top_k=2, tokens=(5, 5), hidden=HIDDEN, dtype=torch.bfloat16,
             only_to=((0, 1), (1, 0))),
    Scenario(23, num_local_slots=3, top_k=1, tokens=(0, 4), hidden=HIDDEN, dtype=torch.bfloat16),
)


def _inputs(sc: Scenario, world: int) -> list:
    """Rows of very different magnitudes, so a global scale taken from the wrong row shows."""
    out = []
    for x, ids, w in sc.inputs(world):
        mags = torch.logspace(-3, 3, x.shape[0]).unsqueeze(1) if x.shape[0] else torch.empty(0, 1)
        out.append(((x.float() * mags).to(x.dtype), ids, w))
    return out


def slot_scaled(expert_input: ExpertInput, first_slot: int) -> torch.Tensor:
    """The 'experts' on NVFP4 rows: dequantized row * (1 + global slot id), in bf16; padding rows give 0."""
    assert expert_input.scales is not None and expert_input.global_scale is not None
    x = nvfp4_act_dequant(expert_input.hidden_states, expert_input.scales, expert_input.global_scale, torch.float32)
    counts = expert_input.num_tokens_per_expert
    scale = torch.arange(len(counts), dtype=torch.float32).repeat_interleave(counts) + 1 + first_slot
    scale = torch.cat([scale, scale.new_zeros(x.shape[0] - scale.shape[0])])
    return (x * scale[:, None]).to(torch.bfloat16)


def _build(backend: str, sc: Scenario, nvfp4: bool):  # noqa: ANN202
    group = dist.group.WORLD
    if backend == "symm_mem":
        return SymmMemDispatcher(sc.num_local_slots, group, sc.top_k, max(sc.tokens), HIDDEN, sc.dtype,
                                 torch.device("cpu"), exchange=GlooExchange(group), nvfp4=nvfp4)
    return {"all_to_all": AllToAllDispatcher, "padded": PaddedDispatcher}[backend](
        sc.num_local_slots, group, nvfp4=nvfp4)


def check_layer(backend: str, sc: Scenario, world: int, rank: int) -> None:
    inputs = _inputs(sc, world)
    x, ids, w = inputs[rank]
    nv, bf16 = _build(backend, sc, True), _build(backend, sc, False)
    for d in (nv, bf16):
        d.begin_step(max(sc.tokens))
    expert_input, route = nv.dispatch(x, ids, w)
    bf16.dispatch(x, ids, w)

    # what arrives: the rows the local dispatcher gives, quantized per token, bit for bit
    rows, counts = expected_rows(sc, inputs, rank)
    g = nvfp4_token_scale(rows)
    want_values, want_scales = nvfp4_act_quant(rows, g)
    assert expert_input.num_tokens_per_expert.tolist() == counts
    n = sum(counts)
    values, scales, global_scale = expert_input.hidden_states, expert_input.scales, expert_input.global_scale
    assert values.dtype == torch.uint8 and values.shape[1] == HIDDEN // 2
    assert scales is not None and scales.dtype == torch.float8_e4m3fn and global_scale is not None
    assert torch.equal(values[:n], want_values) and torch.equal(global_scale[:n], g)
    assert torch.equal(scales[:n].view(torch.uint8), want_scales.view(torch.uint8))
    if backend == "padded":  # padding rows: zero bytes, zero values
        assert not values[n:].any() and not scales[n:].view(torch.uint8).any() and not global_scale[n:].any()

    # bytes: at most 0.3x the same dispatch in bf16; all_to_all's are exactly the crossing rows' packed bytes
    sent, exact = nv.comm_bytes["dispatch"], bf16.comm_bytes["dispatch"]
    assert sent <= 0.3 * exact, (backend, sent, exact)
    if backend != "padded":
        assert sent == int((ids // sc.num_local_slots != rank).sum()) * nvfp4_width(HIDDEN)

    # combine in bf16 against the local reference on the same NVFP4 rows
    out = nv.combine(slot_scaled(expert_input, rank * sc.num_local_slots), route)
    local = LocalDispatcher(world * sc.num_local_slots, nvfp4=True)
    ref_input, ref_route = local.dispatch(x, ids, w)
    ref = local.combine(slot_scaled(ref_input, 0), ref_route)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def check_all(rank: int, world: int) -> int:
    checked = 0
    for backend in ("all_to_all", "padded", "symm_mem"):
        for sc in CASES:
            check_layer(backend, sc, world, rank)
            checked += 1
    return checked


@pytest.mark.slow
def test_nvfp4_dispatch_over_two_ranks_equals_local_at_0_3x_the_bytes() -> None:
    assert run_ranks(check_all, 2) == [3 * len(CASES)] * 2


def test_local_nvfp4_quantizes_each_token_once() -> None:
    """EP 1: the local dispatcher's NVFP4 rows are its bf16 rows quantized with their own token scale, which is
    ModelOpt's quantization of each row (checkpoint.nvfp4); its padding-free input reaches the experts."""
    x, ids, w = _inputs(CASES[0], 1)[0]
    plain, _ = LocalDispatcher(4).dispatch(x, ids, w)
    nv, _ = LocalDispatcher(4, nvfp4=True).dispatch(x, ids, w)
    assert torch.equal(nv.num_tokens_per_expert, plain.num_tokens_per_expert)
    g = nvfp4_token_scale(plain.hidden_states)
    values, scales = nvfp4_act_quant(plain.hidden_states, g)
    assert torch.equal(nv.hidden_states, values) and torch.equal(nv.global_scale, g)
    assert torch.equal(nv.scales.view(torch.uint8), scales.view(torch.uint8))
    row = nvfp4_quantize(plain.hidden_states[:1], g[0])
    assert torch.equal(nv.hidden_states[:1], row.weight)
    dequantized = nvfp4_act_dequant(nv.hidden_states, nv.scales, nv.global_scale, torch.float32)
    assert torch.equal(dequantized[:1], nvfp4_dequantize(*row))


def test_payload_rows_widths_and_zero_rows() -> None:
    assert nvfp4_width(7168) == 3584 + 448 + 4 and nvfp4_width(7168) / (2 * 7168) < 0.29  # DeepSeek-V3
    assert nvfp4_width(HIDDEN) / (2 * HIDDEN) <= 0.3
    payload = Payload(nvfp4=True)
    assert payload.kind == "nvfp4" and payload.dtype(torch.bfloat16) == torch.uint8
    assert payload.width(HIDDEN) == HIDDEN // 2 + HIDDEN // 16 + 4
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    packed = quantize_nvfp4_packed(x)
    assert packed.dtype == torch.uint8 and packed.shape == (3, nvfp4_width(HIDDEN))
    rows = unpack_nvfp4(torch.cat([packed, packed.new_zeros(1, packed.shape[1])]), HIDDEN)
    back = nvfp4_act_dequant(*rows, torch.bfloat16)
    assert not back[3].any()  # a zero row (padding) is zero values
    error = (back[:3].float() - x.float()).abs().amax(1)
    assert (error <= x.float().abs().amax(1) / 5).all()  # half of e2m1's widest step (2, near 6) over its range
    with pytest.raises(ValueError, match=r"uint8 \[N, 292\]"):
        unpack_nvfp4(packed[:, :-1], HIDDEN)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_width(72)
    with pytest.raises(ValueError, match="not both"):
        Payload(fp8=True, nvfp4=True)


def test_experts_take_the_nvfp4_payload_as_its_dequantized_rows() -> None:
    """Experts of the model dtype and NVFP4 experts (W4A16) compute on the payload's values in act_dtype."""
    torch.manual_seed(3)
    e, h, inter = 2, 64, 32
    x = torch.randn(5, h)
    counts = torch.tensor([3, 2])
    g = nvfp4_token_scale(x)
    values, scales = nvfp4_act_quant(x, g)
    payload = ExpertInput(values, counts, scales=scales, global_scale=g)
    dense = ExpertInput(nvfp4_act_dequant(values, scales, g, torch.float32), counts)
    plain = GroupedExperts(e, h, inter)
    plain.w13.data, plain.w2.data = torch.randn(e, 2 * inter, h), torch.randn(e, h, inter)
    assert torch.equal(plain(payload), plain(dense))
    four_bit = GroupedExperts(e, h, inter, nvfp4=True)
    for name, n, k, num_parts in (("w13", 2 * inter, h, 2), ("w2", h, inter, 1)):
        parts = [nvfp4_quantize(torch.randn(n, k)) for _ in range(e)]  # one global scale for gate and up
        getattr(four_bit, name).data = torch.stack([p.weight for p in parts])
        getattr(four_bit, f"{name}_scale").data = torch.stack([p.weight_scale for p in parts])
        getattr(four_bit, f"{name}_scale_2").data = torch.stack([p.weight_scale_2.repeat(num_parts) for p in parts])
    with pytest.raises(ValueError, match="act_dtype"):
        four_bit(payload)
    four_bit.act_dtype = torch.float32
    assert torch.equal(four_bit(payload), four_bit(dense))


def test_nvfp4_dispatch_needs_nvfp4_routed_experts(tiny_ckpt, make_ckpt) -> None:
    with pytest.raises(ConfigError, match=r"--dispatch-dtype nvfp4.*NVFP4 routed-expert weights.*"
                                          r"make-checkpoint --quantization nvfp4"):
        build_engine_config(tiny_ckpt, dispatch_dtype="nvfp4")
    nvfp4_ckpt = make_ckpt("tiny", quantization="nvfp4")
    assert build_engine_config(nvfp4_ckpt, dispatch_dtype="nvfp4").parallel.dispatch_dtype == "nvfp4"
    config = ModelConfig.from_hf(nvfp4_ckpt)
    assert nvfp4_routed_experts(config) and not nvfp4_routed_experts(ModelConfig.from_hf(tiny_ckpt))
    excluded = dataclasses.replace(config, nvfp4_exclude=(*config.nvfp4_exclude, "model.layers.2.mlp.experts*"))
    assert not nvfp4_routed_experts(excluded)
    assert payload_kind("nvfp4", False, True) == "nvfp4" and payload_kind("auto", False, True) == "model"
    assert payload_kind("fp8", True, False) == "fp8"
    with pytest.raises(ConfigError, match=r"--dispatch-dtype nvfp4.*NVFP4 routed-expert weights"):
        payload_kind("nvfp4", True, False)


@pytest.mark.slow
def test_engine_nvfp4_dispatch_same_tokens_at_any_ep_under_0_3x_the_bytes(make_ckpt) -> None:
    """An NVFP4 checkpoint (tiny, H = 512) in bf16: ``--dispatch-dtype nvfp4`` gives the same greedy tokens at
    EP 1 (local) and dp 2 (padded), and the dispatch of the same steps moves at most 0.3x the bytes of the
    bf16 dispatch (``llm.comm_bytes()``; padded's bytes depend on the step's shape only, not on the tokens)."""
    from epserve import SamplingParams

    ckpt = make_ckpt("tiny", dtype="bfloat16", quantization="nvfp4", overrides={"hidden_size": HIDDEN},
                     logit_margin=4.0)
    engine = dict(dtype="bfloat16", num_blocks=64, max_num_seqs=4)
    prompts = [[5, 17, 99, 3], [100, 200, 300, 7, 8], list(range(40, 52))]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(ckpt, dispatch_dtype="nvfp4", **engine).generate(prompts, params)]
    sent = {}
    for dtype in ("nvfp4", "auto"):
        with LLM(ckpt, dp=2, dispatch="padded", dispatch_dtype=dtype, **engine) as llm:
            llm.reset_comm_stats()
            tokens = [o.token_ids for o in llm.generate(prompts, params)]
            if dtype == "nvfp4":
                assert tokens == want
            sent[dtype] = sum(r["dispatch"] for r in llm.comm_bytes())
    assert 0 < sent["nvfp4"] <= 0.3 * sent["auto"], sent


@pytest.mark.parametrize("backend", ["local", "padded"])
def test_cuda_decode_trace_with_the_nvfp4_payload_has_no_host_syncs(backend, make_ckpt, request) -> None:
    """The decode forward CUDA graphs capture, traced as CUDA without a GPU (``tests/engine/test_cuda_trace.py``)
    with the NVFP4 payload (``local``, and ``padded`` on a one-rank gloo group, its collectives in the trace):
    the quantization, the exchange and the experts' dequantization read nothing on the host and copy nothing
    from it."""
    from tests.engine.test_cuda_trace import BATCH, trace_decode

    llm = LLM(make_ckpt("tiny", quantization="nvfp4"), dtype="bfloat16", num_blocks=32,
              max_num_seqs=BATCH, dispatch_dtype="nvfp4")
    runner = llm.engine.runner
    if backend == "padded":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        request.addfinalizer(dist.destroy_process_group)
        padded = PaddedDispatcher(runner.placement.num_local_slots, dist.group.WORLD, nvfp4=True)
        padded.begin_step(BATCH)
        for layer in runner.model.layers:
            if layer.is_moe:
                layer.mlp.dispatcher = padded
    assert all(layer.mlp.dispatcher.payload.nvfp4 for layer in runner.model.layers if layer.is_moe)
    log = trace_decode(llm, (9, 0))
    assert not log.host_to_device, log.host_to_device
    assert {"aten.exp2", "epserve.nvfp4_moe_swiglu"} <= log.ops  # exp2: the experts' e2m1 decode of the payload
    if backend == "padded":
        assert "_c10d_functional.all_to_all_single" in log.ops
