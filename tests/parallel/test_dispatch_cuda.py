"""The captured decode path's collectives on one CUDA rank (``@pytest.mark.cuda``: skipped without a device,
run by ``benchmarks/gpu_check.sh``).

One process is a one-rank NCCL group (a ``file://`` store in a temporary folder: no network):

- ``SymmMemDispatcher`` over NVSHMEM (skipped, naming why, where torch or the machine has none) with 40
  experts on its one rank (past the 16 of torch's 2-D op): eager, then captured in a CUDA graph and replayed
  with new routing written in place; each output equals the ``local`` dispatcher's, bit for bit;
- ``PaddedDispatcher`` (NCCL ``all_to_all_single`` through functional collectives) captured the same way;
- the TP collectives ``parallel/comm.py`` runs for TP > 1 (``reduce_scatter_single``, ``all_gather_single``)
  captured on the group and replayed with new data.

The 'experts' are elementwise (row * (1 + slot)) on fixed shapes, so the comparisons are exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from epserve.moe.dispatch.base import Dispatcher, ExpertInput
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.parallel import comm

pytestmark = pytest.mark.cuda

EXPERTS, TOP_K, HIDDEN, TOKENS = 40, 8, 256, 24


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank NCCL group on device 0."""
    torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("store") / "pg"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def routing(seed: int, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] bf16, distinct top-k slots [T, K], weights [T, K] fp32, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, generator=g).topk(TOP_K, dim=1).indices
    return x.cuda(), ids.cuda(), torch.rand(tokens, TOP_K, generator=g).cuda()


def slot_scaled(expert_input: ExpertInput) -> torch.Tensor:
    """Row * (1 + its slot), fixed shapes on the device (padding rows give whatever; nobody reads them)."""
    counts = expert_input.num_tokens_per_expert
    rows = torch.arange(expert_input.hidden_states.shape[0], device=counts.device)
    slot = torch.searchsorted(counts.cumsum(0), rows, right=True)
    return (expert_input.hidden_states.float() * (slot + 1)[:, None]).to(torch.bfloat16)


def layer(disp: Dispatcher, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    expert_input, route = disp.dispatch(x, ids, w)
    return disp.combine(slot_scaled(expert_input), route)


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return layer(LocalDispatcher(EXPERTS), x, ids, w)


def check_eager_and_captured(disp: Dispatcher) -> None:
    x, ids, w = routing(0)
    disp.begin_step(TOKENS)
    torch.testing.assert_close(layer(disp, x, ids, w), reference(x, ids, w), rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(disp, x, ids, w)
    for seed in (1, 2, 3):
        new_x, new_ids, new_w = routing(seed)
        for static, new in ((x, new_x), (ids, new_ids), (w, new_w)):
            static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, reference(new_x, new_ids, new_w), rtol=0, atol=0)


def test_symm_mem_dispatcher_eager_and_captured_on_one_nvshmem_rank(group):
    from epserve.moe.dispatch.symm_mem import SymmMemDispatcher, symm_mem_problem

    problem = symm_mem_problem(torch.device("cuda", 0))
    if problem is not None:
        pytest.skip(f"NVSHMEM is unavailable: {problem}")
    disp = SymmMemDispatcher(EXPERTS, group, TOP_K, TOKENS, HIDDEN, torch.bfloat16, torch.device("cuda", 0))
    assert disp.workspace_bytes() > 0
    check_eager_and_captured(disp)
    disp.reset_stats()
    assert disp.comm_bytes == {"dispatch": 0, "combine": 0}  # one rank: nothing leaves it


def test_symm_mem_fp8_payload_arrives_as_the_local_dispatcher_quantizes_it(group):
    """The packed FP8 rows (padded to the exchange's row alignment) unpack to the local dispatcher's values and
    scales, the scales in the CUDA GEMM's M-major layout."""
    from epserve.moe.dispatch.symm_mem import SymmMemDispatcher, symm_mem_problem

    problem = symm_mem_problem(torch.device("cuda", 0))
    if problem is not None:
        pytest.skip(f"NVSHMEM is unavailable: {problem}")
    disp = SymmMemDispatcher(EXPERTS, group, TOP_K, TOKENS, HIDDEN, torch.bfloat16, torch.device("cuda", 0),
                             fp8=True)
    x, ids, w = routing(4)
    disp.begin_step(TOKENS)
    got, route = disp.dispatch(x, ids, w)
    want, _ = LocalDispatcher(EXPERTS, fp8=True).dispatch(x, ids, w)
    n = TOKENS * TOP_K
    assert got.masked and torch.equal(got.num_tokens_per_expert, want.num_tokens_per_expert)
    assert torch.equal(got.hidden_states[:n].view(torch.uint8), want.hidden_states.view(torch.uint8))
    assert got.scales is not None and want.scales is not None and got.scales.stride(0) == 1
    assert torch.equal(got.scales[:n], want.scales)
    disp.combine(torch.zeros(got.hidden_states.shape[0], HIDDEN, dtype=torch.bfloat16, device="cuda"), route)


def test_padded_dispatcher_captured_on_one_nccl_rank(group):
    check_eager_and_captured(PaddedDispatcher(EXPERTS, group))


def test_tp_collectives_captured_on_one_nccl_rank(group):
    """What ``TensorParallel.reduce_scatter`` / ``all_gather`` run for TP > 1, captured and replayed."""
    src = torch.randn(16, HIDDEN, device="cuda", dtype=torch.bfloat16)
    scattered = torch.empty_like(src)
    gathered = torch.empty_like(src)
    comm._reduce_scatter(scattered, src, group=group)  # warm the communicator outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm._reduce_scatter(scattered, src, group=group)
        comm._all_gather(gathered, scattered * 2, group=group)
    for _ in range(3):
        src.copy_(torch.randn_like(src))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(scattered, src) and torch.equal(gathered, src * 2)
