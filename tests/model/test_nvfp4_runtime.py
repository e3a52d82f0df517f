"""NVFP4 checkpoints run as four-bit weights (``kernels/nvfp4.py``; the loader keeps ModelOpt's uint8 weights and
their scales): the ops' chunked reference against dequantize-then-matmul, its bounded extra memory, and the
engine's greedy tokens on an NVFP4 tiny checkpoint against transformers on the dequantized checkpoint, in fp32."""

from __future__ import annotations

import dataclasses
import json
import shutil
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from epserve import LLM, SamplingParams
from epserve.checkpoint import CheckpointReader, save_checkpoint
from epserve.checkpoint.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from epserve.config import ConfigError, ModelConfig
from epserve.kernels import ops
from epserve.kernels.grouped import grouped_swiglu_ref
from epserve.kernels.nvfp4 import CHUNK_ROWS, dequantize_rows, nvfp4_linear_ref
from epserve.model.quantization import resolve_fp8_weights
from epserve.moe.experts import GroupedExperts
from tests.oracle import hf_greedy

transformers = pytest.importorskip("transformers")


def _quantized(*weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weights`` quantized one by one and fused along the rows as our layers hold them: (packed, block scales,
    one global scale per part, the dequantized fused weight)."""
    qs = [nvfp4_quantize(w) for w in weights]
    dense = torch.cat([nvfp4_dequantize(*q) for q in qs])
    return (torch.cat([q.weight for q in qs]), torch.cat([q.weight_scale for q in qs]),
            torch.stack([q.weight_scale_2 for q in qs]), dense)


def test_linear_equals_dequantize_then_matmul():
    torch.manual_seed(0)
    weight, scale, scale_2, dense = _quantized(torch.randn(300, 96), 5 * torch.randn(300, 96))
    assert weight.dtype == torch.uint8 and tuple(weight.shape) == (600, 48) and tuple(scale_2.shape) == (2,)
    assert torch.equal(dequantize_rows(weight, scale, scale_2), dense)  # bit for bit, both parts' scales
    assert torch.equal(dequantize_rows(weight, scale, scale_2, (250, 350)), dense[250:350])
    x = torch.randn(3, 5, 96)
    out = ops.nvfp4_linear(x, weight, scale, scale_2)
    assert out.shape == (3, 5, 600) and out.dtype == torch.float32
    # the CPU runs the C kernel (kernels.cpu_nvfp4): its own summation order, on sums of |x w| up to ~400
    torch.testing.assert_close(out, F.linear(x, dense), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(nvfp4_linear_ref(x, weight, scale, scale_2, chunk_rows=7), F.linear(x, dense),
                               rtol=1e-5, atol=1e-5)
    bf16 = ops.nvfp4_linear(x.bfloat16(), weight, scale, scale_2)  # W4A16: the activations stay bf16
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), F.linear(x.bfloat16().float(), dense), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="global scales"):
        ops.nvfp4_linear(x, weight, scale, torch.ones(7))


def test_experts_equal_dequantized_grouped_swiglu():
    torch.manual_seed(1)
    e, h, inter = 3, 64, 32
    w13 = [_quantized(torch.randn(inter, h), 2 * torch.randn(inter, h)) for _ in range(e)]
    w2 = [_quantized(torch.randn(h, inter)) for _ in range(e)]
    stack = [torch.stack([q[i] for q in w13]) for i in range(4)]
    stack2 = [torch.stack([q[i] for q in w2]) for i in range(4)]
    x = torch.randn(7, h)
    counts = torch.tensor([2, 0, 4])  # and one padding row
    out = ops.nvfp4_moe_swiglu(x, counts, *stack[:3], *stack2[:3])
    ref = grouped_swiglu_ref(x, counts, stack[3], stack2[3])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())  # summation order (C)
    assert torch.equal(out[6], torch.zeros(h))
    experts = GroupedExperts(e, h, inter, nvfp4=True)  # the module holds the format as stored and calls the op
    assert experts.w13.dtype == torch.uint8 and tuple(experts.w13_scale_2.shape) == (e, 2)
    for name, t in zip(("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2"), [*stack[:3], *stack2[:3]]):
        getattr(experts, name).data = t
    from epserve.moe.dispatch.base import ExpertInput

    got = experts(ExpertInput(hidden_states=x, num_tokens_per_expert=counts))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


class _PeakBytes(TorchDispatchMode):
    """The most bytes that tensors made inside the block held at once (views not counted again)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t._base is None and not t.is_meta:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                weakref.finalize(t, self._freed, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def test_reference_never_expands_the_whole_weight():
    torch.manual_seed(2)
    n, k = 32 * CHUNK_ROWS, 256
    weight, scale, scale_2, _ = _quantized(torch.randn(n, k))
    chunk, expanded = CHUNK_ROWS * k * 4, n * k * 4  # one chunk and the whole weight in fp32 (8 MiB)
    x = torch.randn(2, k)
    with _PeakBytes() as bytes_:
        out = ops.nvfp4_linear(x, weight, scale, scale_2)
    assert out.shape == (2, n)
    # a chunk's temporaries (codes, indices, values, scales) and the output, whatever the weight's rows
    assert 0 < bytes_.peak < 8 * chunk <= expanded / 4, f"peak {bytes_.peak} bytes, one fp32 chunk {chunk}"


def test_fake_implementations_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 64)
        y = torch.ops.epserve.nvfp4_linear(x, torch.empty(96, 32, dtype=torch.uint8),
                                           torch.empty(96, 4, dtype=torch.float8_e4m3fn), torch.empty(2))
        z = torch.ops.epserve.nvfp4_moe_swiglu(
            x, torch.empty(3, dtype=torch.int64), torch.empty(3, 64, 32, dtype=torch.uint8),
            torch.empty(3, 64, 4, dtype=torch.float8_e4m3fn), torch.empty(3, 2),
            torch.empty(3, 64, 16, dtype=torch.uint8), torch.empty(3, 64, 2, dtype=torch.float8_e4m3fn),
            torch.empty(3, 1))
    assert tuple(y.shape) == (4, 96) and tuple(z.shape) == (4, 64)


# ---- the engine on an NVFP4 checkpoint --------------------------------------------------------------------


def dequantized_copy(path: Path, out: Path) -> Path:
    """The oracle's checkpoint: every NVFP4 linear of ``path`` dequantized to fp32 (``nvfp4_dequantize``), its
    scales dropped, the config without its quantization."""
    reader = CheckpointReader(path)
    tensors = {}
    for name in reader.raw_keys():
        module, _, part = name.rpartition(".")
        if part == "weight" and reader.has(f"{module}.weight_scale_2"):
            tensors[name] = nvfp4_dequantize(reader.get_raw(name), reader.get_raw(f"{module}.weight_scale"),
                                             reader.get_raw(f"{module}.weight_scale_2"), torch.float32)
        elif part not in ("weight_scale", "weight_scale_2", "input_scale"):
            tensors[name] = reader.get_raw(name)
    reader.close()
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    save_checkpoint(out, config, tensors)
    return _with_tokenizer(path, out)


def _with_tokenizer(path: Path, out: Path) -> Path:
    for f in path.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


PROMPTS = [[5, 17, 99, 3], list(range(10, 60)), [7], [300, 200, 100, 50, 25, 12, 6, 3, 2], [42] * 20]


@pytest.fixture(scope="module")
def nvfp4_tiny(make_ckpt, tmp_path_factory):
    path = make_ckpt("tiny", dtype="float32", quantization="nvfp4")
    oracle = dequantized_copy(path, tmp_path_factory.mktemp("nvfp4-oracle"))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    return path, hf


def test_greedy_tokens_equal_transformers_on_the_dequantized_checkpoint(nvfp4_tiny):
    path, hf = nvfp4_tiny
    config = ModelConfig.from_hf(path)
    assert config.is_nvfp4
    llm = LLM(path, dtype="float32", num_blocks=256, device="cpu")
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.w13.dtype == torch.uint8 and m.w2.dtype == torch.uint8 for m in experts)
    uint8 = {n for n, p in model.named_parameters() if p.dtype == torch.uint8}
    assert any(".shared_experts." in n for n in uint8) and not any("self_attn" in n for n in uint8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ref = hf_greedy(hf, prompt, 24)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"


def test_nvfp4_checkpoint_refuses_other_quantizations(nvfp4_tiny):
    config = ModelConfig.from_hf(nvfp4_tiny[0])
    assert resolve_fp8_weights("auto", config, 1, "cpu") is False
    for asked in ("fp8", None):
        with pytest.raises(ConfigError, match="NVFP4"):
            resolve_fp8_weights(asked, config, 1, "cpu")


def _altered_copy(path: Path, out: Path, drop: str | None = None, reshape: str | None = None,
                  cast: str | None = None) -> Path:
    """``path`` with tensor ``drop`` left out, tensor ``reshape`` cut to half its rows, or ``cast`` stored fp32."""
    with CheckpointReader(path) as reader:
        tensors = {n: reader.get_raw(n) for n in reader.raw_keys() if n != drop}
    if reshape is not None:
        tensors[reshape] = tensors[reshape][: tensors[reshape].shape[0] // 2].clone()
    if cast is not None:
        tensors[cast] = tensors[cast].float()
    save_checkpoint(out, json.loads((path / "config.json").read_text()), tensors)
    return _with_tokenizer(path, out)


def test_a_missing_scale_or_a_wrong_shape_is_refused_by_name(nvfp4_tiny, tmp_path):
    from epserve.checkpoint import CheckpointError

    path = nvfp4_tiny[0]
    with CheckpointReader(path) as reader:
        scale = next(n for n in reader.raw_keys() if ".experts." in n and n.endswith(".weight_scale"))
        scalar = next(n for n in reader.raw_keys() if ".shared_experts." in n and n.endswith(".weight_scale_2"))
    for i, (drop, reshape, cast) in enumerate([(scale, None, None), (scalar, None, None), (None, scale, None),
                                               (None, None, scale)]):
        bad = _altered_copy(path, tmp_path / str(i), drop, reshape, cast)
        with pytest.raises(CheckpointError, match=(drop or reshape or cast).replace(".", r"\.")):
            LLM(bad, dtype="float32", num_blocks=16, device="cpu")


def test_cuda_decode_trace_reaches_the_nvfp4_ops(nvfp4_tiny):
    """The decode forward CUDA graphs capture, traced as CUDA on a machine without a GPU
    (``tests/engine/test_cuda_trace.py``): the NVFP4 ops appear as their custom ops, with no host sync in the
    trace; on CUDA the Triton kernels read the experts' counts on the device, so its decode is captured."""

    from tests.engine.test_cuda_trace import BATCH, trace_decode

    llm = LLM(nvfp4_tiny[0], dtype="bfloat16", num_blocks=32, max_num_seqs=BATCH)
    log = trace_decode(llm, (9, 0))
    assert {"epserve.nvfp4_linear", "epserve.nvfp4_moe_swiglu"} <= log.ops and not log.host_to_device
    assert llm.config.model.is_nvfp4 and dataclasses.replace(llm.config, device="cuda").capture_mode == "cuda_graph"


def test_modelopt_export_runs_equal_to_transformers(tmp_path):
    """ModelOpt's own export of a tiny DeepSeek-V3 (``modelopt_nvfp4_tiny/``, made by NVIDIA's Model Optimizer on
    the CPU): loaded as four-bit weights, greedy tokens equal transformers' on its dequantized copy."""
    from epserve.presets import write_tokenizer_files

    export = tmp_path / "export"
    shutil.copytree(Path(__file__).parent / "modelopt_nvfp4_tiny", export)
    config = json.loads((export / "config.json").read_text())
    # (a byte-level tokenizer needs 260 ids; the prompts are token ids below the model's 256)
    write_tokenizer_files(export, vocab_size=300, model_max_length=config["max_position_embeddings"])
    oracle = dequantized_copy(export, tmp_path / "oracle")
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(oracle), dtype=torch.float32).eval()
    llm = LLM(export, dtype="float32", num_blocks=64, device="cpu")
    assert any(p.dtype == torch.uint8 for p in llm.engine.runner.model.parameters())
    prompts = [[5, 17, 99, 3], list(range(10, 40)), [200] * 9]
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                                          ignore_eos=True))):
        ref = hf_greedy(hf, prompt, 16)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"


def test_expert_parallel_ranks_read_their_experts_as_stored(nvfp4_tiny):
    """EP 2 (two DP ranks): each rank's stacked experts are its own experts' packed weights, block scales and
    (gate's, up's) global scales as stored; the bytes held are the plan's."""
    from epserve.model.load_plan import model_bytes, plan_weight_bytes
    from epserve.model.loader import load_model
    from epserve.moe.dispatch.local import LocalDispatcher
    from epserve.moe.placement import ExpertPlacement
    from epserve.parallel.context import ParallelContext

    path = nvfp4_tiny[0]
    mc = ModelConfig.from_hf(path)
    placement = ExpertPlacement.build(mc.n_routed_experts, 2)
    layer = next(i for i in range(mc.num_hidden_layers) if mc.is_moe_layer(i))
    with CheckpointReader(path) as reader:
        for rank in range(2):
            ctx = ParallelContext(dp=2, tp=1, rank=rank, device=torch.device("cpu"))
            model = load_model(mc, str(path), torch.float32, ctx.device,
                               LocalDispatcher(placement.num_local_slots), placement, ctx)
            experts = model.layers[layer].mlp.experts
            for j, e in enumerate(placement.local_logical_experts(rank)):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                gate, up, down = (reader.get_raw(f"{p}{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
                assert torch.equal(experts.w13[j], torch.cat([gate, up])) and torch.equal(experts.w2[j], down)
                assert torch.equal(experts.w13_scale[j].view(torch.uint8), torch.cat(
                    [reader.get_raw(f"{p}{m}.weight_scale") for m in ("gate_proj", "up_proj")]).view(torch.uint8))
                assert torch.equal(experts.w13_scale_2[j], torch.stack(
                    [reader.get_raw(f"{p}{m}.weight_scale_2") for m in ("gate_proj", "up_proj")]))
                assert torch.equal(experts.w2_input_scale[j, 0], reader.get_raw(f"{p}down_proj.input_scale"))
            assert model_bytes(model) == plan_weight_bytes(mc, ctx, fp8=False, dtype=torch.float32)


def test_mtp_speculative_greedy_equals_transformers(nvfp4_tiny):
    """With MTP drafting (the MTP layer's experts as the checkpoint stores them): the oracle's tokens."""
    path, hf = nvfp4_tiny
    llm = LLM(path, dtype="float32", num_blocks=256, device="cpu", speculative="mtp", num_speculative_tokens=2)
    assert llm.engine.runner.model.mtp[0].mlp.experts.w13.dtype == torch.uint8
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:3], llm.generate(PROMPTS[:3], params)):
        ref = hf_greedy(hf, prompt, 12)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"
    assert llm.speculative_stats()["num_draft_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_layouts_give_the_oracle_tokens(nvfp4_tiny, dp, tp):
    """Expert-parallel ranks (each reading its own NVFP4 experts) and TP ranks: transformers' tokens on the
    dequantized checkpoint."""
    path, hf = nvfp4_tiny
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype="float32", dp=dp, tp=tp, num_blocks=96, max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, prompt, 12)
        assert out.token_ids == ref, f"prompt of {len(prompt)} tokens"


@pytest.mark.slow
def test_eplb_replicas_and_a_rebalance_keep_the_oracle_tokens(nvfp4_tiny):
    """EPLB over NVFP4 experts: redundant slots hold replicas of the packed weights, scales and global scales as
    stored, and a rebalance moves all of them (every stacked expert tensor, as bytes) — transformers' tokens
    before and after."""
    path, hf = nvfp4_tiny
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    refs = [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    with LLM(path, dtype="float32", dp=2, num_redundant_experts=2, dispatch="padded", num_blocks=96,
             max_num_seqs=8, enable_prefix_caching=False) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == refs
        report = llm.rebalance_experts()
        assert report.experts_moved > 0 and report.bytes_moved > 0
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == refs
