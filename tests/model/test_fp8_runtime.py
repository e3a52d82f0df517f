"""The FP8 runtime: FP8 block-scaled weights kept as stored (and run through the FP8 GEMMs), the FP8
latent KV cache, and the options and errors around them. The oracle is the same checkpoint
dequantized at load (``quantization=None``) with a bf16 cache."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.checkpoint import SCALE_SUFFIX, CheckpointReader, fp8_block_quantize
from epserve.config import ConfigError, ModelConfig
from epserve.kernels.fp8 import act_quant
from epserve.model.load_plan import model_bytes, plan_weight_bytes
from epserve.model.loader import load_model
from epserve.model.quantization import fp8_runtime_problems
from epserve.moe.dispatch.base import ExpertInput
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.context import ParallelContext

MARGIN = 4.0  # logit_margin of the fixture (presets.random_weights): most greedy steps have clear top-2 gaps
MIN_MARGIN_NATS = 1.0  # a prompt counts as clear when every greedy step's top-2 gap is at least this


@pytest.fixture(scope="module")
def fp8_ckpt(make_ckpt):
    return make_ckpt("tiny128", fp8=True, dtype="bfloat16")


@pytest.fixture(scope="module")
def margin_ckpt(make_ckpt):
    return make_ckpt("tiny128", fp8=True, dtype="bfloat16", logit_margin=MARGIN)


def _llm(path, **kw):
    return LLM(path, num_blocks=kw.pop("num_blocks", 96), max_num_seqs=16, **kw)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(torch.randint(3, 24, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def _gaps(out) -> list[float]:
    return [lp.top[0][1] - lp.top[1][1] for lp in out.logprobs]


def test_fp8_weights_are_kept_as_stored(fp8_ckpt):
    llm = _llm(fp8_ckpt, quantization="fp8")
    model = llm.engine.runner.model
    reader = CheckpointReader(fp8_ckpt)
    attn = model.layers[1].self_attn
    assert attn.fused_qkv_a_proj.weight.dtype == torch.float8_e4m3fn
    fused = torch.cat([reader.get_raw("model.layers.1.self_attn.q_a_proj.weight_scale_inv"),
                       reader.get_raw("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv")])
    assert torch.equal(attn.fused_qkv_a_proj.weight_scale_inv, fused)
    experts = model.layers[1].mlp.experts
    for slot, e in enumerate(model.layers[1].mlp.slot_experts[:3].tolist()):
        up = reader.get_raw(f"model.layers.1.mlp.experts.{e}.up_proj.weight")
        assert torch.equal(experts.w13[slot, 128:].view(torch.uint8), up.view(torch.uint8))
        assert torch.equal(experts.w2_scale_inv[slot],
                           reader.get_raw(f"model.layers.1.mlp.experts.{e}.down_proj.weight{SCALE_SUFFIX}"))
    assert model.embed_tokens.dtype == torch.bfloat16 and model.layers[1].mlp.gate.weight.dtype == torch.float32
    # The meta-device plan is what was materialized, to the byte.
    mc = llm.config.model
    assert plan_weight_bytes(mc, ParallelContext.single(torch.device("cpu")), fp8=True) == model_bytes(model)
    dequantized = _llm(fp8_ckpt, quantization=None).engine.runner.model
    assert plan_weight_bytes(mc, ParallelContext.single(torch.device("cpu")), fp8=False) == model_bytes(dequantized)
    assert model_bytes(model) < 0.62 * model_bytes(dequantized)


@pytest.mark.parametrize("fp8_payload", [False, True])
def test_fp8_moe_layer_on_a_masked_input(fp8_ckpt, fp8_payload):
    """The engine's FP8 experts on a masked input (the ``symm_mem`` dispatcher's layout: padding rows never
    written, NaN here, and the tile hint) give the unmasked input's real rows exactly, on rows in the model
    dtype and on an FP8 payload."""
    experts = _llm(fp8_ckpt, quantization="fp8").engine.runner.model.layers[1].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.act_dtype == torch.bfloat16
    e, h = experts.num_local_experts, experts.w13.shape[2]
    counts = torch.arange(e) % 3  # a third of the experts get no row
    total = int(counts.sum())
    x = torch.randn(total + 6 * e, h, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[total:] = float("nan")
    scales = None
    if fp8_payload:
        q, scales = act_quant(x[:total])
        x = torch.cat([q, torch.full((x.shape[0] - total, h), 0x7F, dtype=torch.uint8).view(q.dtype)])  # NaN
        scales = torch.cat([scales, torch.full((x.shape[0] - total, scales.shape[1]), float("nan"))])
    masked = ExpertInput(x, counts, scales=scales, masked=True, rows_per_expert=total / e)
    plain = ExpertInput(x[:total], counts, scales=None if scales is None else scales[:total])
    got, want = experts(masked), experts(plain)
    assert got.shape == x.shape and torch.equal(got[:total], want) and bool(want.isfinite().all())


def test_fp8_greedy_tokens_match_dequantized_on_clear_margins(margin_ckpt):
    """Activation quantization moves the logits a little; where the top-2 gap is clear at every step,
    the FP8 runtime must pick the same tokens, with close logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
    prompts = _prompts(16)
    ref = _llm(margin_ckpt, quantization=None).generate(prompts, params)
    clear = [i for i, out in enumerate(ref) if min(_gaps(out)) >= MIN_MARGIN_NATS]
    assert len(clear) >= 8, f"the fixture should give clear margins on most prompts, got {len(clear)}"
    fp8 = _llm(margin_ckpt, quantization="fp8")
    assert fp8.engine.runner.fp8_weights
    got = fp8.generate([prompts[i] for i in clear], params)
    for i, out in zip(clear, got):
        assert out.token_ids == ref[i].token_ids, f"prompt {i}"
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref[i].logprobs)]
        assert max(diffs) < 0.5, diffs


def test_fp8_kv_cache_doubles_blocks_and_keeps_logprobs(margin_ckpt):
    mc = ModelConfig.from_hf(margin_ckpt)
    budget = plan_weight_bytes(mc, ParallelContext.single(torch.device("cpu")), fp8=False) + 2**20  # 1 MiB for KV
    base = LLM(margin_ckpt, quantization=None, memory_budget_bytes=budget)
    fp8 = LLM(margin_ckpt, quantization=None, memory_budget_bytes=budget, kv_cache_dtype="fp8")
    a, b = base.cache_info(), fp8.cache_info()
    assert a["kv_cache_dtype"] == "bfloat16" and b["kv_cache_dtype"] == "fp8_e4m3"
    assert a["bytes_per_token"] == mc.num_hidden_layers * mc.kv_cache_dim * 2 == 2 * b["bytes_per_token"]
    assert a["block_size"] == b["block_size"] == 16
    assert b["num_blocks"] in (2 * a["num_blocks"], 2 * a["num_blocks"] + 1)
    # Same tokens on clear margins; every chosen token's logprob within 0.25 nats of the bf16 cache's.
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    prompts = _prompts(8, seed=1)
    ref, got = base.generate(prompts, params), fp8.generate(prompts, params)
    compared = 0
    for r, g in zip(ref, got):
        if min(_gaps(r)) >= MIN_MARGIN_NATS:
            assert g.token_ids == r.token_ids
            compared += 1
        steps = next((i for i, (x, y) in enumerate(zip(r.token_ids, g.token_ids)) if x != y), len(r.token_ids))
        assert steps >= 1
        assert max(abs(x.logprob - y.logprob) for x, y in zip(r.logprobs[:steps], g.logprobs[:steps])) < 0.25
    assert compared >= 3


def test_bf16_checkpoint_is_quantized_at_load(make_ckpt):
    path = make_ckpt("tiny128", dtype="bfloat16")
    model = _llm(path, quantization="fp8").engine.runner.model
    w = CheckpointReader(path).get("model.layers.0.mlp.down_proj.weight")
    q = fp8_block_quantize(w)
    down = model.layers[0].mlp.down_proj
    assert torch.equal(down.weight.view(torch.uint8), q.weight.view(torch.uint8))
    assert torch.equal(down.weight_scale_inv, q.scale_inv)


def test_tensor_parallel_ranks_read_their_heads(make_ckpt):
    """TP 2: each rank's FP8 q_b/kv_b rows and o_proj columns (and their tile scales) are its heads'."""
    path = make_ckpt("tiny128", fp8=True, dtype="bfloat16",
                     overrides={"qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64})
    mc = ModelConfig.from_hf(path)
    assert fp8_runtime_problems(mc, tp=2) == []
    reader = CheckpointReader(path)
    placement = ExpertPlacement.build(mc.n_routed_experts, 2)
    for rank in range(2):
        ctx = ParallelContext(dp=1, tp=2, rank=rank, device=torch.device("cpu"))
        model = load_model(mc, str(path), torch.bfloat16, ctx.device, LocalDispatcher(8), placement, ctx, fp8=True)
        attn = model.layers[2].self_attn
        p = "model.layers.2.self_attn."
        rows = reader.get_raw(p + "q_b_proj.weight")[rank * 256 : (rank + 1) * 256]
        assert torch.equal(attn.q_b_proj.weight.view(torch.uint8), rows.view(torch.uint8))
        assert torch.equal(attn.kv_b_proj.weight_scale_inv,
                           reader.get_raw(p + "kv_b_proj.weight_scale_inv")[rank * 2 : rank * 2 + 2])
        cols = reader.get_raw(p + "o_proj.weight")[:, rank * 128 : (rank + 1) * 128]
        assert torch.equal(attn.o_proj.weight.view(torch.uint8), cols.contiguous().view(torch.uint8))
        o_scale = reader.get_raw(p + "o_proj.weight_scale_inv")[:, rank : rank + 1]
        assert torch.equal(attn.o_proj.weight_scale_inv, o_scale)
        assert model.lm_head.shape[0] == (mc.vocab_size if rank == 0 else 0)
        assert model_bytes(model) == plan_weight_bytes(mc, ctx, fp8=True)
        # Dequantized at load: tile rows straight into the parameter, column slices through a temporary.
        deq = load_model(mc, str(path), torch.bfloat16, ctx.device, LocalDispatcher(8), placement, ctx)
        deq = deq.layers[2].self_attn
        q_rows = reader.get(p + "q_b_proj.weight")[rank * 256 : (rank + 1) * 256]
        assert torch.equal(deq.q_b_proj.weight, q_rows.bfloat16())
        o_cols = reader.get(p + "o_proj.weight")[:, rank * 128 : (rank + 1) * 128]
        assert torch.equal(deq.o_proj.weight, o_cols.bfloat16())


def test_unsupported_fp8_layouts_are_named(tiny_fp8_ckpt, make_ckpt, tmp_path):
    with pytest.raises(ConfigError, match=r"moe_intermediate_size.*= 32 is not a multiple of 128.*quantization=None"):
        LLM(tiny_fp8_ckpt, quantization="fp8")
    llm = LLM(tiny_fp8_ckpt, num_blocks=32)  # auto on the CPU: dequantized
    assert not llm.engine.runner.fp8_weights
    with pytest.raises(ConfigError, match="unknown quantization 'int4'"):
        LLM(tiny_fp8_ckpt, quantization="int4")
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'fp4'"):
        LLM(tiny_fp8_ckpt, kv_cache_dtype="fp4")
    src = make_ckpt("tiny128", fp8=True, dtype="bfloat16")
    for change, message in (({"weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
                            ({"scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'")):
        path = tmp_path / message[:8].replace(" ", "_")
        shutil.copytree(src, path)
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"].update(change)
        (path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=message):
            LLM(path, quantization="fp8")
    mc = ModelConfig.from_hf(src)
    assert any("q rows per TP rank" in p for p in fp8_runtime_problems(mc, tp=2))
    assert fp8_runtime_problems(mc) == []


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_fp8_runtime_gives_the_same_tokens_across_layouts(make_ckpt, dp, tp):
    """FP8 weights and FP8 KV cache over expert-parallel ranks (each reading its own experts) and TP
    ranks (each reading its heads' rows and columns): the one-process tokens, close logprobs."""
    path = make_ckpt("tiny128", fp8=True, dtype="bfloat16", logit_margin=MARGIN,
                     overrides={"qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64})
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    prompts = _prompts(6, seed=2)
    ref = _llm(path, quantization="fp8", kv_cache_dtype="fp8").generate(prompts, params)
    with LLM(path, dp=dp, tp=tp, quantization="fp8", kv_cache_dtype="fp8", num_blocks=96, max_num_seqs=16) as llm:
        assert llm.cache_info()["kv_cache_dtype"] == "fp8_e4m3"
        got = llm.generate(prompts, params)
    clear = 0
    for r, g in zip(ref, got):
        if min(_gaps(r)) >= MIN_MARGIN_NATS:
            assert g.token_ids == r.token_ids
            assert max(abs(x.logprob - y.logprob) for x, y in zip(r.logprobs, g.logprobs)) < 0.1
            clear += 1
    assert clear >= 3


def test_cli_runs_fp8_and_names_what_it_cannot(fp8_ckpt, tiny_fp8_ckpt):
    def generate(path, *flags):
        return subprocess.run([sys.executable, "-m", "epserve.cli", "generate", str(path), "--prompt", "hi",
                               "--max-tokens", "4", "--num-blocks", "32", *flags],
                              capture_output=True, text=True, timeout=300)

    ok = generate(fp8_ckpt, "--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "tokens:" in ok.stdout
    assert "FP8 weights" in ok.stderr and "(fp8_e4m3)" in ok.stderr  # the load and KV cache log lines
    bad = generate(tiny_fp8_ckpt, "--quantization", "fp8")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "moe_intermediate_size (expert gate_proj fused with up_proj) = 32 is not a multiple of 128" in bad.stderr
