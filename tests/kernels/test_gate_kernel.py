"""The fused DeepSeek gate (``kernels.gate``, ``kernels.gate_triton``).

The torch reference is checked against ``moe.gate.ExpertGate`` itself; the Triton kernel against
the reference under Triton's interpreter (in a subprocess with ``TRITON_INTERPRET=1``, so no other
test sees interpreted kernels), for DeepSeek-V3's shape and the tiny ones; with CUDA, the front end
on the GPU against the reference on the CPU, and under CUDA-graph capture. Ids are compared as sets
per row, weights matched by id; random continuous logits keep ties away. Running this file as a
script runs the interpreter cases and prints their results as JSON.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton_harness

from epserve.config import ModelConfig
from epserve.kernels import cpu
from epserve.kernels import gate as gate_kernel
from epserve.moe.gate import ExpertGate
from epserve.presets import build_config

_TRITON_BEFORE_MAIN = "triton" in sys.modules  # after importing kernels.gate (the script's check)
HAS_TRITON = importlib.util.find_spec("triton") is not None
cuda = pytest.mark.cuda  # needs a CUDA device: skipped without one (tests/conftest.py), run by gpu_check.sh

# ExpertGate configs on the tiny preset (E=16, n_group=4, topk_group=2, top_k=4, V3 gate)
ROUTER_OVERRIDES: dict[str, dict[str, Any]] = {
    "v3": {},
    "v3_one_group": {"n_group": 1, "topk_group": 1},
    "v2": {"scoring_func": "softmax", "topk_method": "group_limited_greedy", "norm_topk_prob": False,
           "routed_scaling_factor": 16.0},
    "greedy": {"scoring_func": "softmax", "topk_method": "greedy", "routed_scaling_factor": 1.0},
    "greedy_sigmoid_unnormalized": {"topk_method": "greedy", "norm_topk_prob": False},
}
V3 = {"top_k": 8, "n_group": 8, "topk_group": 4, "method": "noaux_tc", "scoring": "sigmoid",
      "norm_topk_prob": True, "routed_scaling_factor": 2.5}  # DeepSeek-V3, E = 256
# Shapes off the powers of two: padded groups, padded experts per group, one ungrouped odd row
ODD_SHAPES: list[tuple[int, dict[str, Any]]] = [
    (24, {**V3, "top_k": 5, "n_group": 3, "topk_group": 2}),
    (20, {**V3, "top_k": 3, "n_group": 4, "topk_group": 2, "norm_topk_prob": False}),
    (12, {**V3, "top_k": 4, "n_group": 6, "topk_group": 3, "method": "group_limited_greedy",
          "scoring": "softmax"}),
    (10, {**V3, "top_k": 3, "n_group": 1, "method": "greedy", "scoring": "softmax"}),
]
TOKENS = (0, 1, 7, 64)


# ---- data and comparisons (also used by the interpreter subprocess) -----------------------------


def make_gate(name: str, seed: int = 0) -> ExpertGate:
    cfg = ModelConfig.from_dict(build_config("tiny", overrides=ROUTER_OVERRIDES[name]))
    gate = ExpertGate(cfg)
    g = torch.Generator().manual_seed(seed)
    gate.weight.data = torch.randn(gate.weight.shape, generator=g) / cfg.hidden_size**0.5
    if gate.e_score_correction_bias is not None:
        gate.e_score_correction_bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    return gate


def gate_kwargs(gate: ExpertGate) -> dict[str, Any]:
    return {"top_k": gate.top_k, "n_group": gate.n_group, "topk_group": gate.topk_group,
            "method": gate.topk_method, "scoring": gate.scoring_func, "norm_topk_prob": gate.norm_topk_prob,
            "routed_scaling_factor": gate.routed_scaling_factor, "bias": gate.e_score_correction_bias}


def make_logits(t: int, e: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2


def make_bias_and_table(e: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A correction bias of V3's magnitude and a logical -> physical table with room for redundants."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, generator=g) * 0.1, torch.randperm(e + e // 4, generator=g)[:e]


def assert_same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                        rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """The same set of ids per row, each with the same weight; ids int64, weights fp32."""
    (ids, w), (ids_ref, w_ref) = got, want
    assert ids.dtype == torch.int64 and w.dtype == torch.float32, (ids.dtype, w.dtype)
    assert ids.shape == ids_ref.shape and w.shape == ids.shape, (ids.shape, ids_ref.shape, w.shape)
    ids, order = ids.cpu().sort(dim=1)
    ids_ref, order_ref = ids_ref.cpu().sort(dim=1)
    assert torch.equal(ids, ids_ref), (ids != ids_ref).any(dim=1).nonzero().flatten()[:8]
    w, w_ref = w.cpu().gather(1, order), w_ref.cpu().gather(1, order_ref)
    torch.testing.assert_close(w, w_ref, rtol=rtol, atol=atol)


# ---- the reference against ExpertGate ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ROUTER_OVERRIDES))
def test_reference_matches_expert_gate(name, monkeypatch):
    gate = make_gate(name)
    for t in (0, 1, 5, 33):
        x = torch.randn(t, gate.weight.shape[1], generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            fused = gate(x)  # the CPU's C kernels (gate GEMM and fused top-k) where they load
        with monkeypatch.context() as m:  # torch only: the reference's ops, bit for bit
            m.setattr(cpu, "_available", {cpu.OPS: False, torch.float32: False})
            want = gate(x)
        got = gate_kernel.grouped_topk_ref(F.linear(x.float(), gate.weight), **gate_kwargs(gate))
        assert_same_routing(got, (want.topk_ids, want.topk_weights), rtol=0, atol=0)
        assert_same_routing((fused.topk_ids, fused.topk_weights), (want.topk_ids, want.topk_weights))
        assert gate_kernel.grouped_topk(F.linear(x.float(), gate.weight), **gate_kwargs(gate))[0].shape == (t, 4)


def test_reference_maps_to_physical_slots():
    logits, (bias, table) = make_logits(9, 256), make_bias_and_table(256)
    ids, w = gate_kernel.grouped_topk_ref(logits, **V3, bias=bias)
    phys, w_phys = gate_kernel.grouped_topk_ref(logits, **V3, bias=bias, logical_to_physical=table)
    assert torch.equal(phys, table[ids]) and torch.equal(w_phys, w)
    assert torch.allclose(w.sum(dim=1), torch.full((9,), 2.5))


def argument_errors(fn) -> None:
    """Bad arguments raise ValueError naming them (``fn``: the reference or the Triton wrapper)."""
    x, (bias, table) = make_logits(3, 16), make_bias_and_table(16)
    kw = {**V3, "top_k": 4, "n_group": 4, "topk_group": 2}
    cases = [
        ({"logits": x[0]}, r"\[T, E\], got torch.float32 \(16,\)"),
        ({"n_group": 5}, "n_group=5"),
        ({"top_k": 17}, r"top_k=17 must be in \[1, 16\]"),
        ({"top_k": 9}, "exceeds the 8 experts of 2 groups"),
        ({"topk_group": 5}, "topk_group=5"),
        ({"n_group": 16, "topk_group": 4}, "top-2"),
        ({"method": "aux"}, "method must be one of"),
        ({"scoring": "tanh"}, "scoring must be one of"),
        ({"bias": bias[:8]}, r"bias must be \[16\]"),
        ({"bias": bias, "method": "greedy"}, "only used by noaux_tc"),
        ({"logical_to_physical": table.float()}, "integer"),
    ]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(**{"logits": x, **kw, **change})


def test_argument_errors():
    argument_errors(gate_kernel.grouped_topk_ref)


# ---- Triton under the interpreter ---------------------------------------------------------------


def _case_gate_import_is_triton_free(rt) -> None:
    """Importing ``kernels.gate`` (done by this module, before ``_interpreter_main``) left triton out."""
    assert not _TRITON_BEFORE_MAIN, "importing epserve.kernels.gate imported triton"


def _case_interpreted(rt) -> None:
    assert type(rt._grouped_topk_kernel).__name__ == "InterpretedFunction", type(rt._grouped_topk_kernel)


def _case_v3_shape(rt) -> None:
    """E=256, 8 groups, 4 kept, top-8, sigmoid + bias, physical ids; logical ids best first; strided
    and bf16 logits, the last of 3 blocks partial."""
    bias, table = make_bias_and_table(256)
    logical = torch.full((int(table.max()) + 1,), -1).scatter_(0, table, torch.arange(256))
    for t in TOKENS:
        logits = make_logits(t, 256, seed=t)
        ids, w = rt.grouped_topk_triton(logits, **V3, bias=bias, logical_to_physical=table)
        want = gate_kernel.grouped_topk_ref(logits, **V3, bias=bias, logical_to_physical=table)
        assert_same_routing((ids, w), want)
        chosen = (logits.sigmoid() + bias).gather(1, logical[ids])
        assert bool((chosen[:, :-1] >= chosen[:, 1:]).all()), "ids not best first"
    wide = make_logits(33, 512, seed=5)
    for logits, bt in ((wide[:, ::2], 16), (wide[:, 1::2].bfloat16(), None)):
        assert_same_routing(rt.grouped_topk_triton(logits, **V3, bias=bias, tokens_per_program=bt),
                            gate_kernel.grouped_topk_ref(logits, **V3, bias=bias))


def _case_tiny_shapes(rt) -> None:
    """The ExpertGate configs at E=16, and the odd shapes with a table."""
    for name in ROUTER_OVERRIDES:
        kw = gate_kwargs(make_gate(name))
        for t in TOKENS:
            logits = make_logits(t, 16, seed=t)
            assert_same_routing(rt.grouped_topk_triton(logits, **kw), gate_kernel.grouped_topk_ref(logits, **kw))
    for e, kw in ODD_SHAPES:
        bias, table = make_bias_and_table(e)
        kw = {**kw, "bias": bias if kw["method"] == "noaux_tc" else None, "logical_to_physical": table}
        logits = make_logits(37, e, seed=e)
        assert_same_routing(rt.grouped_topk_triton(logits, **kw), gate_kernel.grouped_topk_ref(logits, **kw))


def _case_one_token_per_program(rt) -> None:
    """The GPU's block size (one token per program), which the interpreter otherwise does not run."""
    bias, table = make_bias_and_table(256)
    logits = make_logits(2, 256, seed=2)
    got = rt.grouped_topk_triton(logits, **V3, bias=bias, logical_to_physical=table, tokens_per_program=1)
    assert_same_routing(got, gate_kernel.grouped_topk_ref(logits, **V3, bias=bias, logical_to_physical=table))
    kw = gate_kwargs(make_gate("v2"))
    logits = make_logits(2, 16)
    assert_same_routing(rt.grouped_topk_triton(logits, **kw, tokens_per_program=1),
                        gate_kernel.grouped_topk_ref(logits, **kw))
    with pytest.raises(ValueError, match="power of two"):
        rt.grouped_topk_triton(logits, **kw, tokens_per_program=3)


def _case_argument_errors(rt) -> None:
    argument_errors(rt.grouped_topk_triton)


INTERP_CASES = {
    "gate_import_is_triton_free": _case_gate_import_is_triton_free,
    "interpreted": _case_interpreted,
    "v3_shape": _case_v3_shape,
    "tiny_shapes": _case_tiny_shapes,
    "one_token_per_program": _case_one_token_per_program,
    "argument_errors": _case_argument_errors,
}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


def test_triton_kernel_compiles_for_sm90():
    """DeepSeek-V3's specialization lowers to Hopper code without spilling (Triton's own ptxas), with
    one token per program as on the GPU: no shared memory, every reduction in the warp."""
    if torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("no triton, or a GPU is here (the CUDA tests run the kernel)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from epserve.kernels import gate_triton as rt

    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "map_ptr": "*i64", "ids_ptr": "*i64", "w_ptr": "*fp32",
           "T": "i32", "stride_lt": "i32", "stride_le": "i32", "scale": "fp32"}
    const = {"G": 8, "GS": 32, "GP": 8, "GSP": 32, "BT": 1, "TOP_K": 8, "KP": 8, "TOPK_GROUP": 4,
             "SOFTMAX": False, "GROUPED": True, "TOP2": True, "HAS_BIAS": True, "HAS_MAP": True, "NORM": True}
    src = ASTSource(rt._grouped_topk_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const)
    options = {"num_warps": 1, "enable_fp_fusion": False}  # as the wrapper launches it for E = 256
    kernel = compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared == 0 and "st.global.b64" in kernel.asm["ptx"]


# ---- CUDA: the front end on the GPU against the reference on the CPU -----------------------------


@cuda
def test_cuda_matches_reference():
    bias, table = make_bias_and_table(256)
    for t in (0, 1, 7, 64, 1000):
        logits = make_logits(t, 256, seed=t)
        got = gate_kernel.grouped_topk(logits.cuda(), **V3, bias=bias.cuda(), logical_to_physical=table.cuda())
        assert got[0].is_cuda
        assert_same_routing(got, gate_kernel.grouped_topk_ref(logits, **V3, bias=bias, logical_to_physical=table))
    for name in ROUTER_OVERRIDES:
        kw = gate_kwargs(make_gate(name))
        logits = make_logits(64, 16)
        gpu_kw = {**kw, "bias": kw["bias"].cuda() if kw["bias"] is not None else None}
        want = gate_kernel.grouped_topk_ref(logits, **kw)
        assert_same_routing(gate_kernel.grouped_topk(logits.cuda(), **gpu_kw), want)


@cuda
def test_cuda_graph_captures_the_gate():
    """No host sync: capture once, then replay with new logits (and a new table) in place."""
    bias, table = (t.cuda() for t in make_bias_and_table(256))
    logits = make_logits(64, 256).cuda()
    gate_kernel.grouped_topk(logits, **V3, bias=bias, logical_to_physical=table)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, w = gate_kernel.grouped_topk(logits, **V3, bias=bias, logical_to_physical=table)
    for seed in (1, 2):
        logits.copy_(make_logits(64, 256, seed=seed))
        table.copy_(table.roll(seed))
        graph.replay()
        want = gate_kernel.grouped_topk_ref(logits.cpu(), **V3, bias=bias.cpu(), logical_to_physical=table.cpu())
        assert_same_routing((ids, w), want)


def _interpreter_main() -> None:
    from epserve.kernels import gate_triton

    triton_harness.report_cases(INTERP_CASES, gate_triton)


if __name__ == "__main__":
    _interpreter_main()
