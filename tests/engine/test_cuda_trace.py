"""The CUDA decode forward is free of host syncs, for every dtype, proven on a machine without a GPU.

The model is built on the CPU, then every parameter, buffer and KV cache is replaced by a fake tensor
(``FakeTensorMode``) on the meta device, and the decode forward that CUDA graphs capture runs inside
``trace_as_cuda``: every kernel front end takes its CUDA branch (meta tensors stand for CUDA tensors of
the pinned compute capability; a CPU-only torch cannot index fake *CUDA* tensors, see
``kernels/device.py``). A host read (``.item()``, ``.tolist()``, a data-dependent shape) raises there,
and so does any tensor left on the CPU; the trace also records every op, so each case asserts which
CUDA kernels it reached (the custom ops standing for the Triton kernels, ``torch._grouped_mm``) and that
nothing was copied from the host to the device inside the forward.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from epserve import LLM
from epserve.engine.graphs import DecodeGraphs
from epserve.kernels.device import trace_as_cuda
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.experts import GroupedExperts

BATCH = 8


class OpLog(TorchDispatchMode):
    """The ops a trace ran, and every op that put host data on the (stand-in) device: a CPU tensor of one
    or more dimensions in, a device tensor out (in a captured graph, a copy from memory the graph does not
    own)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()
        self.host_to_device: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        self.ops.add(str(func.overloadpacket))
        out = func(*args, **kwargs)
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cpu" and t.dim() > 0 for t in ins) and any(t.device.type != "cpu" for t in outs):
            self.host_to_device.append(str(func))
        return out


def _to_fake_meta(obj: object, mode: FakeTensorMode, seen: set[int]) -> None:
    """Every tensor reachable from ``obj`` through module children, parameters, buffers and the plain
    attributes of epserve objects (dispatchers, placements, caches) replaced by a fake meta tensor."""
    if id(obj) in seen or not hasattr(obj, "__dict__"):
        return
    seen.add(id(obj))

    def fake(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return torch.nn.Parameter(out, requires_grad=False) if isinstance(t, torch.nn.Parameter) else out

    attrs = vars(obj)
    for key, value in list(attrs.items()):
        if isinstance(value, torch.Tensor):
            attrs[key] = fake(value)
        elif key in ("_parameters", "_buffers"):
            for name, t in list(value.items()):
                if t is not None:
                    value[name] = fake(t)
        elif key == "_modules":
            for child in value.values():
                _to_fake_meta(child, mode, seen)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if type(item).__module__.startswith("epserve"):
                    _to_fake_meta(item, mode, seen)
        elif type(value).__module__.startswith("epserve"):
            _to_fake_meta(value, mode, seen)


def trace_decode(llm: LLM, capability: tuple[int, int], mtp: bool = False) -> OpLog:
    """The decode forward of a full bucket (or the MTP layer's draft pass) traced as CUDA; the op log."""
    runner = llm.engine.runner
    mode = FakeTensorMode(allow_non_fake_inputs=False)  # a tensor left on the CPU raises too
    with mode:
        _to_fake_meta(runner.model, mode, set())
        caches = [torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device="meta") for c in runner.kv_caches]
    log = OpLog()
    with torch.inference_mode(), trace_as_cuda(capability), mode, log:
        graphs = DecodeGraphs(runner.model, caches, runner.block_size, BATCH, "cuda_graph", mtp=mtp)

        def ids(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device="meta")

        hidden = torch.zeros(BATCH, llm.config.model.hidden_size, dtype=runner.dtype, device="meta") if mtp else None
        out = graphs._forward(ids(BATCH), ids(BATCH), ids(BATCH), ids(BATCH), ids(BATCH, runner.max_blocks_per_seq),
                              "dispatch", hidden)
    assert out.device.type == "meta" and tuple(out.shape) == (BATCH, llm.config.model.hidden_size)
    return log


@pytest.fixture
def padded_group(request: pytest.FixtureRequest):
    """A one-rank gloo group: the real fixed-shape dispatcher and its collectives in the trace."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    request.addfinalizer(dist.destroy_process_group)
    return dist.group.WORLD


def _use_padded(llm: LLM, group: dist.ProcessGroup, fp8: bool) -> None:
    runner = llm.engine.runner
    padded = PaddedDispatcher(runner.placement.num_local_slots, group, fp8)
    padded.begin_step(BATCH)
    for layer in runner.model.layers:
        if layer.is_moe:
            layer.mlp.dispatcher = padded


def _engine(ckpt: Path, dtype: str, **kw) -> LLM:
    return LLM(ckpt, dtype=dtype, num_blocks=32, max_num_seqs=BATCH, **kw)


CASES = {
    # (dtype, checkpoint, capability, dispatch): the CUDA kernels the forward must reach
    "fp32-sm90": ("float32", "tiny", (9, 0), "local", {"epserve.grouped_swiglu"}),
    "bf16-sm90": ("bfloat16", "tiny", (9, 0), "local", {"aten._grouped_mm"}),
    "bf16-sm80": ("bfloat16", "tiny", (8, 0), "local", {"epserve.grouped_swiglu"}),
    "fp8-sm90": ("fp8", "tiny128", (9, 0), "local", {"epserve.fp8_block_gemm", "epserve.fp8_grouped_gemm"}),
    "bf16-padded": ("bfloat16", "tiny", (9, 0), "padded", {"aten._grouped_mm", "_c10d_functional.all_to_all_single"}),
    "fp8-padded-fp8-payload": ("fp8", "tiny128", (9, 0), "padded-fp8",
                               {"epserve.fp8_grouped_gemm", "_c10d_functional.all_to_all_single"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cuda_decode_forward_has_no_host_syncs(case, make_ckpt, request):
    dtype, preset, capability, dispatch, kernels = CASES[case]
    fp8 = dtype == "fp8"
    ckpt = make_ckpt(preset, fp8=fp8, dtype="bfloat16") if fp8 else make_ckpt(preset, dtype=dtype)
    llm = _engine(ckpt, "bfloat16" if fp8 else dtype, quantization="fp8" if fp8 else None)
    if dispatch.startswith("padded"):
        _use_padded(llm, request.getfixturevalue("padded_group"), fp8=dispatch == "padded-fp8")
    log = trace_decode(llm, capability)
    expected = kernels | {"epserve.paged_mla_decode", "epserve.grouped_topk"}
    assert expected <= log.ops, f"CUDA kernels not reached: {sorted(expected - log.ops)}"
    assert not log.host_to_device, log.host_to_device
    if fp8:
        assert {"epserve.fp8_act_quant", "epserve.fp8_silu_mul_quant"} & log.ops


def test_mtp_draft_pass_has_no_host_syncs(make_ckpt):
    llm = _engine(make_ckpt("tiny", dtype="bfloat16"), "bfloat16", speculative="mtp", num_speculative_tokens=1)
    log = trace_decode(llm, (9, 0), mtp=True)
    assert {"epserve.paged_mla_decode", "aten._grouped_mm"} <= log.ops and not log.host_to_device


def test_a_host_read_in_the_forward_fails_the_trace(make_ckpt, monkeypatch):
    """The proof can fail: a ``.tolist()`` of the expert counts (what the fp32 experts did on CUDA before
    they took device offsets) raises inside the trace."""
    llm = _engine(make_ckpt("tiny"), "float32")
    forward = GroupedExperts.forward

    def reads_counts(self, expert_input):  # noqa: ANN001
        expert_input.num_tokens_per_expert.tolist()
        return forward(self, expert_input)

    monkeypatch.setattr(GroupedExperts, "forward", reads_counts)
    with pytest.raises(DataDependentOutputException):
        trace_decode(llm, (9, 0))


def test_a_host_tensor_in_the_forward_is_found(make_ckpt, monkeypatch):
    """A tensor made from host values inside the forward (a non-capturable copy onto the device) is
    recorded."""
    llm = _engine(make_ckpt("tiny"), "float32")
    forward = GroupedExperts.forward

    def copies_in(self, expert_input):  # noqa: ANN001
        counts = expert_input.num_tokens_per_expert
        offsets = torch.tensor([0] * counts.shape[0]).to(counts.device)
        return forward(self, expert_input) + offsets.sum()

    monkeypatch.setattr(GroupedExperts, "forward", copies_in)
    assert trace_decode(llm, (9, 0)).host_to_device
