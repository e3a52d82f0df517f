"""The model runner: the only place where scheduled sequences become tensors."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from epserve.checkpoint import as_torch_dtype
from epserve.config import EngineConfig
from epserve.engine.memory import determine_num_blocks
from epserve.engine.sampler import Sampler, TokenLogprobs
from epserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from epserve.model.batch import ForwardBatch
from epserve.model.loader import load_model
from epserve.moe.dispatch.local import LocalDispatcher
from epserve.moe.placement import ExpertPlacement

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


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = as_torch_dtype(config.dtype)
        mc = config.model
        placement = ExpertPlacement.build(max(mc.n_routed_experts, 1), ep_size=1)
        dispatcher = LocalDispatcher(placement.num_local_slots)
        self.model = load_model(mc, config.model_path, self.dtype, self.device, dispatcher, placement)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.block_size = config.cache.block_size
        max_blocks = config.scheduler.max_num_seqs * -(-config.max_model_len // self.block_size)
        self.num_blocks = determine_num_blocks(
            mc, config.cache, self.dtype, self.device, weight_bytes, max_blocks
        )
        self.kv_caches = [
            torch.zeros(self.num_blocks, self.block_size, mc.kv_cache_dim, dtype=self.dtype, device=self.device)
            for _ in range(mc.num_hidden_layers)
        ]
        self.sampler = Sampler(self.device)
        self._generators: dict[str, torch.Generator] = {}

    # ---- tensors from sequences ---------------------------------------------------------------
    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """``chunks`` must list single-token (decode) chunks first."""
        bs = self.block_size
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
            slots.extend(chunk.slot_ids(bs))
            query_start.append(query_start[-1] + chunk.num_tokens)
            seq_lens.append(chunk.end)
            if chunk.needs_sample:
                logits_idx.append(query_start[-1] - 1)
            num_decode += chunk.num_tokens == 1
        max_blocks = max(-(-n // bs) for n in seq_lens)
        tables = [c.request.block_ids[:max_blocks] for c in chunks]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]

        def t(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return ForwardBatch(
            input_ids=t(input_ids),
            positions=t(positions),
            slot_mapping=t(slots),
            seq_lens=t(seq_lens),
            block_tables=t(tables),
            logits_indices=t(logits_idx),
            num_decode_seqs=num_decode,
            seq_lens_cpu=tuple(seq_lens),
            query_start_loc_cpu=tuple(query_start),
            block_size=bs,
        )

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> StepResult:
        chunks = sorted(output.chunks, key=lambda c: c.num_tokens != 1)  # decodes first, stable
        batch = self.build_batch(chunks)
        hidden = self.model(batch, self.kv_caches)
        sampling = [c for c in chunks if c.needs_sample]
        if not sampling:
            return StepResult({}, {})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
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
