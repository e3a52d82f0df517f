"""An NVFP4 checkpoint's decode on the CPU graph (``engine/graphs.py``, ``kernels/cpu_graph.py``): with the NVFP4
C kernels (``kernels.cpu_nvfp4``) every op of the four-bit forward is a C kernel call, so each decode bucket is
recorded and replayed, giving the eager engine's tokens and transformers' on the dequantized checkpoint (fp32)."""

from __future__ import annotations

import logging

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.kernels import cpu
from epserve.kernels.cpu_graph import CpuGraph
from tests.model.test_nvfp4_runtime import dequantized_copy
from tests.oracle import hf_greedy

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(
    not all(cpu.available(kind) for kind in (cpu.OPS, cpu.NVFP4, torch.float32)),
    reason="the CPU graph records the C kernels: AVX-512F, AVX2, a compiler")

PROMPTS = [[5, 17, 99, 3], list(range(10, 40)), [7]]
TOKENS = 8


def test_nvfp4_decode_is_recorded_and_replays_the_eager_and_transformers_tokens(make_ckpt, tmp_path, monkeypatch,
                                                                                 caplog):
    path = make_ckpt("tiny", dtype="float32", quantization="nvfp4")
    replays = [0]
    replay = CpuGraph.replay

    def counted(self, seconds=None):  # noqa: ANN001, ANN202
        replays[0] += 1
        return replay(self, seconds)

    monkeypatch.setattr(CpuGraph, "replay", counted)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_blocks=64, device="cpu")
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.mode == "cpu_graph"
    with caplog.at_level(logging.INFO, logger="epserve.engine.graphs"):
        out = llm.generate(PROMPTS, params)
    assert not graphs._eager, caplog.text  # no bucket fell back: a CaptureError would say which op
    assert graphs._cpu_graphs and replays[0] >= TOKENS - 2  # recorded once per bucket, then replayed
    names = {call.name for graph, _ in graphs._cpu_graphs.values() for call in graph.calls}
    assert {"epserve_nvfp4_linear", "epserve_nvfp4_moe_swiglu"} <= names
    eager = LLM(path, dtype="float32", num_blocks=64, device="cpu", cuda_graph=False)
    assert eager.engine.runner.decode_graphs is None
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(dequantized_copy(path, tmp_path / "oracle")),
                                                            dtype=torch.float32).eval()
    for prompt, a, b in zip(PROMPTS, eager.generate(PROMPTS, params), out):
        assert a.token_ids == b.token_ids == hf_greedy(hf, prompt, TOKENS), f"prompt of {len(prompt)} tokens"
