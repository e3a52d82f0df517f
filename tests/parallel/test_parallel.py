"""Expert parallelism end to end: every (dp, tp) layout, dispatch backend and overlap mode gives the
single process's greedy tokens and logprobs; torchrun across two loopback "nodes"; a killed rank
fails the call fast and leaves no process behind."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.messages.sampling import StructuredOutput
from epserve.parallel.launch import RankFailure, free_port
from tests.serve_harness import alive, children, cpu_used_in_quietest_window

pytestmark = pytest.mark.slow

SHARED = list(range(40, 80))  # a prefix several prompts share (prefix-cache hits)
PROMPTS = [
    SHARED + [3, 4, 5],
    [9, 8, 7],
    list(range(200, 300)),  # chunked over several steps by the small token budget
    SHARED + [6, 7],
    [11],
    list(range(450, 410, -1)),
    SHARED + [8],
    [21, 22, 23],
]
# Logits processing and prompt logprobs ride along: every layout must give the same processed tokens.
PROCESSING = [{}, {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
              {"prompt_logprobs": 2}, {"logit_bias": {7: 5.0, 300: -100.0}},
              {"structured": StructuredOutput("regex", "[a-z]{2,5}-[0-9]{2}")}, {"min_tokens": 4, "prompt_logprobs": 0},
              {"frequency_penalty": -0.5},
              {"structured": StructuredOutput("json_schema", '{"type": "object", "properties": {"n": {"type": '
                                              '"integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, '
                                              '"required": ["n", "ok"], "additionalProperties": false}')}]
PARAMS = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=3, **PROCESSING[i])
          for i in range(len(PROCESSING))]
ENGINE = dict(dtype="float32", num_blocks=256, max_num_batched_tokens=48)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(make_ckpt) -> Path:
    return make_ckpt("tiny", dtype="float32")


@pytest.fixture(scope="module")
def reference(ckpt):
    return LLM(ckpt, **ENGINE).generate(PROMPTS, PARAMS)


def assert_same(outputs, reference, label: str) -> None:
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.token_ids == ref.token_ids, f"{label}: prompt {i} tokens differ"
        assert (out.prompt_logprobs is None) == (ref.prompt_logprobs is None)
        for pos, (a, b) in enumerate(zip(out.prompt_logprobs or (), ref.prompt_logprobs or ())):
            assert (a is None and b is None) or (a.token_id == b.token_id and abs(a.logprob - b.logprob) <= LOGPROB_ATOL
                                                 and [t for t, _ in a.top] == [t for t, _ in b.top]), f"{label}: {pos}"
        for step, (a, b) in enumerate(zip(out.logprobs, ref.logprobs)):
            assert abs(a.logprob - b.logprob) <= LOGPROB_ATOL, f"{label}: prompt {i} step {step}"
            for (ta, la), (tb, lb) in zip(a.top, b.top):
                assert ta == tb and abs(la - lb) <= LOGPROB_ATOL, f"{label}: prompt {i} step {step} top logprobs"


@pytest.mark.parametrize(("dp", "tp", "dispatch"), [
    (2, 1, "all_to_all"), (2, 1, "padded"), (1, 2, "all_to_all"), (1, 2, "padded"), (2, 2, "all_to_all"),
    (2, 2, "padded"),
    # dp 4 (four ranks on this 2-core machine): with the padded dispatcher and every overlap mode in
    # test_eplb_parallel (with redundant experts, before and after a rebalance); all_to_all: test_dispatch
])
def test_layouts_match_one_process(ckpt, reference, dp, tp, dispatch):
    with LLM(ckpt, dp=dp, tp=tp, dispatch=dispatch, **ENGINE) as llm:
        for mode in ("none", "dispatch", "microbatch"):
            llm.set_overlap(mode)
            assert_same(llm.generate(PROMPTS, PARAMS), reference, f"dp={dp} tp={tp} {dispatch} {mode}")


def test_expert_load_matches_one_process(ckpt):
    """Routing sees the same hidden states in every layout: the same token copies per (layer,
    expert); per rank they sum to the same total. (No prefix cache: spreading requests over DP
    groups changes which prefixes hit it, hence how many tokens run.)"""
    engine = {**ENGINE, "enable_prefix_caching": False}
    single = LLM(ckpt, **engine)
    single.generate(PROMPTS, PARAMS)
    ref = single.expert_load()
    with LLM(ckpt, dp=2, tp=2, **engine) as llm:
        llm.generate(PROMPTS, PARAMS)
        load = llm.expert_load()
    per_expert, per_rank, ref_per_expert = (torch.tensor(t) for t in (load.per_expert, load.per_rank, ref.per_expert))
    assert torch.equal(per_expert, ref_per_expert)
    assert per_rank.shape == (len(load.layers), 4)
    assert torch.equal(per_rank.sum(1), ref_per_expert.sum(1))
    # 16 experts over 4 ranks: rank r holds logical experts 4r..4r+3.
    assert torch.equal(per_rank, ref_per_expert.view(len(load.layers), 4, 4).sum(2))
    totals = torch.tensor(load.rank_totals).double()
    assert load.imbalance == pytest.approx(float(totals.max() / totals.mean()))


def test_auto_overlap_switches_at_the_threshold(ckpt, reference):
    """auto with threshold 1 micro-batches every step; with a huge one never: both exact."""
    ref_outputs = reference
    with LLM(ckpt, dp=2, overlap="auto", microbatch_threshold=1, **ENGINE) as llm:
        llm.set_profiling(True)
        assert_same(llm.generate(PROMPTS, PARAMS), ref_outputs, "auto threshold 1")
        modes = {s.overlap for rank in llm.profile() for s in rank}
        assert modes == {"microbatch"}
        llm.set_overlap("auto", 10**6)
        llm.set_profiling(True)
        assert_same(llm.generate(PROMPTS, PARAMS), ref_outputs, "auto threshold 1e6")
        assert {s.overlap for rank in llm.profile() for s in rank} == {"dispatch"}


def test_idle_group_and_refused_request_keep_ranks_usable(ckpt, reference):
    ref_outputs = reference
    with LLM(ckpt, dp=2, **ENGINE) as llm:
        pids = llm._ranks.pids
        # One request: DP group 1 runs empty batches through every step.
        [out] = llm.generate([PROMPTS[2]], [PARAMS[2]])
        assert out.token_ids == ref_outputs[2].token_ids
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([[1, 2, 10**6]])
        assert llm.generate([PROMPTS[1]], [PARAMS[1]])[0].token_ids == ref_outputs[1].token_ids
        # No work anywhere: the ranks block (on their pipes), they do not spin.
        used = cpu_used_in_quietest_window(pids)
        assert max(used.values()) < 0.05, used
    assert not any(alive(p) for p in pids)  # shutdown leaves no process behind




def test_bytes_moved_match_the_rows_sent(ckpt):
    """all_to_all sends each token copy whose expert lives elsewhere once, both ways."""
    with LLM(ckpt, dp=2, dispatch="all_to_all", **ENGINE) as llm:
        llm.reset_comm_stats()
        llm.generate(PROMPTS[:2], PARAMS[:2])
        stats = llm.comm_bytes()
    assert all(s["dispatch"] > 0 for s in stats)
    assert sum(s["dispatch"] for s in stats) == sum(s["combine"] for s in stats)


def test_killed_rank_fails_fast_and_leaves_nothing_behind(ckpt):
    llm = LLM(ckpt, dp=2, dtype="float32", num_blocks=512)
    pids = llm._ranks.pids
    # rank 1 hangs first (SIGSTOP), so rank 0's steps wait on it: the generation is still running when
    # the kill lands, however fast the machine (2 s is only for generate to have handed the ranks its work)
    os.kill(pids[1], signal.SIGSTOP)
    killer = threading.Timer(2.0, os.kill, (pids[1], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 died with exit code -9 \(SIGKILL\)"):
        llm.generate([[5] * 10] * 8, SamplingParams(max_tokens=100_000, ignore_eos=True))
    assert time.monotonic() - start < 30
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)
    with pytest.raises(RankFailure, match="shut down"):
        llm.generate([[5]])


def _tokens(stdout: str) -> list[list[int]]:
    return [ast.literal_eval(line.split(": ", 1)[1].rsplit(" (", 1)[0])
            for line in stdout.splitlines() if line.startswith("tokens: ")]


RANK_SCRIPT = Path(__file__).with_name("torchrun_rank.py")  # `epserve generate`, then the threads left


def test_torchrun_two_nodes_on_loopback(ckpt):
    """Each node's rank runs `epserve generate` and leaves the world before its interpreter finalizes: no
    gloo thread is left by then (one was: a rank aborted at exit now and then, and its peer node's agent
    waited out torchrun's exit barrier)."""
    prompts = ["The quick brown fox", "Expert parallelism"]
    args = ["generate", str(ckpt), "--dtype", "float32", "--dp", "2", "--max-tokens", "8", "--temperature", "0"]
    for p in prompts:
        args += ["--prompt", p]
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen([*torchrun, "--node-rank", str(n), str(RANK_SCRIPT), "--log-level", "WARNING", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        for n in range(2)
    ]
    outs = _communicate_or_kill(nodes, timeout_s=240)
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    for _, err in outs:
        [left] = [line for line in err.splitlines() if line.startswith("threads left: ")]
        assert "gloo" not in left, left
    single = LLM(ckpt, dtype="float32").generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert _tokens(outs[0][0]) == [o.token_ids for o in single]
    assert _tokens(outs[1][0]) == []  # only rank 0 prints


def _communicate_or_kill(nodes: list[subprocess.Popen], timeout_s: float,
                         grace_s: float = 15.0) -> list[tuple[str, str]]:
    """Every node's (stdout, stderr) once all have exited. Past ``timeout_s``, or ``grace_s`` after a node
    failed (the other node's torchrun agent, its own rank done, then waits out torchrun's exit barrier:
    minutes), every node's process group is killed and the test failed with what each had printed (a
    hang shows where it hung)."""
    printed: list[tuple[str, str]] = [("", "")] * len(nodes)

    def read(i: int) -> None:
        printed[i] = nodes[i].communicate()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(nodes))]
    for r in readers:
        r.start()
    deadline = time.monotonic() + timeout_s
    failed = False
    while any(r.is_alive() for r in readers) and time.monotonic() < deadline:
        if not failed and any(n.returncode not in (None, 0) for n in nodes):
            failed, deadline = True, min(deadline, time.monotonic() + grace_s)
        time.sleep(0.1)
    if not any(r.is_alive() for r in readers):
        return printed
    for n in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(n.pid, signal.SIGKILL)
    for r in readers:
        r.join(10)
    why = "a node failed and the other did not finish" if failed else f"the nodes did not finish within {timeout_s:g} s"
    pytest.fail(f"{why}:\n" + "\n".join(f"node {i} (exit code {n.returncode}) stderr:\n{err[-3000:]}"
                                       for i, (n, (_, err)) in enumerate(zip(nodes, printed))))


# what rank logs say once the world is in a phase: its model loaded (the start-up collectives follow), or
# its first decode step (the fp32 decode kernels load at first use)
PEER_KILLED_WHILE = {"starting": "loaded ", "generating": "decode kernels loaded"}


@pytest.mark.parametrize("phase", sorted(PEER_KILLED_WHILE))
def test_torchrun_rank_exits_when_its_peer_is_killed(ckpt, phase):
    """Either phase ends in one line naming the rank, not a traceback of ours (torchrun's agent still
    prints its own summary)."""
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    args = ["-m", "epserve.cli", "--log-level", "INFO", "generate", str(ckpt), "--dtype", "float32", "--dp", "2",
            "--max-tokens", "1900", "--ignore-eos", "--num-blocks", "2048"]
    args += [arg for i in range(32) for arg in ("--prompt", f"prompt {i}")]  # ~2000 steps of 16 sequences per rank
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen([*torchrun, "--node-rank", str(n), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, env=env, start_new_session=True)
        for n in range(2)
    ]
    logs: list[list[str]] = [[], []]
    loaded = [threading.Event(), threading.Event()]

    def read(n: int) -> None:  # each node's log, and when it reached the phase
        for line in nodes[n].stderr:
            logs[n].append(line)
            if PEER_KILLED_WHILE[phase] in line:
                loaded[n].set()

    readers = [threading.Thread(target=read, args=(n,), daemon=True) for n in range(2)]
    for r in readers:
        r.start()
    try:
        assert all(e.wait(120) for e in loaded), "".join(logs[0][-20:] + logs[1][-20:])
        assert nodes[0].poll() is None, "".join(logs[0][-20:])
        [worker] = children(nodes[1].pid)  # torchrun runs the rank in a session of its own
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        nodes[0].wait(timeout=60)
        assert time.monotonic() - start < 30
        assert nodes[0].returncode != 0
        readers[0].join(10)
        ours = [line for line in logs[0] if not line.startswith(("[rank", "E1", "W1"))]  # torchrun's own lines
        assert any(line.startswith("epserve: error: rank 0 failed") for line in ours), "".join(logs[0][-30:])
        assert not any(line.startswith("[rank0]: Traceback") for line in logs[0]), "".join(logs[0][-30:])
    finally:
        for node in nodes:
            for pid in [node.pid, *children(node.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            node.wait()


def test_two_hosts_without_torchrun(ckpt):
    """--nnodes/--node-rank/--master-addr/--master-port: each "host" spawns its share of the ranks."""
    port = free_port()
    args = ["generate", str(ckpt), "--dtype", "float32", "--dp", "2", "--tp", "2", "--max-tokens", "6",
            "--temperature", "0", "--prompt", "abc", "--prompt", "hello", "--nnodes", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [
        subprocess.Popen([sys.executable, "-m", "epserve.cli", "--log-level", "WARNING", *args, "--node-rank", str(n)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for n in range(2)
    ]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    single = LLM(ckpt, dtype="float32").generate(["abc", "hello"], SamplingParams(max_tokens=6, temperature=0.0))
    assert _tokens(outs[0][0]) == [o.token_ids for o in single]
    assert _tokens(outs[1][0]) == []
