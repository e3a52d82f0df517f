"""Prefill: one forward over whole prompts (MHA-form MLA), priced with the same stage lists.

``prompts_per_gpu`` prompts of ``prompt_len`` tokens per GPU (default: as many as fill a 16K-token
chunk); throughput is prompt tokens per second per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment, check_deployment
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec
from epserve.planner.memory import estimate_memory
from epserve.planner.ops import BatchShape
from epserve.planner.step import StepEstimate, estimate_step, overlap_modes

PREFILL_CHUNK_TOKENS = 16384


@dataclass(frozen=True)
class PrefillPlan:
    deployment: Deployment
    prompt_len: int
    prompts_per_gpu: int
    step: StepEstimate

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.prompts_per_gpu * self.prompt_len / self.step.step_time_us * 1e6


def prompts_per_chunk(prompt_len: int) -> int:
    """Prompts per GPU in one prefill forward: as many as fit in a chunk of ``PREFILL_CHUNK_TOKENS``."""
    return max(1, PREFILL_CHUNK_TOKENS // prompt_len)


def plan_prefill(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, prompt_len: int, prompts_per_gpu: int | None = None
) -> PrefillPlan:
    if prompt_len < 1:
        raise PlanError(f"prompt length must be at least 1, got {prompt_len}")
    n = prompts_per_gpu or prompts_per_chunk(prompt_len)
    d = replace(d, batch=n, kv_len=prompt_len, mtp_draft=0)
    check_deployment(model, hw, d)
    memory = estimate_memory(model, hw, d)
    if n > memory.max_batch_per_gpu:
        raise PlanError(f"{n} prompts of {prompt_len} tokens do not fit in memory "
                        f"(at most {memory.max_batch_per_gpu} per GPU)")
    shape = BatchShape(requests=n, query_len=prompt_len, kv_len=0, phase="prefill")
    step = min((estimate_step(model, hw, d, mode, shape) for mode in overlap_modes(d)), key=lambda s: s.step_time_us)
    return PrefillPlan(d, prompt_len, n, step)
