"""FlashInfer's MLA decode inside a captured decode step: one ``BatchMLAPagedAttentionWrapper`` in its CUDA-graph
mode per captured bucket, planned before every replay through ``kernels.decode_plan``.

FlashInfer plans on the host (it reads the lengths there and builds a work schedule), which a captured graph
cannot do at replay. In its CUDA-graph mode (``use_cuda_graph=True``) a wrapper keeps fixed device buffers
(``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_len_arr``, its schedule) whose addresses the captured
``run()`` reads; ``plan()``, called outside the graph before each replay, rewrites their contents. vLLM and SGLang
run it so; this is the same scheme behind the project's hooks:

- :func:`plan_captured` is registered with ``kernels.decode_plan``: the captured decode (``engine/graphs.py``)
  calls it with the bucket's static tables and lengths (the device tensors the graph reads, already holding the
  step's values; held weakly, so they must be the tensors the graph keeps, not a temporary view of them) and
  the same lengths on the host, before the bucket's warm-up run and capture, and before every replay. It
  remembers the bucket by its static tensors and replans each wrapper made for it.
- :func:`captured_decode` is what ``mla_flashinfer.paged_mla_decode_fi`` runs for a call whose tables and
  lengths are (rows of) a planned bucket's static tensors: the warm-up run makes the bucket's wrapper (its
  buffers sized for the bucket's rows and table width: at most every row's table) and runs it, the capture
  records the same ``run()``, and replays read what the latest plan wrote. A call with other tensors (an eager
  step) is not this module's: it plans per call. A call inside a capture whose wrapper the warm-up did not make
  raises (:class:`NotPlanned`): there is nothing to plan there.

Planning reads nothing from the device: ``kv_indptr`` and the lengths are built on the host from the host
lengths (O(bucket)), ``kv_indices`` on the device from the static block table (:func:`graph_pages`: each page's
row found by a search of the device copy of ``kv_indptr``). A row of length 0 (padding) reads one token of its
first table entry (the sink block) and its output is zeroed by a mask the plan rewrites. FlashInfer's plan writes
its schedule into a pinned host buffer and copies it to the device asynchronously, without waiting: a wrapper's
next plan first waits for the copy its previous plan enqueued (an event, normally long complete), so a plan
never overwrites a schedule still on its way to the device. Plans and replays are ordered on one stream.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import ModuleType

import torch

from epserve.kernels.decode_plan import DecodeReplay, register
from epserve.kernels.device import is_cuda

KV_LORA_RANK, ROPE_DIM = 512, 64  # the shapes FlashInfer's MLA kernels are built for (DeepSeek-V2/V3)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partial outputs), per device
INT_WORKSPACE_BYTES = 8 << 20  # the int workspace (its schedule) each wrapper allocates for itself


class SeqLensError(ValueError):
    """``seq_lens`` outside what the block tables hold (bad input, never a reason to change backends)."""


class NotPlanned(RuntimeError):
    """FlashInfer MLA decode reached inside a CUDA graph capture without a wrapper planned for its tables."""


def import_flashinfer() -> ModuleType:
    """``flashinfer.mla`` (ImportError when the optional package or its CUDA dependencies are missing)."""
    import flashinfer.mla

    return flashinfer.mla


_workspaces: dict[str, torch.Tensor] = {}


def workspace(device: torch.device) -> torch.Tensor:
    """The device's float workspace, shared by every wrapper on it (their runs are ordered on one stream)."""
    key = str(device) if device.index is not None else f"cuda:{torch.cuda.current_device()}"
    if key not in _workspaces:
        _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=key)
    return _workspaces[key]


def backend_for(device: torch.device) -> str:
    """The FlashInfer kernel family pinned for ``device`` ("auto" may choose per request; the self-tested kernel is
    the one every call runs): FA3 on Hopper, FA2 elsewhere."""
    major, _ = torch.cuda.get_device_capability(device)
    return "fa3" if major == 9 else "fa2"


# ---- the plan's indices ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PageLayout:
    """One plan's inputs: ``read`` tokens per row (host int32; an empty row reads 1), ``kv_indptr`` [rows + 1]
    (host int32), ``empty`` [rows] (host bool: rows of length 0), ``pages`` in all."""

    read: torch.Tensor
    kv_indptr: torch.Tensor
    empty: torch.Tensor
    pages: int


def page_layout(host_lens: tuple[int, ...], block_size: int, width: int) -> PageLayout:
    """The host side of a plan from the host lengths alone (O(rows)); lengths past ``width`` blocks raise."""
    if any(n < 0 or n > width * block_size for n in host_lens):
        raise SeqLensError(f"seq_lens {list(host_lens)} must lie in [0, {width * block_size}] "
                           f"({width} blocks of {block_size} tokens per row)")
    read = [max(n, 1) for n in host_lens]
    indptr = [0]
    for n in read:
        indptr.append(indptr[-1] + -(-n // block_size))
    return PageLayout(torch.tensor(read, dtype=torch.int32), torch.tensor(indptr, dtype=torch.int32),
                      torch.tensor([n == 0 for n in host_lens], dtype=torch.bool), indptr[-1])


def graph_pages(block_tables: torch.Tensor, kv_indptr: torch.Tensor, pages: int) -> torch.Tensor:
    """FlashInfer's ``kv_indices`` on ``block_tables``' device, without a host sync: row i's first
    ``kv_indptr[i + 1] - kv_indptr[i]`` table entries, rows one after another (int32, ``pages`` of them).
    ``kv_indptr`` is the host's; each page's row is found by a search of its copy on the device."""
    device = block_tables.device
    bounds = kv_indptr.to(device, torch.int64, non_blocking=True)
    page = torch.arange(pages, device=device)
    row = torch.searchsorted(bounds[1:], page, right=True)
    col = page - bounds[row]
    return block_tables[row, col].to(torch.int32)


# ---- the captured buckets and their wrappers --------------------------------------------------------


def wrapper_bytes(rows: int, width: int) -> int:
    """Device bytes a graph-mode wrapper of ``rows`` rows over tables ``width`` blocks wide holds beside the
    shared workspace: its int workspace, ``kv_indices`` (every table entry) and the row-sized buffers. Allocated
    by a bucket's warm-up run, outside the graphs' pool: the memory plan counts them for every captured bucket
    where FlashInfer decodes."""
    return INT_WORKSPACE_BYTES + 4 * rows * width + 4 * (3 * rows + 2) + rows


@dataclass(frozen=True)
class AttentionShape:
    """What a wrapper is planned for besides the lengths (one per attention configuration the forward runs)."""

    first: int  # the first row of the bucket the calls read (micro-batches read a part)
    rows: int
    num_heads: int
    softmax_scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


class GraphWrapper:
    """A CUDA-graph-mode wrapper and its fixed buffers, for ``shape.rows`` rows of one captured bucket."""

    def __init__(self, device: torch.device, shape: AttentionShape, width: int) -> None:
        rows = shape.rows  # (wrapper_bytes counts what is allocated here)
        self.shape = shape
        self.kv_indices = torch.empty(rows * width, dtype=torch.int32, device=device)  # at most every table entry
        self.empty = torch.zeros(rows, 1, 1, dtype=torch.bool, device=device)
        buffers = {"qo_indptr": torch.arange(rows + 1, dtype=torch.int32, device=device),
                   "kv_indptr": torch.zeros(rows + 1, dtype=torch.int32, device=device),
                   "kv_indices": self.kv_indices,
                   "kv_len_arr": torch.ones(rows, dtype=torch.int32, device=device)}
        self.buffers = buffers
        self.copied: torch.cuda.Event | None = None  # recorded after the latest plan's copies were enqueued
        self.wrapper = import_flashinfer().BatchMLAPagedAttentionWrapper(
            workspace(device), use_cuda_graph=True, backend=backend_for(device), **buffers)

    def plan(self, block_tables: torch.Tensor, host_lens: tuple[int, ...], block_size: int) -> None:
        """Rewrite the buffers and the schedule for the bucket's lengths (this wrapper's rows), reading nothing
        from the device."""
        s = self.shape
        tables = block_tables[s.first : s.first + s.rows]
        layout = page_layout(host_lens[s.first : s.first + s.rows], block_size, tables.shape[1])
        if self.copied is not None:
            self.copied.synchronize()  # the pinned schedule the previous plan copies from is about to be rewritten
        self.wrapper.plan(  # type: ignore[attr-defined]
            qo_indptr=torch.arange(s.rows + 1, dtype=torch.int32), kv_indptr=layout.kv_indptr,
            kv_indices=graph_pages(tables, layout.kv_indptr, layout.pages), kv_len_arr=layout.read,
            num_heads=s.num_heads, head_dim_ckv=KV_LORA_RANK, head_dim_kpe=ROPE_DIM, page_size=block_size, causal=False,
            sm_scale=s.softmax_scale, q_data_type=s.q_dtype, kv_data_type=s.kv_dtype,
        )
        self.empty.copy_(layout.empty.view(-1, 1, 1), non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def run(self, q_latent: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """o_latent [rows, h, 512] fp32 from the buffers the latest plan wrote (what a capture records)."""
        dtype = self.shape.q_dtype
        out = self.wrapper.run(  # type: ignore[attr-defined]
            q_nope=q_latent[..., :KV_LORA_RANK].to(dtype), q_pe=q_latent[..., KV_LORA_RANK:].to(dtype),
            ckv_cache=kv_cache[..., :KV_LORA_RANK], kpe_cache=kv_cache[..., KV_LORA_RANK:],
        ).float()
        return out.masked_fill_(self.empty, 0.0)


@dataclass
class CapturedBucket:
    """One captured bucket's static tables and lengths (weakly held: a bucket dies with its graph), the latest
    host lengths planned, and the wrappers its forward runs."""

    tables: weakref.ref
    lens: weakref.ref
    host_lens: tuple[int, ...]
    block_size: int
    wrappers: dict[AttentionShape, GraphWrapper] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.tables() is not None and self.lens() is not None


_buckets: dict[tuple[int, int], CapturedBucket] = {}  # (tables' storage, lengths' storage) -> the bucket


def _storage_key(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    return block_tables.untyped_storage().data_ptr(), seq_lens.untyped_storage().data_ptr()


def plan_captured(replay: DecodeReplay) -> None:
    """``kernels.decode_plan``'s planner: remember the bucket (CUDA tables only: a CPU graph has nothing to
    plan) and replan its wrappers for this step's host lengths (nothing read from the device)."""
    if not is_cuda(replay.block_tables):
        return
    bucket = remember(replay)
    for wrapper in bucket.wrappers.values():
        wrapper.plan(replay.block_tables, bucket.host_lens, bucket.block_size)


def remember(replay: DecodeReplay) -> CapturedBucket:
    """The bucket of ``replay``'s static tensors (new, or the one remembered for them) holding its host lengths."""
    key = _storage_key(replay.block_tables, replay.seq_lens)
    bucket = _buckets.get(key)
    if bucket is None or not bucket.alive() or bucket.tables().shape != replay.block_tables.shape:  # type: ignore
        for stale in [k for k, b in _buckets.items() if not b.alive()]:
            del _buckets[stale]
        bucket = _buckets[key] = CapturedBucket(weakref.ref(replay.block_tables), weakref.ref(replay.seq_lens),
                                                replay.host_seq_lens, replay.block_size)
    bucket.host_lens, bucket.block_size = tuple(replay.host_seq_lens), replay.block_size
    return bucket


def planned_rows(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[CapturedBucket, int] | None:
    """The planned bucket whose static tensors these are (or whose rows ``first:first + n`` they view), and
    ``first``; None for tensors of no captured bucket. Shapes and addresses only."""
    bucket = _buckets.get(_storage_key(block_tables, seq_lens))
    if bucket is None or not bucket.alive():
        return None
    tables, lens = bucket.tables(), bucket.lens()
    assert tables is not None and lens is not None
    offset = block_tables.storage_offset() - tables.storage_offset()
    if block_tables.stride() != tables.stride() or block_tables.shape[1] != tables.shape[1] or (
            offset % tables.stride(0)):
        return None
    first = offset // tables.stride(0)
    if seq_lens.storage_offset() - lens.storage_offset() != first * lens.stride(0) or (
            first + block_tables.shape[0] > tables.shape[0]):
        return None
    return bucket, first


def captured_decode(q_latent: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, softmax_scale: float) -> torch.Tensor | None:
    """o_latent [B, h, 512] fp32 by the graph-mode wrapper of the planned bucket these tables and lengths belong
    to (made, and planned from the bucket's latest host lengths, on its first call: the warm-up run); None for
    tensors of no planned bucket. Inside a capture, a wrapper not made before raises :class:`NotPlanned`."""
    found = planned_rows(block_tables, seq_lens)
    if found is None:
        return None
    bucket, first = found
    shape = AttentionShape(first, block_tables.shape[0], q_latent.shape[1], softmax_scale, kv_cache.dtype,
                           kv_cache.dtype)
    wrapper = bucket.wrappers.get(shape)
    if wrapper is None:
        if torch.cuda.is_current_stream_capturing():
            raise NotPlanned(f"FlashInfer MLA decode of {shape.rows} rows x {shape.num_heads} heads was first "
                             "reached inside a CUDA graph capture: run the bucket once before capturing it")
        tables = bucket.tables()
        assert tables is not None
        wrapper = GraphWrapper(q_latent.device, shape, tables.shape[1])
        wrapper.plan(tables, bucket.host_lens, bucket.block_size)
        bucket.wrappers[shape] = wrapper
    return wrapper.run(q_latent, kv_cache)


register(plan_captured)
