"""Overlap schedules as the engine runs them: stage order of two micro-batches, micro-batch splits,
the ops a layer's forward runs (and where it yields) equal to the stage lists, and one-process
equivalence of the modes."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.config import ConfigError, ModelConfig, ParallelConfig
from epserve.engine.runner import BatchPlan
from epserve.messages.expert_load import ExpertLoad
from epserve.model.batch import MicroBatch
from epserve.parallel.overlap import Result, choose_overlap, run_in_order, run_interleaved
from epserve.parallel.stages import OVERLAP_MODES, Schedule, dense_layer_schedule, moe_layer_schedule


class RecordingLayer:
    """A layer whose forward appends ``(micro-batch, layer, op)`` to a shared log for every op of its
    schedule and yields at every stage end."""

    def __init__(self, idx: int, log: list) -> None:
        self.idx, self.log = idx, log

    def forward(self, state: str, mode: str, result: Result):
        for stage in moe_layer_schedule(mode).stages:  # type: ignore[arg-type]
            for op in stage.ops:
                self.log.append((state, self.idx, op.name))
            yield
        result.value = state


def run_layers(layers: list[RecordingLayer], state: str, mode: str, result: Result):
    for layer in layers:
        yield from layer.forward(state, mode, result)
        state = result.value


def stage_trace(log: list, schedule: Schedule) -> list[str]:
    """Collapse an op log into stage labels like ``A1``, ``B3`` (stage numbers count across layers)."""
    first_ops = {s.ops[0].name: i for i, s in enumerate(schedule.stages)}
    n = len(schedule.stages)
    return [f"{mb}{layer * n + first_ops[op] + 1}" for mb, layer, op in log if op in first_ops]


def test_two_micro_batches_follow_the_stage_offset():
    log: list = []
    layers = [RecordingLayer(i, log) for i in range(2)]
    offset = moe_layer_schedule("microbatch").micro_batch_offset
    a, b = Result(), Result()
    run_interleaved(run_layers(layers, "A", "microbatch", a), run_layers(layers, "B", "microbatch", b), offset)
    assert (a.value, b.value) == ("A", "B")
    trace = stage_trace(log, moe_layer_schedule("microbatch"))
    # B starts two stages after A, then they alternate (docs/architecture.md, "Two micro-batches").
    assert trace[:8] == ["A1", "A2", "A3", "B1", "A4", "B2", "A5", "B3"]
    assert trace.count("A10") == 1 and trace[-1] == "B10"
    # A's dispatch is in flight while B computes: B's first stage sits between A's send and receive.
    ops = [(mb, layer, op) for mb, layer, op in log]
    assert ops.index(("A", 0, "dispatch_send")) < ops.index(("B", 0, "input_norm")) < ops.index(
        ("A", 0, "dispatch_recv")
    )
    # Every op of every layer ran exactly once per micro-batch.
    assert len(log) == 2 * 2 * len(moe_layer_schedule("microbatch").ops)


def test_in_order_runs_the_schedule_ops():
    log: list = []
    out = Result()
    run_in_order(run_layers([RecordingLayer(0, log)], "A", "dispatch", out))
    assert out.value == "A"
    assert [op for _, _, op in log] == [op.name for op in moe_layer_schedule("dispatch").ops]


def test_choose_overlap():
    assert choose_overlap("auto", 255, 256) == "dispatch"
    assert choose_overlap("auto", 256, 256) == "microbatch"
    assert choose_overlap("auto", 10**6, None) == "dispatch"  # the CPU default: never micro-batch
    assert choose_overlap("none", 10**6, 1) == "none"
    with pytest.raises(ValueError, match="unknown overlap mode"):
        choose_overlap("sometimes", 1, 1)


class OpRecorder:
    """An op hook: logs each op's name, and ``|`` wherever the forward yields."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def __call__(self, name, fn, *args):
        self.log.append(name)
        return fn(*args)

    def drain(self, stages) -> None:
        for _ in stages:
            self.log.append("|")


@pytest.mark.parametrize("mode", OVERLAP_MODES)
def test_layer_forward_runs_exactly_the_stage_list(make_ckpt, mode):
    """The ops a real decoder layer runs (recorded through its op hook) are its schedule's, in order,
    for every overlap mode; under the micro-batch schedule it yields exactly at the stage ends."""
    llm = LLM(make_ckpt("tiny", dtype="float32"), dtype="float32", num_blocks=16)
    runner = llm.engine.runner
    model = runner.model
    plan = BatchPlan(input_ids=(5, 6, 7, 8), positions=(3, 0, 1, 2), slot_mapping=(3, 16, 17, 18),
                     seq_lens=(4, 3), block_tables=((0,), (1,)), logits_indices=(0, 3),
                     query_start_loc=(0, 1, 4), num_decode_seqs=1)
    batch = plan.to_batch(torch.device("cpu"), runner.block_size)
    x = torch.randn(batch.num_tokens, llm.config.model.hidden_size)
    mb = MicroBatch(batch, model.rotary.lookup(batch.positions, x.dtype), runner.kv_caches)
    kinds = {layer.is_moe: layer for layer in model.layers}
    assert set(kinds) == {True, False}  # the tiny preset has both kinds of layer
    for is_moe, layer in kinds.items():
        recorder = OpRecorder()
        layer.op_hook = recorder
        try:
            with torch.inference_mode():
                out = Result()
                recorder.drain(layer.forward(x, mb, out, mode))
        finally:
            layer.op_hook = None
        assert out.value.shape == x.shape
        schedule = moe_layer_schedule(mode, "mixed") if is_moe else dense_layer_schedule("mixed")
        assert schedule == layer.schedule(mode)
        ran = [name for name in recorder.log if name != "|"]
        assert ran == [op.name for op in schedule.ops]
        if is_moe and mode == "microbatch":
            stages: list[list[str]] = [[]]
            for name in recorder.log:
                if name == "|":
                    stages.append([])
                else:
                    stages[-1].append(name)
            assert stages.pop() == []  # the last stage ends with a yield too
            assert stages == [[op.name for op in st.ops] for st in schedule.stages]


def test_micro_batch_split_keeps_whole_sequences():
    plan = BatchPlan(
        input_ids=tuple(range(13)), positions=(7, 9, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3), slot_mapping=tuple(range(13)),
        seq_lens=(8, 10, 7, 4), block_tables=((0,), (1,), (2,), (3,)), logits_indices=(0, 1, 8, 12),
        query_start_loc=(0, 1, 2, 9, 13), num_decode_seqs=2,
    )
    batch = plan.to_batch(torch.device("cpu"), 16)
    cut = batch.split_point()
    assert cut == 3  # tokens 0..8 | 9..12 is the most even whole-sequence split
    a, b = batch.select(0, cut), batch.select(cut, batch.num_seqs)
    assert (a.num_tokens, b.num_tokens) == (9, 4)
    assert (a.num_decode_seqs, b.num_decode_seqs) == (2, 0)
    assert b.query_start_loc_cpu == (0, 4) and b.seq_lens_cpu == (4,)
    assert b.logits_indices.tolist() == [3] and a.logits_indices.tolist() == [0, 1, 8]
    assert torch.equal(torch.cat([a.input_ids, b.input_ids]), batch.input_ids)
    empty = BatchPlan().to_batch(torch.device("cpu"), 16)
    assert empty.split_point() == 0 and empty.select(0, 0).num_tokens == 0


def test_overlap_modes_agree_in_one_process(make_ckpt, device):
    path = make_ckpt("tiny", dtype="float32")
    prompts = [[5, 6, 7], list(range(100, 160)), [9] * 20, [300, 301]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", num_blocks=128, max_num_batched_tokens=32, enable_prefix_caching=False,
              device=device)
    outputs = {}
    for mode in ("none", "dispatch", "microbatch"):
        llm.set_overlap(mode)
        outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["none"] == outputs["dispatch"] == outputs["microbatch"]


def test_layout_must_divide_the_model(make_ckpt):
    path = make_ckpt("tiny", dtype="float32")  # 4 heads, 16 routed experts
    with pytest.raises(ConfigError, match="tp=3 does not divide the model's 4 attention heads"):
        LLM(path, tp=3)
    with pytest.raises(ConfigError, match="does not divide the 16 routed experts"):
        LLM(path, dp=3)
    with pytest.raises(ConfigError, match="unknown dispatch backend"):
        LLM(path, dp=2, dispatch="carrier-pigeon")
    with pytest.raises(ConfigError, match="dp must be a positive integer"):
        ParallelConfig(dp=0)
    with pytest.raises(ConfigError, match="master_port"):
        ParallelConfig(dp=2, nnodes=2)
    ParallelConfig(tp=2).check_model(ModelConfig.from_hf(path))


def test_expert_load_sums_ranks():
    # slots 0 1 2 | 3 0 1: rank 1 received expert 3's copies and those of its replicas of 0 and 1
    loads = [[[1, 2, 3, 0]], [[5, 6, 0, 4]]]
    load = ExpertLoad.from_ranks((3,), loads)
    assert load.per_expert == ((1 + 5, 2 + 6, 3, 4),)
    assert load.per_rank == ((6, 15),)
    assert load.imbalance == pytest.approx(15 / 10.5)
    assert load.summary()["tokens_per_rank"] == [6, 15]


def test_set_overlap_refuses_bad_values(make_ckpt):
    llm = LLM(make_ckpt("tiny", dtype="float32"), dtype="float32", num_blocks=16)
    with pytest.raises(ConfigError, match="unknown overlap mode"):
        llm.set_overlap("sometimes")
    with pytest.raises(ConfigError, match="microbatch_threshold must be a positive integer"):
        llm.set_overlap("auto", 0)
    llm.set_overlap("auto", 8)
    assert llm.engine.runner.microbatch_threshold == 8 and llm.engine.runner.overlap == "auto"


def _inner_stages(x, result):
    y = x * 2
    yield
    result.value = y + 1


def _outer_stages(x, times, result):
    for _ in range(times):
        inner = Result()
        yield from _inner_stages(x, inner)
        x = inner.value
        yield
    result.value = x


def test_one_micro_batch_drains_the_same_generator_under_fullgraph_compile():
    """One micro-batch runs a layer's one forward, drained (parallel.overlap.run_in_order), eagerly and
    traced whole by torch.compile(fullgraph=True): stage generators, delegating with `yield from`, hand
    their outputs back through a Result, which the trace keeps."""
    import torch._dynamo

    def one_micro_batch(x):
        out = Result()
        run_in_order(_outer_stages(x, 2, out))
        return out.value

    x = torch.tensor([3.0, -1.0])
    assert one_micro_batch(x).tolist() == [15.0, -1.0]  # ((3 * 2 + 1) * 2 + 1, ...)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(one_micro_batch, fullgraph=True, backend=backend)
    assert torch.equal(compiled(x), one_micro_batch(x))
    assert len(graphs) == 1  # every op in the one graph: (x * 2 + 1) twice
    assert [n.target.__name__ for n in graphs[0].graph.nodes if n.op == "call_function"] == ["mul", "add"] * 2
