"""The model runner: the only place where scheduled sequences become tensors."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from epserve.checkpoint import as_torch_dtype
from epserve.config import EngineConfig
from epserve.engine.graphs import DecodeGraphs, pad_decode
from epserve.engine.memory import determine_num_blocks, kv_bytes_per_token, kv_cache_dtype
from epserve.engine.profiler import OpProfiler
from epserve.engine.sampler import Sampler, TokenLogprobs
from epserve.engine.scheduler import ScheduledChunk
from epserve.model.batch import ForwardBatch
from epserve.model.loader import load_model, model_bytes
from epserve.model.quantization import resolve_fp8_weights
from epserve.moe.dispatch.all_to_all import AllToAllDispatcher
from epserve.moe.dispatch.base import Dispatcher
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.dispatch.padded import PaddedDispatcher
from epserve.moe.placement import ExpertPlacement
from epserve.parallel.comm import all_reduce_max
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


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]


@dataclass(frozen=True)
class BatchPlan:
    """One step's batch on the host, as the leader broadcasts it to its TP peers (see ForwardBatch
    for the fields). An idle DP group runs the empty plan."""

    input_ids: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    slot_mapping: tuple[int, ...] = ()
    seq_lens: tuple[int, ...] = ()
    block_tables: tuple[tuple[int, ...], ...] = ()
    logits_indices: tuple[int, ...] = ()
    query_start_loc: tuple[int, ...] = (0,)
    num_decode_seqs: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def from_chunks(cls, chunks: list[ScheduledChunk], block_size: int) -> BatchPlan:
        """``chunks`` as the scheduler orders them: decodes (``ScheduledChunk.is_decode``) first."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_idx: list[int] = []
        num_decode = 0
        for chunk in chunks:
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.end))
            slots.extend(chunk.slot_ids(block_size))
            query_start.append(query_start[-1] + chunk.num_tokens)
            seq_lens.append(chunk.end)
            if chunk.needs_sample:
                logits_idx.append(query_start[-1] - 1)
            num_decode += chunk.is_decode
        max_blocks = max((-(-n // block_size) for n in seq_lens), default=0)
        tables = tuple(
            (*ids, *(0,) * (max_blocks - len(ids))) for ids in (c.request.block_ids[:max_blocks] for c in chunks)
        )
        return cls(tuple(input_ids), tuple(positions), tuple(slots), tuple(seq_lens), tables, tuple(logits_idx),
                   tuple(query_start), num_decode)

    def to_batch(self, device: torch.device, block_size: int) -> ForwardBatch:
        def t(values: object) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        tables = t(self.block_tables) if self.block_tables else torch.zeros(0, 0, dtype=torch.long, device=device)
        return ForwardBatch(
            input_ids=t(self.input_ids),
            positions=t(self.positions),
            slot_mapping=t(self.slot_mapping),
            seq_lens=t(self.seq_lens),
            block_tables=tables,
            logits_indices=t(self.logits_indices),
            num_decode_seqs=self.num_decode_seqs,
            seq_lens_cpu=self.seq_lens,
            query_start_loc_cpu=self.query_start_loc,
            block_size=block_size,
        )


def build_dispatcher(name: str, num_local_slots: int, ctx: ParallelContext) -> Dispatcher:
    """``local`` for EP = 1 (whatever was asked: there is nobody to send to); ``padded``, or
    ``all_to_all`` (also for ``auto``), across ranks."""
    if ctx.ep_size == 1:
        return LocalDispatcher(num_local_slots)
    if name == "padded":
        return PaddedDispatcher(num_local_slots, ctx.ep_group)
    return AllToAllDispatcher(num_local_slots, ctx.ep_group)


class ModelRunner:
    def __init__(self, config: EngineConfig, ctx: ParallelContext) -> None:
        self.config = config
        self.ctx = ctx
        self.device = ctx.device
        self.dtype = as_torch_dtype(config.dtype)
        mc = config.model
        pc = config.parallel
        self.placement = ExpertPlacement.build(max(mc.n_routed_experts, 1), ctx.ep_size, pc.num_redundant_experts)
        self.dispatcher = build_dispatcher(pc.dispatch, self.placement.num_local_slots, ctx)
        self.fp8_weights = resolve_fp8_weights(config.quantization, mc, ctx.tp, self.device.type)
        self.model = load_model(mc, config.model_path, self.dtype, self.device, self.dispatcher, self.placement, ctx,
                                self.fp8_weights)
        self.weight_bytes = weight_bytes = model_bytes(self.model)
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_dtype(config.cache, self.dtype)
        max_blocks = config.scheduler.max_num_seqs * -(-config.max_model_len // self.block_size)
        cache = config.cache
        if self.device.type == "cpu" and pc.local_world_size > 1:  # ranks on one host share its memory
            cache = replace(cache, memory_utilization=cache.memory_utilization / pc.local_world_size)
        num_blocks = determine_num_blocks(mc, cache, self.kv_dtype, self.device, weight_bytes, max_blocks)
        self.num_blocks = -all_reduce_max([-num_blocks], ctx)[0]  # every rank agrees: the smallest pool
        # One block more than the scheduler hands out: the sink padding rows of a captured decode write to.
        self.kv_caches = [
            torch.zeros(self.num_blocks + 1, self.block_size, mc.kv_cache_dim, dtype=self.kv_dtype, device=self.device)
            for _ in range(mc.num_hidden_layers)
        ]
        self.sink_slot = self.num_blocks * self.block_size
        info = self.cache_info()
        logger.info("KV cache: %d blocks of %d tokens, %d bytes per token (%s), %.1f MiB", info["num_blocks"],
                    info["block_size"], info["bytes_per_token"], info["kv_cache_dtype"],
                    self.num_blocks * self.block_size * info["bytes_per_token"] / 2**20)
        self.overlap = pc.overlap
        self.microbatch_threshold = pc.microbatch_threshold or (256 if self.device.type == "cuda" else None)
        self.sampler = Sampler(self.device)
        self._generators: dict[str, torch.Generator] = {}
        self.profiler: OpProfiler | None = None
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        self.decode_graphs: DecodeGraphs | None = None
        mode = config.capture_mode  # None with all_to_all: its count exchange syncs with the host
        if mode is not None:
            max_batch = config.cuda_graph_max_bs or min(config.scheduler.max_num_seqs, 256)
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, max_batch, mode,  # type: ignore[arg-type]
                                              on_bucket=lambda b: self.dispatcher.begin_step(-(-b // ctx.tp)))
            logger.info("decode steps: %s for batch buckets %s", mode, self.decode_graphs.buckets)

    def cache_info(self) -> dict[str, int | str]:
        """The paged latent cache of this rank: blocks, tokens per block, bytes per token over all layers,
        and the element type (``fp8_e4m3`` or the model dtype)."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_token": kv_bytes_per_token(self.config.model, self.kv_dtype),
            "kv_cache_dtype": "fp8_e4m3" if self.kv_dtype == torch.float8_e4m3fn else str(self.kv_dtype).removeprefix("torch."),
        }

    def set_profiling(self, enabled: bool) -> None:
        """Time every op of every step from now on (a fresh record), or stop."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        self.profiler = OpProfiler(sync) if enabled else None
        self.model.set_op_hook(self.profiler.timed if self.profiler is not None else None)

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, plan: BatchPlan, global_max_tokens: int, all_decode: bool = False) -> torch.Tensor:
        """Every rank, every step (the empty plan on an idle DP group): the final hidden states of the
        tokens to sample from, ``[len(plan.logits_indices), H]``. ``global_max_tokens``: the most tokens
        any DP group runs this step, ``all_decode``: whether every DP group's batch is pure decode (from
        the step's all-reduce; then every rank can run the same captured bucket)."""
        per_rank = -(-global_max_tokens // self.ctx.tp)
        overlap = choose_overlap(self.overlap, per_rank, self.microbatch_threshold)
        graphs = self.decode_graphs
        bucket = graphs.bucket_for(global_max_tokens) if graphs is not None and all_decode else None
        if bucket is not None and overlap != "microbatch" and self.profiler is None:
            inputs = pad_decode(plan.input_ids, plan.positions, plan.slot_mapping, plan.seq_lens, plan.block_tables,
                                bucket, self.max_blocks_per_seq, self.sink_slot, self.device)
            hidden = graphs.run(inputs, overlap)  # type: ignore[union-attr]
            return hidden[torch.tensor(plan.logits_indices, dtype=torch.long, device=self.device)]
        self.dispatcher.begin_step(per_rank)
        batch = plan.to_batch(self.device, self.block_size)
        if self.profiler is None:
            return self._forward(batch, overlap)
        num_seqs = len(plan.seq_lens)
        self.profiler.begin_step(plan.num_tokens, num_seqs, plan.num_decode_seqs == num_seqs, overlap)
        return self.profiler.timed("forward", self._forward, batch, overlap)  # type: ignore[return-value]

    def _forward(self, batch: ForwardBatch, overlap: str) -> torch.Tensor:
        return self.model(batch, self.kv_caches, overlap)[batch.logits_indices]

    def sample(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> StepResult:
        """Leader only: logits and sampling for the chunks that reach their last known token, whose
        final hidden states ``forward`` returned (in chunk order)."""
        if self.profiler is None:
            return self._sample(chunks, hidden)
        return self.profiler.timed("sample", self._sample, chunks, hidden)  # type: ignore[return-value]

    @torch.inference_mode()
    def _sample(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> StepResult:
        sampling = [c for c in chunks if c.needs_sample]
        if not sampling:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden)
        params = [c.request.sampling_params for c in sampling]
        gens = [self._generator(c.request.request_id, p.seed) for c, p in zip(sampling, params)]
        out = self.sampler.sample(logits, params, gens)
        ids = [c.request.request_id for c in sampling]
        logprobs = {rid: lp for rid, lp in zip(ids, out.logprobs) if lp is not None}
        return StepResult(dict(zip(ids, out.token_ids)), logprobs)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = self.sampler.make_generator(seed)
        return gen

    def release(self, request_id: str) -> None:
        """Forget per-request state (its sampling generator) once it finished."""
        self._generators.pop(request_id, None)

    def expert_load(self) -> torch.Tensor:
        """Tokens received per (MoE layer, local slot) since start-up: [num_moe_layers, num_local_slots]."""
        loads = [layer.mlp.expert_load.cpu() for layer in self.model.layers if layer.is_moe]
        return torch.stack(loads) if loads else torch.zeros(0, self.placement.num_local_slots, dtype=torch.long)
