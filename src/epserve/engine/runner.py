"""The model runner: the only place where scheduled sequences become tensors. It owns the model, the KV
cache and the captured decode steps, and runs the step's forward and the MTP passes; the tokens are
drawn by the engine's sampling pipeline (``engine/sampling.py``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

import torch

from epserve.checkpoint import as_torch_dtype
from epserve.config import EngineConfig
from epserve.engine.balancer import ExpertBalancer
from epserve.engine.batch_plan import BatchPlan, StepResult
from epserve.engine.block_tables import DeviceTables
from epserve.engine.captured import (
    CapturedDecode,
    CaptureShape,
    capture_at_start,
    probe_graph_memory,
    side_buffer_bytes,
)
from epserve.engine.graphs import DecodeGraphs
from epserve.engine.kv_handoff import KVWrite
from epserve.engine.memory import determine_num_blocks, kv_bytes_per_token, kv_cache_dtype
from epserve.engine.profiler import UNTIMED, OpProfiler, Untimed
from epserve.engine.proposer import MTPProposer
from epserve.engine.request import ScheduledChunk
from epserve.engine.sampling import SamplingPipeline
from epserve.kernels import backends as kernel_backends
from epserve.kernels import cpu as cpu_kernels
from epserve.kernels.nvfp4_w4a4 import w4a4_supported
from epserve.kernels.nvfp4_w4a16 import capturable as nvfp4_capturable
from epserve.messages.kv import KVLayout
from epserve.model.batch import ForwardBatch
from epserve.model.layers import use_w4a4
from epserve.model.load_plan import model_bytes
from epserve.model.loader import load_model
from epserve.model.quantization import resolve_fp8_weights
from epserve.moe.dispatch.select import build_dispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.comm import all_reduce_max, gather_objects
from epserve.parallel.context import ParallelContext
from epserve.parallel.overlap import choose_overlap

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``; a clear error for anything else or a missing GPU."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} does not exist ({torch.cuda.device_count()} CUDA devices)")
    return device


def capture_mode(config: EngineConfig, device: torch.device,
                 kernel_dtypes: Mapping[str, torch.dtype | None]) -> str | None:
    """``config.capture_mode``, but every step eager where a kernel op decided at start-up (``kernel_dtypes``,
    after ``kernels.backends.resolve``) cannot be captured in a CUDA graph: the NVFP4 W4A16 ops on their torch
    reference, whose experts read their counts on the host (the Triton kernels failed their self-test). The
    same on every rank: the decision read is the one the ranks agreed on. Logged in one line."""
    mode = config.capture_mode
    w4a16 = kernel_dtypes.get("nvfp4_w4a16")
    if mode == "cuda_graph" and w4a16 is not None and not nvfp4_capturable(device, w4a16):
        logger.info("decode steps: eager (not cuda_graph), since the NVFP4 W4A16 ops run their torch reference, "
                    "which reads the experts' counts on the host")
        return None
    return mode


class ModelRunner:
    def __init__(self, config: EngineConfig, ctx: ParallelContext) -> None:
        self.config = config
        self.ctx = ctx
        self.device = ctx.device
        self.dtype = as_torch_dtype(config.dtype)
        mc = config.model
        pc = config.parallel
        self.placement = ExpertPlacement.build(max(mc.n_routed_experts, 1), ctx.ep_size, pc.num_redundant_experts,
                                               pc.eplb.replica_selection, pc.local_world_size)
        self.fp8_weights = resolve_fp8_weights(config.quantization, mc, ctx.tp, self.device.type)
        self.dispatcher = build_dispatcher(config, self.placement.num_local_slots, ctx, self.fp8_weights, self.dtype)
        self.num_spec = config.num_spec_tokens  # draft tokens per decode (speculative decoding with MTP)
        self.model = load_model(mc, config.model_path, self.dtype, self.device, self.dispatcher, self.placement, ctx,
                                self.fp8_weights, mtp=self.num_spec > 0)
        moes = self.model.moe_layers()
        self.balancer = ExpertBalancer(moes, ctx, pc.eplb, pc.nnodes, mc.n_group) if moes else None
        self.num_cache_layers = mc.num_hidden_layers + (1 if self.num_spec else 0)  # the MTP layer's own cache
        self.weight_bytes = weight_bytes = model_bytes(self.model)
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_dtype(config.cache, self.dtype)
        # kernel backends decided (self-tests run) now: before the KV pool is sized and any graph captured;
        # on GPUs every rank then runs the same ones (a timed choice may differ between ranks)
        nvfp4_cuda = mc.is_nvfp4 and self.device.type == "cuda"
        kernel_dtypes = {"mla_decode": self.kv_dtype, "fp8_gemm": self.dtype if self.fp8_weights else None,
                         "nvfp4_gemm": self.dtype if nvfp4_cuda else None,
                         "nvfp4_w4a16": self.dtype if nvfp4_cuda else None}
        logger.info("kernels: %s", kernel_backends.resolve(self.device, kernel_dtypes))
        if self.device.type == "cuda" and ctx.distributed:
            kernel_backends.agree(self.device, kernel_dtypes, lambda mine: gather_objects(mine, ctx))
        if nvfp4_cuda and w4a4_supported(self.device, self.dtype):  # FP4 tensor cores (sm100): W4A4
            logger.info("NVFP4 linears and routed experts run W4A4 (%d modules; EPSERVE_NVFP4_BACKEND=triton keeps "
                        "W4A16)", use_w4a4(self.model))
        max_blocks = config.scheduler.max_num_seqs * -(-config.max_model_len // self.block_size)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.overlap = pc.overlap
        self.microbatch_threshold = pc.microbatch_threshold or (256 if self.device.type == "cuda" else None)
        mode = capture_mode(config, self.device, kernel_dtypes)  # None with all_to_all: it syncs with the host
        if mode == "cpu_graph" and not self._cpu_graph_applies():
            mode = None  # its decode steps would make torch ops, which the recording refuses: eager
        # rows: one per decode, 1 + k with speculative decoding (each verified draft is a decode row)
        max_batch = config.cuda_graph_max_bs or min(config.scheduler.max_num_seqs * (1 + self.num_spec), 256)
        self.capture_shape = CaptureShape(
            max_batch, self.block_size, self.max_blocks_per_seq, mc.hidden_size, self.dtype, self.device,
            lambda tokens: self._step_shape(tokens)[1],  # type: ignore[arg-type,return-value]
            lambda b: self.dispatcher.begin_step(-(-b // ctx.tp)))
        table_rows = config.scheduler.max_num_seqs + 1  # a row per running request, and the padding row
        graph_bytes = side_buffer_bytes(self.capture_shape, mode, self.num_spec > 0, self.kv_dtype, table_rows)
        if mode == "cuda_graph":
            graph_bytes += probe_graph_memory(self.model, self._kv_pool, self.capture_shape, self.num_spec > 0)
        cache = config.cache
        if self.device.type == "cpu" and pc.local_world_size > 1:  # ranks on one host share its memory
            cache = replace(cache, memory_utilization=cache.memory_utilization / pc.local_world_size,
                            memory_fraction=cache.memory_fraction and cache.memory_fraction / pc.local_world_size)
        # the dispatcher's buffers (NVSHMEM's symmetric ones) are resident already, as the weights are
        resident = weight_bytes + self.dispatcher.workspace_bytes()
        num_blocks = determine_num_blocks(mc, cache, self.kv_dtype, self.device, resident, max_blocks,
                                          self.num_cache_layers, reserved_bytes=graph_bytes)
        self.num_blocks = -all_reduce_max([-num_blocks], ctx)[0]  # every rank agrees: the smallest pool
        # One block more than the scheduler hands out: the sink padding rows of a captured decode write to.
        self.kv_caches = self._kv_pool(self.num_blocks + 1)
        self.sink_slot = self.num_blocks * self.block_size
        # each running request's block table, kept on the device (``engine/block_tables.py``)
        self.tables = DeviceTables(self.max_blocks_per_seq, self.num_blocks, self.device, table_rows)
        info = self.cache_info()
        logger.info("KV cache: %d blocks of %d tokens, %d bytes per token (%s), %.1f MiB", info["num_blocks"],
                    info["block_size"], info["bytes_per_token"], info["kv_cache_dtype"],
                    self.num_blocks * self.block_size * info["bytes_per_token"] / 2**20)
        self.proposer = None if not self.num_spec else MTPProposer(
            self.model, self.kv_caches, self.dispatcher, ctx, self.block_size, self.num_spec, config.max_model_len)
        if self.proposer is not None:
            self.proposer.tables = self.tables  # its eager passes read their plans' table rows there
        self.profiler: OpProfiler | Untimed = UNTIMED
        # the logits of every row of the last forward [num_tokens, V] fp32 where its captured step computed them
        # (a CPU graph's head), else None: the sampling pipeline runs the head
        self.logits: torch.Tensor | None = None
        self.captured: CapturedDecode | None = None
        self.decode_graphs: DecodeGraphs | None = None
        if mode is not None:
            self.captured = CapturedDecode(self.model, self.kv_caches, mode, self.capture_shape, self.num_spec > 0,
                                           self.tables)
            self.decode_graphs = self.captured.graphs
            if self.proposer is not None:
                self.proposer.replay = self.captured.draft
                self.proposer.replay_logits = self.captured.draft_logits
            logger.info("decode steps: %s for batch buckets %s%s", mode, self.decode_graphs.buckets,
                        " (and the MTP passes)" if self.captured.drafts else "")
            if mode == "cuda_graph":
                capture_at_start(self.captured, graph_bytes)

    def _cpu_graph_applies(self) -> bool:
        """Whether this CPU engine's decode steps are made of C kernels alone (what ``cpu_graph`` records):
        the kernels built for its dtype, its weights and KV cache in that dtype (FP8 runs torch references)."""
        return (cpu_kernels.available(cpu_kernels.OPS) and cpu_kernels.available(self.dtype) and not self.fp8_weights
                and self.kv_dtype == self.dtype)

    def _kv_pool(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (num_blocks, self.block_size, self.config.model.kv_cache_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_cache_layers)]

    def _replay_bucket(self, global_max_tokens: int, all_decode: bool, overlap: str) -> int | None:
        """The captured bucket every rank replays this step (the same one: from the step's all-reduce)."""
        if self.captured is None or not all_decode or overlap == "microbatch" or self.profiler.enabled:
            return None
        return self.captured.graphs.bucket_for(global_max_tokens)

    def cache_info(self) -> dict[str, int | str]:
        """The paged latent cache of this rank: blocks, tokens per block, bytes per token over all layers,
        and the element type (``fp8_e4m3`` or the model dtype)."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_token": kv_bytes_per_token(self.config.model, self.kv_dtype, self.num_cache_layers),
            "kv_cache_dtype": ("fp8_e4m3" if self.kv_dtype == torch.float8_e4m3fn
                               else str(self.kv_dtype).removeprefix("torch.")),
        }

    def kv_layout(self) -> KVLayout:
        cache = self.kv_caches[0]
        return KVLayout(len(self.kv_caches), self.block_size, cache.shape[-1] * cache.element_size(),
                        str(self.cache_info()["kv_cache_dtype"]))

    @torch.inference_mode()
    def read_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks of every cached layer as stored, on the host: uint8 ``[layers, blocks, block_size,
        token_bytes]`` (FP8 as its bytes; the latent cache is the same on every TP rank)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([cache.view(torch.uint8)[index] for cache in self.kv_caches]).cpu()

    @torch.inference_mode()
    def write_kv(self, writes: tuple[KVWrite, ...]) -> None:
        """Blocks that arrived from a prefill instance, into the cache (every rank of the DP group)."""
        for write in writes:
            index = torch.tensor(write.block_ids, dtype=torch.long, device=self.device)
            data = write.data.to(self.device)
            for layer, cache in enumerate(self.kv_caches):
                cache.view(torch.uint8).index_copy_(0, index, data[layer])

    def set_profiling(self, enabled: bool) -> None:
        """Time every op of every step from now on (a fresh record), or stop."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.profiler = OpProfiler(sync) if enabled else UNTIMED
        self.model.set_op_hook(self.profiler.timed if enabled else None)

    # ---- one step -----------------------------------------------------------------------------
    def forward(self, plan: BatchPlan, global_max_tokens: int, all_decode: bool = False) -> torch.Tensor:
        """Every rank, every step (the empty plan on an idle DP group): the final hidden states of every
        token, ``[plan.num_tokens, H]``. ``global_max_tokens``: the most tokens
        any DP group runs this step, ``all_decode``: whether every DP group's batch is pure decode (from
        the step's all-reduce; then every rank can run the same captured bucket). A recorded CPU step leaves
        its rows' logits in :attr:`logits` too. In inference mode (entered here once, not again below)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return ModelRunner.forward(self, plan, global_max_tokens, all_decode)  # (this body, not a wrapper)
        self.tables.apply(plan.table_appends)  # the blocks its requests gained since their last step
        per_rank, overlap = self._step_shape(global_max_tokens)
        bucket = self._replay_bucket(global_max_tokens, all_decode, overlap)
        self.logits = None
        if bucket is not None:
            hidden = self.captured.forward(plan, bucket, overlap)  # type: ignore[union-attr,arg-type]
            self.logits = self.captured.logits(plan.num_tokens)  # type: ignore[union-attr]
            return hidden
        self.dispatcher.begin_step(per_rank)
        batch = plan.to_batch(self.device, self.block_size, self.tables)
        num_seqs = len(plan.seq_lens)
        self.profiler.begin_step(plan.num_tokens, num_seqs, plan.num_decode_seqs == num_seqs, overlap)
        return self.profiler.timed("forward", self._forward, batch, overlap)  # type: ignore[return-value]

    def _step_shape(self, global_max_tokens: int) -> tuple[int, str]:
        """The most tokens a rank feeds one MoE layer this step, and the overlap schedule it runs."""
        per_rank = -(-global_max_tokens // self.ctx.tp)
        return per_rank, choose_overlap(self.overlap, per_rank, self.microbatch_threshold)

    def _forward(self, batch: ForwardBatch, overlap: str) -> torch.Tensor:
        return self.model(batch, self.kv_caches, overlap)

    def propose(self, chunks: list[ScheduledChunk], plan: BatchPlan, result: StepResult | None, hidden: torch.Tensor,
                global_max_tokens: int, all_decode: bool, sampling: SamplingPipeline) -> dict[str, list[int]]:
        """Every rank, after the leader's sampling when speculative decoding is on: the MTP layer's passes
        (``engine/proposer.py``; captured when the step is): the leader's drafts per request, drawn by
        ``sampling``."""
        assert self.proposer is not None
        per_rank, overlap = self._step_shape(global_max_tokens)
        bucket = self._replay_bucket(global_max_tokens, all_decode, overlap)
        args = (chunks, plan, result, hidden, per_rank, overlap, bucket, sampling)
        return self.profiler.timed("mtp_draft", self.proposer.propose, *args)  # type: ignore[return-value]

    def expert_load(self, since_rebalance: bool = False) -> tuple[tuple[int, ...], torch.Tensor]:
        """The MoE layers (the MTP layer's too) and the token copies this rank received per (layer,
        logical expert) since start-up or the last reset (or rebalance): ``[layers, n_logical]``."""
        if self.balancer is None:
            return (), torch.zeros(0, self.placement.num_logical_experts, dtype=torch.long)
        return self.balancer.layers, self.balancer.counters(since_rebalance).cpu()
