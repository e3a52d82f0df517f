"""Paged MLA decode with FlashInfer's ``BatchMLAPagedAttentionWrapper`` (the optional ``flashinfer-python``
package; ``pip install 'epserve[cuda]'``), and the ``mla_decode`` op's backends: FlashInfer, then the
project's Triton kernels (``kernels.backends`` picks, after FlashInfer's self-test against the torch
reference on the device).

What it takes. FlashInfer's MLA kernels take DeepSeek's shapes, a latent of ``kv_lora_rank`` 512 and a
rope part of 64, a query in the cache's dtype and a cache of bf16 or fp16 (:func:`eligible` checks the
shapes of every call; anything else runs the Triton kernels). Our cache rows are ``[c_kv (512) | k_pe
(64)]`` in one tensor ``[blocks, block_size, 576]``; FlashInfer wants the ``ckv`` and ``kpe`` parts as
two tensors and reads each through its page and token strides, so the two are plain strided views of the
cache (no copy). The query is cast from fp32 to the cache dtype: scores then carry a bf16-rounded query
(the precision vLLM and SGLang run it at); the split-K Triton kernel keeps ~16 mantissa bits of it; the many-head one
(``kernels/mla_decode_wide.py``) rounds it to bf16 once, as FlashInfer does. The output
(the query dtype) comes back as fp32. FP8 caches stay on Triton: FlashInfer's FP8 MLA paths take their
scales as host floats (a device-to-host read of ``kv_scale`` per layer) and differ between its versions.

Planning. ``plan()`` reads the lengths on the host and builds the work schedule; ``run()`` launches. An
eager call reads ``seq_lens`` once (a host sync) and plans, and the plan is kept for the calls that follow with
the same ``block_tables`` and ``seq_lens`` tensors (every layer of a step: one plan per step, one per
micro-batch with two). The key is the tensors' addresses and shapes, and the cache holds a reference to
both, so their memory cannot be handed to another step's tensors while the plan lives: the contract is
that a call's tables and lengths are not rewritten in place afterwards (the engine builds them anew for
every step).

CUDA graphs. Planning inside a capture is impossible (it reads the lengths on the host, and a replay would
reuse the captured lengths). A call whose tables and lengths are a captured bucket's static tensors, planned
through ``kernels.decode_plan`` before the bucket's warm-up, capture and every replay, runs the bucket's
CUDA-graph-mode wrapper instead (``kernels.mla_flashinfer_graph``); the warm-up run and the capture so reach
the same FlashInfer kernel, and whether the stream is capturing changes no choice (:func:`eligible` reads
shapes only). Any other call inside a capture raises (``NotPlanned``) rather than plan there.
Rows of length 0 (padding) read one token of their first block and come out zero, as the contract says.
A FlashInfer error on a case the self-test did not cover (:func:`try_decode`; outside a capture) hands the
op to Triton for the rest of the process, with one warning.

Speed. Where both pass their self-tests on a GPU, ``kernels.backends`` times one decode of each at
DeepSeek-V3's shapes (:func:`benchmark_case`: 128 heads, 4k tokens of context, 32 rows) and keeps the faster.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epserve import env
from epserve.kernels import backends
from epserve.kernels.device import is_cuda
from epserve.kernels.fp8 import cdiv
from epserve.kernels.mla_decode import check_decode, paged_mla_decode, paged_mla_decode_ref
from epserve.kernels.mla_flashinfer_graph import (
    KV_LORA_RANK,
    ROPE_DIM,
    NotPlanned,
    SeqLensError,
    backend_for,
    captured_decode,
    import_flashinfer,
    workspace,
)

CACHE_DTYPES = (torch.bfloat16, torch.float16)
MAX_PLANS = 4  # plans kept per device: the step's, and one per micro-batch
SELF_TEST_HEADS = (16, 128)  # DeepSeek-V3's 128 heads at TP 8 and at TP 1
SELF_TEST_TOLERANCE = 1e-2  # of max |v|: bf16 output and P rounding err by ~2^-9 of it
BENCH_ROWS, BENCH_HEADS, BENCH_TOKENS, BENCH_BLOCK = 32, 128, 4096, 16  # the timed self-test's decode

MLAImpl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]


def fits(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lora_rank: int,
         kv_scale: torch.Tensor | None) -> bool:
    """Whether a call's shapes and dtypes fit FlashInfer's MLA decode (DeepSeek's 512 + 64 columns, a
    bf16/fp16 cache without a scale, rows to decode, a table with columns)."""
    return (
        kv_scale is None and kv_cache.dtype in CACHE_DTYPES and kv_lora_rank == KV_LORA_RANK
        and q_latent.dim() == 3 and kv_cache.dim() == 3 and q_latent.shape[-1] == KV_LORA_RANK + ROPE_DIM
        and kv_cache.shape[-1] == q_latent.shape[-1] and kv_cache.stride(-1) == 1
        and q_latent.shape[0] > 0 and block_tables.dim() == 2 and block_tables.shape[1] > 0
    )


def eligible(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lora_rank: int,
             kv_scale: torch.Tensor | None) -> bool:
    """Whether this call may run FlashInfer: CUDA tensors that :func:`fits` (shapes only, the same answer
    inside a graph capture as outside it; nothing is read from the device)."""
    return is_cuda(q_latent) and fits(q_latent, kv_cache, block_tables, kv_lora_rank, kv_scale)


@dataclass
class _Plan:
    """A planned wrapper and what it was planned for (kept alive: their addresses are the key)."""

    wrapper: object
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    empty: torch.Tensor | None  # [B, 1, 1] bool on the device: rows with no tokens, zeroed; None when none


class _Planner:
    """One device's workspace and its most recent plans (least recently used first)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.workspace = workspace(device)
        self.plans: OrderedDict[tuple, _Plan] = OrderedDict()

    def _wrapper(self) -> object:
        """A wrapper for a new plan: the least recently used one's when the cache is full."""
        if len(self.plans) >= MAX_PLANS:
            return self.plans.popitem(last=False)[1].wrapper
        return import_flashinfer().BatchMLAPagedAttentionWrapper(self.workspace, backend=backend_for(self.device))

    def plan(self, q_dtype: torch.dtype, kv_cache: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, num_heads: int, softmax_scale: float) -> _Plan:
        block_size = kv_cache.shape[1]
        key = (block_tables.data_ptr(), tuple(block_tables.shape), block_tables.stride(), seq_lens.data_ptr(),
               tuple(seq_lens.shape), seq_lens.stride(), num_heads, block_size, q_dtype, kv_cache.dtype, softmax_scale)
        cached = self.plans.get(key)
        if cached is not None:
            self.plans.move_to_end(key)
            return cached
        lens = seq_lens.to("cpu", torch.int64)  # the host sync of this step
        width = block_tables.shape[1]
        if int(lens.min()) < 0 or int(lens.max()) > width * block_size:
            raise SeqLensError(f"seq_lens {lens.tolist()} must lie in [0, {width * block_size}] "
                               f"(block_tables {tuple(block_tables.shape)}, block_size {block_size})")
        read, kv_indptr, kv_indices = csr_pages(block_tables, lens, block_size)
        wrapper = self._wrapper()
        wrapper.plan(  # type: ignore[attr-defined]
            qo_indptr=torch.arange(len(read) + 1, dtype=torch.int32), kv_indptr=kv_indptr, kv_indices=kv_indices,
            kv_len_arr=read, num_heads=num_heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM,
            page_size=block_size, causal=False, sm_scale=softmax_scale, q_data_type=q_dtype,
            kv_data_type=kv_cache.dtype,
        )
        empty = (lens == 0).to(self.device)[:, None, None] if bool((lens == 0).any()) else None
        self.plans[key] = plan = _Plan(wrapper, block_tables, seq_lens, empty)
        return plan


def csr_pages(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page layout of a batch from our block tables and host ``lens``: (tokens read per
    row (int32, host), ``kv_indptr`` [B + 1] (int32, host), ``kv_indices`` (int32, on the tables' device):
    row i's pages ``block_tables[i, :cdiv(n_i, block_size)]`` at ``kv_indptr[i]:kv_indptr[i + 1]``). An
    empty row reads one token of its first block (its output is zeroed by the caller)."""
    read = lens.clamp(min=1)
    pages = (read + block_size - 1) // block_size
    kv_indptr = torch.zeros(len(read) + 1, dtype=torch.int32)
    kv_indptr[1:] = pages.cumsum(0)
    width = block_tables.shape[1]
    used = torch.arange(width, device=block_tables.device)[None, :] < pages.to(block_tables.device)[:, None]
    return read.to(torch.int32), kv_indptr, block_tables[used].to(torch.int32)  # row-major: rows in order


_planners: dict[str, _Planner] = {}


def _planner(device: torch.device) -> _Planner:
    key = backends.device_key(device)
    if key not in _planners:
        _planners[key] = _Planner(torch.device(key))
    return _planners[key]


def paged_mla_decode_flashinfer(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """o_latent [B, h, kv_lora_rank] fp32 by FlashInfer (``kernels.mla_decode``'s contract; the call must
    be :func:`eligible`). Reads ``seq_lens`` on the host unless these tables and lengths were planned."""
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, None)
    if not q_latent.is_cuda or kv_cache.dtype not in CACHE_DTYPES or kv_lora_rank != KV_LORA_RANK or (
            kv_cache.shape[-1] != KV_LORA_RANK + ROPE_DIM):
        raise ValueError(f"FlashInfer MLA decode takes CUDA tensors and a bf16/fp16 cache of {KV_LORA_RANK} + "
                         f"{ROPE_DIM} columns, got a {kv_cache.dtype} cache {tuple(kv_cache.shape)} on "
                         f"{q_latent.device} with kv_lora_rank {kv_lora_rank}")
    q_dtype = kv_cache.dtype
    plan = _planner(q_latent.device).plan(q_dtype, kv_cache, block_tables, seq_lens, q_latent.shape[1],
                                          softmax_scale)
    out = plan.wrapper.run(  # type: ignore[attr-defined]
        q_nope=q_latent[..., :KV_LORA_RANK].to(q_dtype), q_pe=q_latent[..., KV_LORA_RANK:].to(q_dtype),
        ckv_cache=kv_cache[..., :KV_LORA_RANK], kpe_cache=kv_cache[..., KV_LORA_RANK:],
    ).float()
    return out if plan.empty is None else out.masked_fill_(plan.empty, 0.0)


def try_decode(
    q_latent: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    kv_lora_rank: int,
) -> torch.Tensor | None:
    """:func:`paged_mla_decode_flashinfer`, or None when FlashInfer failed on a case its self-test did not
    cover (a head count, a page size): ``mla_decode`` then uses Triton on this device and cache dtype from
    now on (one warning). Bad input still raises; so does any failure when ``EPSERVE_MLA_BACKEND`` forces
    FlashInfer."""
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, None)
    try:
        return paged_mla_decode_flashinfer(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)
    except SeqLensError:
        raise
    except (RuntimeError, ValueError) as e:
        if env.mla_backend() == "flashinfer":
            raise
        _fall_back(q_latent, kv_cache, e)
        return None


def paged_mla_decode_fi(
    q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    softmax_scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None, num_splits: int | None = None,
) -> torch.Tensor | None:
    """The ``paged_mla_decode`` op's FlashInfer implementation (listed where ``kernels.backends`` chose
    FlashInfer for the device and cache dtype), for a call that is :func:`eligible` (no ``num_splits``; None,
    the op runs Triton, otherwise): the captured bucket's graph-mode wrapper for its static tables (warm-up
    and capture alike), else :func:`try_decode`'s plan per call, which a capture cannot run (``NotPlanned``)."""
    if num_splits is not None or not eligible(q_latent, kv_cache, block_tables, kv_lora_rank, kv_scale):
        return None
    check_decode(q_latent, kv_cache, block_tables, seq_lens, kv_lora_rank, None)
    capturing = torch.cuda.is_current_stream_capturing()
    try:
        out = captured_decode(q_latent, kv_cache, block_tables, seq_lens, softmax_scale)
    except (NotPlanned, SeqLensError):
        raise
    except (RuntimeError, ValueError) as e:
        if capturing or env.mla_backend() == "flashinfer":
            raise
        _fall_back(q_latent, kv_cache, e)
        return None
    if out is not None:
        return out
    if capturing:
        raise NotPlanned(f"FlashInfer MLA decode inside a CUDA graph capture reads tables {tuple(block_tables.shape)} "
                         "that kernels.decode_plan.plan_replay was not given before the bucket's warm-up run")
    return try_decode(q_latent, kv_cache, block_tables, seq_lens, softmax_scale, kv_lora_rank)


def _fall_back(q_latent: torch.Tensor, kv_cache: torch.Tensor, e: BaseException) -> None:
    backends.fall_back("mla_decode", q_latent.device, kv_cache.dtype,
                       f"{tuple(q_latent.shape[:2])} rows x heads, block size {kv_cache.shape[1]}: "
                       f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}")


# ---- the self-test ------------------------------------------------------------------------------


def check_against_reference(
    impl: MLAImpl,
    device: torch.device,
    cache_dtype: torch.dtype,
    *,
    kv_lora_rank: int = KV_LORA_RANK,
    rope: int = ROPE_DIM,
    heads: tuple[int, ...] = SELF_TEST_HEADS,
    block_size: int = 16,
    q_dtype: torch.dtype | None = None,
    tolerance: float = SELF_TEST_TOLERANCE,
) -> None:
    """Run ``impl`` (an MLA decode with ``paged_mla_decode_ref``'s arguments, without ``kv_scale``) on
    small batches on ``device`` and raise ``backends.KernelMismatch`` unless it matches the reference
    within ``tolerance`` of max |v|. Lengths cover one token, part of a block, whole blocks, several
    blocks and an empty (padding) row; tables hold shuffled block ids and, past each sequence, ids of
    other blocks, so a read past a length shows. ``q_dtype``: the precision ``impl`` runs the query at
    (the reference gets the same rounded query)."""
    g = torch.Generator().manual_seed(0)
    d = kv_lora_rank + rope
    for i, h in enumerate(heads):
        lens = [1, block_size - 1, block_size, 0, 3 * block_size + 5, 9 * block_size + 7]
        need = [cdiv(n, block_size) for n in lens]
        num_blocks, width = sum(need) + 3, max(need) + 1
        perm = torch.randperm(num_blocks, generator=g)
        tables = torch.randint(0, num_blocks, (len(lens), width), generator=g)
        start = 0
        for row, n in enumerate(need):
            tables[row, :n] = perm[start : start + n]
            start += n
        cache = torch.randn(num_blocks, block_size, d, generator=g).to(cache_dtype).to(device)
        q = (torch.randn(len(lens), h, d, generator=g) * 0.5).to(device)
        tables = tables.to(device, torch.int64 if i % 2 == 0 else torch.int32)
        seq_lens = torch.tensor(lens, device=device)
        scale = (rope + 128) ** -0.5  # DeepSeek's scale before absorption (qk_head_dim 192 at full size)
        q_ref = q if q_dtype is None else q.to(q_dtype).float()
        want = paged_mla_decode_ref(q_ref, cache, tables, seq_lens, scale, kv_lora_rank)
        got = impl(q, cache, tables, seq_lens, scale, kv_lora_rank)
        if tuple(got.shape) != tuple(want.shape):
            raise backends.KernelMismatch(f"output shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        err = float((got.float() - want).abs().max())  # NaN compares False below
        bound = tolerance * float(cache.float().abs().max())
        if not err <= bound:
            raise backends.KernelMismatch(f"off the torch reference by {err:.3g} (allowed {bound:.3g}) at "
                                          f"{h} heads, lengths {lens}, block size {block_size}")


def self_test(device: torch.device, cache_dtype: torch.dtype) -> None:
    """FlashInfer's MLA decode on ``device`` for a ``cache_dtype`` cache, against the reference."""
    import_flashinfer()
    if device.type != "cuda":
        raise RuntimeError(f"FlashInfer runs on CUDA devices, not {device}")
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"{str(cache_dtype).removeprefix('torch.')} caches run on Triton (this path takes bf16/fp16)")
    check_against_reference(paged_mla_decode_flashinfer, device, cache_dtype, q_dtype=cache_dtype)


def benchmark_case(device: torch.device, cache_dtype: torch.dtype) -> tuple:
    """The timed self-test's decode at DeepSeek-V3's shapes: ``BENCH_ROWS`` rows of ``BENCH_HEADS`` heads over
    ``BENCH_TOKENS`` tokens each (a ``cache_dtype`` cache, blocks shuffled): ``paged_mla_decode``'s arguments."""
    g = torch.Generator().manual_seed(0)
    per_row = BENCH_TOKENS // BENCH_BLOCK
    blocks = BENCH_ROWS * per_row
    cache = torch.randn(blocks, BENCH_BLOCK, KV_LORA_RANK + ROPE_DIM, device=device).to(cache_dtype)
    tables = torch.randperm(blocks, generator=g).view(BENCH_ROWS, per_row).to(device)
    q = torch.randn(BENCH_ROWS, BENCH_HEADS, KV_LORA_RANK + ROPE_DIM, device=device)
    lens = torch.full((BENCH_ROWS,), BENCH_TOKENS, device=device)
    return q, cache, tables, lens, (128 + ROPE_DIM) ** -0.5, KV_LORA_RANK


def _benchmark_flashinfer(device: torch.device, cache_dtype: torch.dtype) -> Callable[[], object]:
    case = benchmark_case(device, cache_dtype)
    return lambda: paged_mla_decode_flashinfer(*case)  # planned on the first run, as a step's layers share a plan


def _benchmark_triton(device: torch.device, cache_dtype: torch.dtype) -> Callable[[], object]:
    case = benchmark_case(device, cache_dtype)
    return lambda: paged_mla_decode.without_backends(*case)  # the op's CUDA kernels without FlashInfer


OP = backends.register(backends.KernelOp(
    "mla_decode",
    (backends.KernelBackend("flashinfer", self_test, _benchmark_flashinfer),
     backends.KernelBackend("triton", benchmark=_benchmark_triton)),
    forced=env.mla_backend,
    env_var=env.MLA_BACKEND,
))
