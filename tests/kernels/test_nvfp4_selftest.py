"""The ``nvfp4_w4a16`` op (``kernels.nvfp4_w4a16``): NVFP4's W4A16 ops on CUDA run the Triton kernels only after
their start-up self-test against the torch references passed, else the references, said in one log line; an
engine whose W4A16 ops run the reference decodes eagerly (``engine.runner.capture_mode``: the reference reads the
experts' counts on the host, which a CUDA graph cannot hold).

Under Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``, ``tests/triton_harness.py``), on CPU tensors:
the self-test passes in fp32, fp16 and bf16; kernels broken on purpose (the nibbles swapped, the gate's and up's
global scales swapped, a launch that raises) make the op fall back to the reference, logged, and the runner's
capture mode drop to eager; the ops' CUDA implementations, listed on the CPU for the test, run the kernels or
the reference as decided. Without the interpreter the kernels cannot run on the CPU: the op falls back there
too. With a GPU (``-m cuda``, the GPU check's kernels stage) the self-test chooses the kernels on the device, a
broken kernel hands the ops to the reference, and an engine on it then decodes eagerly, its tokens unchanged.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
import triton_harness

from epserve.kernels import backends, nvfp4, nvfp4_w4a16
from epserve.kernels.opdef import record_calls

cuda = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py), selected by the GPU check
OP = nvfp4_w4a16.OP
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BF16 = torch.bfloat16
KERNELS = {"nvfp4_linear": "epserve.kernels.nvfp4_triton:nvfp4_linear_triton",
           "nvfp4_moe_swiglu": "epserve.kernels.nvfp4_triton:nvfp4_moe_swiglu_triton"}
TORCH = {"nvfp4_linear": "epserve.kernels.nvfp4_w4a16:linear_torch",
         "nvfp4_moe_swiglu": "epserve.kernels.nvfp4_w4a16:moe_swiglu_torch"}


# ---- kernels broken on purpose: real bugs, each a wrapper around the real kernel ------------------------------


def nibbles_swapped(real):  # noqa: ANN001, ANN201
    """The linear reads the odd column from the low nibble."""
    return lambda x, w, *rest: real(x, (w << 4) | (w >> 4), *rest)


def part_scales_swapped(real):  # noqa: ANN001, ANN201
    """The experts scale the gate rows by the up rows' global scale and the other way round."""
    return lambda x, counts, w13, s13, g13, *rest, **kw: real(x, counts, w13, s13, g13.flip(-1), *rest, **kw)


def launch_fails(real):  # noqa: ANN001, ANN201
    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no kernel image is available for execution on the device")

    return run


BUGS = {"nibbles_swapped": ("nvfp4_linear_triton", nibbles_swapped, "KernelMismatch: linear M,N,K=1,80,96"),
        "part_scales_swapped": ("nvfp4_moe_swiglu_triton", part_scales_swapped, "KernelMismatch: experts, counts"),
        "launch_fails": ("nvfp4_moe_swiglu_triton", launch_fails, "RuntimeError: no kernel image")}


def unavailable_line(device: str, dtype: torch.dtype, error: str) -> re.Pattern[str]:
    where = f"{device}, {str(dtype).removeprefix('torch.')}"
    return re.compile(rf"{OP}: triton unavailable on {re.escape(where)} \({re.escape(error)}.*\); using torch")


def cuda_engine_config():  # noqa: ANN201
    """An engine config on CUDA (built here, never started): its own capture mode is ``cuda_graph``."""
    from epserve.config import EngineConfig
    from epserve.config.model import ModelConfig
    from epserve.presets import build_config

    config = EngineConfig(ModelConfig.from_dict(build_config("tiny")), "tiny", device="cuda")
    assert config.capture_mode == "cuda_graph"
    return config


class Lines(logging.Handler):
    """The log lines of ``kernels.backends`` and ``engine.runner`` while installed."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.loggers = [logging.getLogger(name) for name in ("epserve.kernels.backends", "epserve.engine.runner")]

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> list[str]:
        for logger in self.loggers:
            logger.addHandler(self)
            logger.setLevel(logging.INFO)
        return self.lines

    def __exit__(self, *exc: object) -> None:
        for logger in self.loggers:
            logger.removeHandler(self)


def ops_ran(device: torch.device) -> set[str]:
    """What ran the W4A16 ops on one small linear and one small experts call on ``device``: the Triton kernels
    or the torch backend's references."""
    g = torch.Generator().manual_seed(5)
    weight = [t.to(device) for t in nvfp4_w4a16._nvfp4(g, (), 32, 48, 1)]
    moe = [t.to(device) for t in (*nvfp4_w4a16._nvfp4(g, (2,), 16, 48, 2), *nvfp4_w4a16._nvfp4(g, (2,), 48, 16, 1))]
    x = torch.randn(3, 48, generator=g).to(BF16).to(device)
    with record_calls() as calls:
        nvfp4.nvfp4_linear(x, *weight)
        nvfp4.nvfp4_moe_swiglu(x, torch.tensor([1, 2], device=device), *moe)
    return {impl for name, impl in calls if name in KERNELS}


# ---- under the interpreter ---------------------------------------------------------------------------------


def _case_self_test_passes(nt) -> None:
    """Every dtype: the self-test passes, the op chooses the kernels (one line) and they can be captured."""
    cpu = torch.device("cpu")
    backends.forget(OP)
    with Lines() as lines:
        for dtype in DTYPES:  # (the self-test runs here: the op is undecided)
            assert backends.select(OP, cpu, dtype) == "triton" and nvfp4_w4a16.capturable(cpu, dtype), dtype
    assert lines == [f"{OP} on cpu, {str(d).removeprefix('torch.')}: triton (self-test passed)" for d in DTYPES]


def _case_broken_kernels_fall_back(nt) -> None:
    """Each broken kernel: the op falls back to the reference in one log line, the ops (their CUDA
    implementations listed on the CPU here) run the reference, and the runner decodes eagerly; the real kernels
    again: the kernels, captured."""
    from epserve.engine.runner import capture_mode

    cpu, config = torch.device("cpu"), cuda_engine_config()
    for op in (nvfp4.nvfp4_linear, nvfp4.nvfp4_moe_swiglu):  # the CPU table as CUDA's: gated by the decision
        op.impls["cpu"] = []
        for impl in op.impls["cuda"]:
            op.implement("cpu", impl.target, takes=impl.takes, traced=impl.traced, backend=impl.backend)
        assert [impl.backend for impl in op.impls["cpu"]] == [(OP, "triton"), None], op.impls["cpu"]
    for bug, (name, breaks, error) in BUGS.items():
        real = getattr(nt, name)
        setattr(nt, name, breaks(real))
        try:
            backends.forget(OP)
            with Lines() as lines:
                assert backends.select(OP, cpu, BF16) == "torch", bug
                assert ops_ran(cpu) == set(TORCH.values()), bug
                assert not nvfp4_w4a16.capturable(cpu, BF16), bug
                assert capture_mode(config, cpu, {OP: BF16, "mla_decode": BF16}) is None, bug
        finally:
            setattr(nt, name, real)
        assert len(lines) == 2 and unavailable_line("cpu", BF16, error).fullmatch(lines[0]), (bug, lines)
        assert lines[1].startswith("decode steps: eager (not cuda_graph)"), lines
    backends.forget(OP)
    assert backends.select(OP, cpu, BF16) == "triton" and ops_ran(cpu) == set(KERNELS.values())
    assert capture_mode(config, cpu, {OP: BF16, "mla_decode": BF16}) == "cuda_graph"


INTERP_CASES = {"self_test_passes": _case_self_test_passes, "broken_kernels_fall_back": _case_broken_kernels_fall_back}


interpreter_results, test_triton_under_interpreter = triton_harness.interpreter_tests(__file__, INTERP_CASES)


# ---- without the interpreter -------------------------------------------------------------------------------


def test_without_a_gpu_the_kernels_cannot_run_and_the_engine_decodes_eagerly(caplog):  # noqa: ANN001
    """On CPU tensors, uninterpreted, Triton cannot launch (or is missing): the self-test fails, the op runs the
    reference, and a CUDA engine's capture mode drops to eager; an engine without NVFP4 keeps its mode."""
    from epserve.engine.runner import capture_mode

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the kernels run (the cuda tests)")
    cpu, config = torch.device("cpu"), cuda_engine_config()
    caplog.set_level(logging.INFO)
    backends.forget(OP)
    try:
        assert nvfp4_w4a16.capturable(cpu, BF16) is False  # undecided: nothing is captured on it
        assert backends.select(OP, cpu, BF16) == "torch"
        assert capture_mode(config, cpu, {OP: BF16}) is None
        assert capture_mode(config, cpu, {OP: None, "fp8_gemm": BF16}) == "cuda_graph"
    finally:
        backends.forget(OP)
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.fullmatch(rf"{OP}: triton unavailable on cpu, bfloat16 \(.+\); using torch", line)
               for line in lines), lines
    assert sum(line.startswith("decode steps: eager (not cuda_graph)") for line in lines) == 1, lines


def test_the_cuda_implementations_are_the_chosen_backends_only():
    """``kernels.nvfp4`` lists the Triton kernels on CUDA as the ``nvfp4_w4a16`` op's ``triton`` backend, then its
    ``torch`` backend (the references): without a GPU (a trace's stand-in) the latter is what the tables hold."""
    for op in (nvfp4.nvfp4_linear, nvfp4.nvfp4_moe_swiglu):
        impls = [(impl.target, impl.backend) for impl in op.impls["cuda"]]
        assert impls == [(KERNELS[op.name], (OP, "triton")), (TORCH[op.name], None)]
        assert op.gated_by("cuda") == {OP}
        if not torch.cuda.is_available():
            assert op.chosen("cuda", BF16) == [TORCH[op.name]]
    assert backends.get_op(OP).fallback == "torch"


# ---- CUDA ---------------------------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_self_test_chooses_the_kernels(dtype):
    cuda_device = torch.device("cuda")
    backends.forget(OP)
    assert backends.select(OP, cuda_device, dtype) == "triton"
    assert nvfp4_w4a16.capturable(cuda_device, dtype)


@cuda
def test_cuda_broken_kernel_hands_the_ops_to_the_reference(monkeypatch, caplog):  # noqa: ANN001
    from epserve.kernels import nvfp4_triton as nt

    cuda_device = torch.device("cuda")
    caplog.set_level(logging.INFO, logger=backends.__name__)
    monkeypatch.setattr(nt, "nvfp4_linear_triton", nibbles_swapped(nt.nvfp4_linear_triton))
    backends.forget(OP)
    try:
        assert backends.select(OP, cuda_device, BF16) == "torch"
        assert ops_ran(cuda_device) == set(TORCH.values())
    finally:
        monkeypatch.undo()
        backends.forget(OP)
    where = backends.device_key(cuda_device)
    assert any(unavailable_line(where, BF16, BUGS["nibbles_swapped"][2]).fullmatch(r.getMessage())
               for r in caplog.records)
    assert ops_ran(cuda_device) == set(KERNELS.values())


@cuda
def test_cuda_engine_on_the_reference_decodes_eagerly(make_ckpt, monkeypatch):  # noqa: ANN001
    """Kernels that fail their self-test: the engine on CUDA starts with the reference and eager decode steps (no
    capture, which the reference's host reads would break), and its greedy tokens are the CPU engine's (both
    transformers' on the dequantized checkpoint, ``tests/model/test_nvfp4_runtime.py``)."""
    from epserve import LLM, SamplingParams
    from epserve.kernels import nvfp4_triton as nt

    path = make_ckpt("tiny", dtype="float32", quantization="nvfp4")
    prompts, params = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(path, dtype="float32", num_blocks=64, device="cpu") as cpu_llm:
        want = [out.token_ids for out in cpu_llm.generate(prompts, params)]
    monkeypatch.setattr(nt, "nvfp4_moe_swiglu_triton", part_scales_swapped(nt.nvfp4_moe_swiglu_triton))
    backends.forget(OP)
    try:
        with LLM(path, dtype="float32", num_blocks=64, device="cuda") as llm:
            assert llm.engine.runner.decode_graphs is None
            assert [out.token_ids for out in llm.generate(prompts, params)] == want
    finally:
        monkeypatch.undo()
        backends.forget(OP)


def _interpreter_main() -> None:
    from epserve.kernels import nvfp4_triton

    triton_harness.report_cases(INTERP_CASES, nvfp4_triton)


if __name__ == "__main__":
    _interpreter_main()
