"""End-to-end pricing of a colocated workload: prompts of ``I`` tokens, ``O`` output tokens each.

Public throughput figures are end to end: the same GPUs prefill the prompts and decode the outputs,
the scheduler putting prefill *chunks* into decode steps under a token budget per step (vLLM's
``max_num_batched_tokens``, SGLang's ``chunked_prefill_size``, TensorRT-LLM's ``max_num_tokens``).
In steady state, per DP group (one engine instance of ``TP`` GPUs, ``R = batch x TP`` requests in
flight, ``q = 1 + drafts`` query tokens each, ``a`` accepted tokens per step):

- a **pure decode step** is the decode plan at the mean KV length ``I + O / 2`` (``t_d``);
- every finished request is replaced: ``l = R a / O`` new prompts per step, ``p = l I`` prompt tokens;
- a **chunk** is the prefill a step carries beside its decode tokens, within what the budget ``C``
  leaves, ``C - R q`` tokens: pieces of ``min(I, C - R q)`` tokens (a longer prompt takes ``ceil(I /
  piece)`` chunks, each priced as a fresh prompt: its attention to the earlier pieces is not counted),
  as many as arrive per step (``ceil(l)``, at least 1, at most what the budget holds), ``c`` tokens in
  all;
- a share ``s = p / c`` of a group's steps carry a chunk. ``s > 1``: the budget cannot keep ``R``
  requests fed (``prefill_bound``); every step carries a chunk and the group emits ``c O / I`` tokens
  per step instead of ``R a``;
- the ``DP`` groups of an EP group schedule their chunks independently, but their MoE layers run in
  lockstep: a step waits for the slowest group, so ``S = 1 - (1 - s)^DP`` of the EP group's steps
  carry a chunk, ``g = DP s / S`` groups' chunks on average when one does (the interference of prefill
  with decode that disaggregation removes, and what TensorRT-LLM's "ADP balance" scheduling attacks);
- a chunk is priced as a prefill forward of one group's chunk on the same layout whose MoE layers hold
  ``g`` groups' chunks (``moe_groups``), the MTP layer's forward included when MTP is on (``t_c``); a
  step that carries one takes ``t_d + t_c`` (the chunk's weights re-read: an upper bound while the
  chunk is memory-bound).

Then the mean step is ``t_d + S t_c`` and output tokens/s per GPU ``R a / (TP x mean step)``. A
request, while it decodes, waits for the chunks of the others only (its own are its TTFT): ``S' = 1 -
(1 - s (R - 1) / R)(1 - s)^(DP - 1)`` of its steps carry one, so its TPOT is ``(t_d + S' t_c) / a``
and the interactivity (tokens/s per user, as benchmarks plot it) ``1 / TPOT``; the inter-token latency
(per step) is ``t_d`` for ``1 - S'`` of its steps and ``t_d + t_c`` for the rest, whence its
percentiles; TTFT is half a step (a request arrives mid-step) plus ``ceil(I / c)`` mixed steps (no
queueing beyond that); and, as TensorRT-LLM reports it, per-request speed with the context phase
``O / (TTFT + O x TPOT)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from epserve.config import ModelConfig
from epserve.planner.deployment import Deployment, check_deployment
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec
from epserve.planner.ops import BatchShape
from epserve.planner.step import DecodePlan, estimate_step, overlap_modes, plan_decode

DEFAULT_MAX_NUM_TOKENS = 8192  # vLLM's and SGLang's default chunked-prefill budget on large GPUs
ITL_PERCENTILES = (50, 90, 99)


def workload_kv_len(input_len: int, output_len: int) -> int:
    """Mean KV length over a request's decode: its prompt plus half its output."""
    return input_len + round(output_len / 2)


@dataclass(frozen=True)
class WorkloadPlan:
    model_name: str
    hardware: str
    input_len: int
    output_len: int
    max_num_tokens: int  # the scheduler's token budget per step and DP group
    decode: DecodePlan  # a pure decode step at the mean KV length
    chunk_tokens: int  # prompt tokens a chunk step adds (per DP group)
    chunk_prompt_len: int  # the prompt (piece) length a chunk is priced at
    chunk_time_us: float  # the time a chunk adds to a step
    chunk_overlap: str

    @property
    def fits(self) -> bool:
        return self.decode.fits

    @property
    def group_requests(self) -> int:
        return self.decode.deployment.requests_per_dp_group

    @property
    def accepted(self) -> float:
        return self.decode.deployment.accepted_tokens_per_step

    @property
    def prefill_tokens_per_step(self) -> float:
        """Prompt tokens per step a DP group must prefill to keep its requests in flight."""
        return self.group_requests * self.accepted * self.input_len / self.output_len

    @property
    def prefill_bound(self) -> bool:
        return self.prefill_tokens_per_step > self.chunk_tokens

    @property
    def group_chunk_share(self) -> float:
        """Share of a DP group's steps that carry its prefill chunk (``s``)."""
        return min(1.0, self.prefill_tokens_per_step / self.chunk_tokens)

    @property
    def chunk_step_share(self) -> float:
        """Share of the EP group's steps in which some DP group carries a chunk (``S``)."""
        return 1.0 - (1.0 - self.group_chunk_share) ** self.decode.deployment.dp

    @property
    def decode_step_us(self) -> float:
        return self.decode.step.step_time_us

    @property
    def mixed_step_us(self) -> float:
        return self.decode_step_us + self.chunk_time_us

    @property
    def mean_step_us(self) -> float:
        return self.decode_step_us + self.chunk_step_share * self.chunk_time_us

    @property
    def prefill_time_share(self) -> float:
        return self.chunk_step_share * self.chunk_time_us / self.mean_step_us

    @property
    def output_tokens_per_step(self) -> float:
        """Per DP group: every request's accepted tokens, or what the prefill rate sustains."""
        if self.prefill_bound:
            return self.chunk_tokens * self.output_len / self.input_len
        return self.group_requests * self.accepted

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_step / self.decode.deployment.tp / self.mean_step_us * 1e6

    @property
    def output_tokens_per_s_per_node(self) -> float:
        return self.output_tokens_per_s_per_gpu * self.decode.deployment.gpus_per_node

    @property
    def request_chunk_share(self) -> float:
        """Share of a decoding request's steps that carry a chunk not its own (``S'``)."""
        r, s = self.group_requests, self.group_chunk_share
        return 1.0 - (1.0 - s * (r - 1) / r) * (1.0 - s) ** (self.decode.deployment.dp - 1)

    @property
    def request_step_us(self) -> float:
        """The mean step a decoding request sees."""
        return self.decode_step_us + self.request_chunk_share * self.chunk_time_us

    @property
    def interactivity(self) -> float:
        """Output tokens/s a request sees while it decodes (1 / TPOT)."""
        return self.accepted / self.request_step_us * 1e6

    @property
    def tpot_us(self) -> float:
        return self.request_step_us / self.accepted

    def itl_percentile_us(self, pct: float) -> float:
        """Inter-token latency (per step) at ``pct``: a pure decode step or a step with a chunk."""
        return self.decode_step_us if pct / 100 <= 1 - self.request_chunk_share else self.mixed_step_us

    @property
    def ttft_us(self) -> float:
        chunks = math.ceil(self.input_len / self.chunk_prompt_len)
        return self.request_step_us / 2 + chunks * self.mixed_step_us

    @property
    def tokens_per_s_per_request_with_ttft(self) -> float:
        return self.output_len / (self.ttft_us + self.output_len * self.tpot_us) * 1e6

    def to_json(self) -> dict[str, Any]:
        d = self.decode.deployment
        return {
            "model": self.model_name, "gpu": self.hardware, "ep": d.ep, "tp": d.tp, "dp": d.dp, "batch": d.batch,
            "requests_per_dp_group": self.group_requests, "input_len": self.input_len,
            "output_len": self.output_len, "max_num_tokens": self.max_num_tokens, "kv_len": d.kv_len,
            "mtp_draft": d.mtp_draft, "mtp_accept": d.mtp_accept, "weight_dtype": d.weight_dtype,
            "kv_dtype": d.kv_dtype, "fits": self.fits, "fits_reason": self.decode.fits_reason,
            "decode_step_us": self.decode_step_us, "decode_overlap": self.decode.step.overlap,
            "chunk_tokens": self.chunk_tokens, "chunk_prompt_len": self.chunk_prompt_len,
            "chunk_time_us": self.chunk_time_us,
            "chunk_overlap": self.chunk_overlap, "group_chunk_share": self.group_chunk_share,
            "chunk_step_share": self.chunk_step_share, "request_chunk_share": self.request_chunk_share,
            "prefill_tokens_per_step": self.prefill_tokens_per_step, "prefill_bound": self.prefill_bound,
            "prefill_time_share": self.prefill_time_share, "mean_step_us": self.mean_step_us,
            "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
            "output_tokens_per_s_per_node": self.output_tokens_per_s_per_node,
            "decode_only_tokens_per_s_per_gpu": self.decode.throughput_tokens_per_s_per_gpu,
            "interactivity_tokens_per_s_per_request": self.interactivity, "tpot_us": self.tpot_us,
            "itl_us": {f"p{p}": self.itl_percentile_us(p) for p in ITL_PERCENTILES}, "ttft_us": self.ttft_us,
            "tokens_per_s_per_request_with_ttft": self.tokens_per_s_per_request_with_ttft,
        }


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk of ``prompts`` prompt pieces of ``prompt_len`` tokens per DP group, and its price."""

    prompts: int
    prompt_len: int
    time_us: float
    overlap: str

    @property
    def tokens(self) -> int:
        return self.prompts * self.prompt_len


def price_chunk(model: ModelConfig, hw: HardwareSpec, d: Deployment, prompt: int, prompts: int,
                groups: float | None = None) -> Chunk:
    """A prefill forward over ``prompts`` prompts (or pieces) of ``prompt`` tokens on a DP group of layout
    ``d``, ``groups`` of its DP groups carrying one (None: all); with MTP its layer's forward over them
    too (as ``disagg`` prices a prefill instance: decode needs its cache)."""
    chunk = replace(d, batch=prompts / d.tp, kv_len=prompt, mtp_draft=0)
    check_deployment(model, hw, chunk)
    shape = BatchShape(requests=prompts / d.tp, query_len=prompt, kv_len=0, phase="prefill", moe_groups=groups)
    step = min((estimate_step(model, hw, chunk, mode, shape) for mode in overlap_modes(chunk)),
               key=lambda s: s.step_time_us)
    mtp = step.moe_layer_time_us if d.mtp_draft and model.num_nextn_predict_layers else 0.0
    return Chunk(prompts, prompt, step.step_time_us + mtp, step.overlap)


def plan_workload(
    model: ModelConfig, hw: HardwareSpec, d: Deployment, input_len: int, output_len: int,
    max_num_tokens: int = DEFAULT_MAX_NUM_TOKENS, model_name: str = "model", kv_len: int | None = None,
) -> WorkloadPlan:
    """Price ``d`` (its batch = requests per GPU in flight) serving the ``input_len`` / ``output_len`` mix
    colocated, under a budget of ``max_num_tokens`` per step and DP group; the decode at ``kv_len``
    (default ``input_len + output_len / 2``)."""
    for what, value in (("input length", input_len), ("output length", output_len),
                        ("max-num-tokens", max_num_tokens)):
        if value < 1:
            raise PlanError(f"{what} must be at least 1, got {value}")
    d = replace(d, kv_len=kv_len or workload_kv_len(input_len, output_len))
    decode = plan_decode(model, hw, d, model_name)
    room = max_num_tokens - d.requests_per_dp_group * d.query_len
    if room < 1:
        raise PlanError(f"max-num-tokens {max_num_tokens} leaves no room for prefill beside the decode batch's "
                        f"{d.requests_per_dp_group * d.query_len} tokens per step (DP group of TP {d.tp})")
    piece = min(input_len, room)
    arrivals = d.requests_per_dp_group * d.accepted_tokens_per_step / output_len  # new prompts per step
    prompts = max(1, min(room // piece, math.ceil(arrivals - 1e-9)))
    share = min(1.0, arrivals * input_len / (prompts * piece))  # s
    groups = max(1.0, d.dp * share / (1.0 - (1.0 - share) ** d.dp))  # g
    chunk = price_chunk(model, hw, d, piece, prompts, groups)
    return WorkloadPlan(model_name, hw.name, input_len, output_len, max_num_tokens, decode, chunk.tokens,
                        chunk.prompt_len, chunk.time_us, chunk.overlap)
