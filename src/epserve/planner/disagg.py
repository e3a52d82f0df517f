"""Prefill/decode disaggregation: prefill instances run the prompts and hand their latent KV to decode instances.

- **Prefill instance** (``EP_p`` GPUs, MHA-form MLA): chunks of ``max(1, 16384 // input_len)`` prompts
  per GPU, priced as the prefill estimate prices them (``prefill.plan_prefill``) but without refusing
  a layout beyond memory (``fits_reason`` says what does not fit). With MTP on, the instance also runs
  the MTP layer over the prompts (decode needs its cache): one more MoE layer's time, and its weights
  and cache in memory. A prompt's prefill time is its chunk's forward (no queueing).
- **Decode instance**: ``plan_decode`` of the decode layout at its batch; every request at one KV
  length, by default ``input_len + output_len / 2`` (the mean over a request's decode).
- **KV transfer**: the latent cache of a prompt, ``layers x (kv_lora_rank + qk_rope_head_dim) x KV
  bytes x input_len`` (the MTP layer counted with MTP on), over the inter-node network: one NIC per GPU
  at ``ib_bandwidth x ib_efficiency`` plus ``ib_latency_us``. Every TP rank of a decode DP group holds the
  whole latent cache, so a prefill GPU sends ``ceil(decode TP / prefill TP)`` copies one after another.
  Not overlapped with the prefill (layer by layer streaming would hide most of it): TTFT = prefill +
  transfer.
- **Ratio**: one prefill instance sustains ``prompt tokens/s / input_len`` requests/s, one decode
  instance ``output tokens/s / output_len``; prefill instances per decode instance = decode req/s /
  prefill req/s. The integer pair is the smallest ``D`` (up to 64) whose ``P = ceil(D x ratio)`` uses at
  most 5% more GPUs than the exact fraction; decode then bounds the whole deployment.
- **Colocated** (the comparison): the decode layout also runs the prefills, priced on that layout, and
  each prefill stalls the instance for its duration. With ``a`` output tokens/s and ``p`` prompt tokens/s
  of the instance, the prefills take ``f = (in/p) / (in/p + out/a)`` of its time and it delivers
  ``a x (1 - f)`` output tokens/s (and each request ``1 - f`` of the decode speed, on average).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from epserve.config import ModelConfig
from epserve.planner.deployment import KV_BYTES, Deployment, check_deployment, num_expert_slots
from epserve.planner.errors import PlanError
from epserve.planner.hardware import HardwareSpec
from epserve.planner.memory import MemoryEstimate, estimate_memory, planned_kv_bytes_per_token
from epserve.planner.ops import BatchShape
from epserve.planner.prefill import PrefillPlan, prompts_per_chunk
from epserve.planner.step import DecodePlan, estimate_step, overlap_modes, plan_decode

DEFAULT_OUTPUT_LEN = 1000
MAX_DECODE_INSTANCES = 64  # the integer pair's search
PAIR_SLACK = 0.05  # GPUs the integer pair may use beyond the exact fraction


def decode_kv_len(input_len: int, output_len: int) -> int:
    """The mean KV length over a request's decode: its prompt plus half its output."""
    return input_len + round(output_len / 2)


@dataclass(frozen=True)
class PrefillInstance:
    """One prefill instance of ``deployment.ep`` GPUs, priced whether it fits in memory or not."""

    plan: PrefillPlan
    memory: MemoryEstimate
    mtp_layer_time_us: float  # the MTP layer's forward over the chunk (0 without MTP)
    fits_reason: str | None

    @property
    def fits(self) -> bool:
        return self.fits_reason is None

    @property
    def deployment(self) -> Deployment:
        return self.plan.deployment

    @property
    def prompt_time_us(self) -> float:
        """One chunk's forward: the time a prompt of it takes (no queueing)."""
        return self.plan.step.step_time_us + self.mtp_layer_time_us

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.plan.prompts_per_gpu * self.plan.prompt_len / self.prompt_time_us * 1e6

    @property
    def tokens_per_s_per_instance(self) -> float:
        return self.tokens_per_s_per_gpu * self.deployment.ep

    @property
    def requests_per_s_per_instance(self) -> float:
        return self.tokens_per_s_per_instance / self.plan.prompt_len

    def to_json(self) -> dict[str, Any]:
        d, mem = self.deployment, self.memory
        return {
            "ep": d.ep, "tp": d.tp, "dp": d.dp, "num_nodes": d.num_nodes, "gpus": d.ep,
            "prompt_len": self.plan.prompt_len, "prompts_per_gpu": self.plan.prompts_per_gpu,
            "fits": self.fits, "fits_reason": self.fits_reason,
            "memory_per_gpu_bytes": {"weights": mem.weights_bytes, "kv": mem.kv_bytes,
                                     "reserved": mem.reserved_bytes, "capacity": mem.capacity_bytes},
            "overlap": self.plan.step.overlap,
            "mtp_layer_time_us": self.mtp_layer_time_us,
            "prompt_time_us": self.prompt_time_us,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_per_instance": self.tokens_per_s_per_instance,
            "requests_per_s_per_instance": self.requests_per_s_per_instance,
        }


def price_prefill(model: ModelConfig, hw: HardwareSpec, d: Deployment, prompt_len: int) -> PrefillInstance:
    """A prefill instance of layout ``d`` (its EP, TP, dtypes and MTP) on chunks of ``prompt_len``-token
    prompts: memory (said, never refused) and the faster of its overlap schedules."""
    if prompt_len < 1:
        raise PlanError(f"input length must be at least 1, got {prompt_len}")
    n = prompts_per_chunk(prompt_len)
    d = replace(d, batch=n, kv_len=prompt_len)
    check_deployment(model, hw, d)
    memory = estimate_memory(model, hw, d)
    shape = BatchShape(requests=n, query_len=prompt_len, kv_len=0, phase="prefill")
    step = min((estimate_step(model, hw, d, mode, shape) for mode in overlap_modes(d)), key=lambda s: s.step_time_us)
    mtp = step.moe_layer_time_us if d.mtp_draft and model.num_nextn_predict_layers else 0.0
    return PrefillInstance(PrefillPlan(d, prompt_len, n, step), memory, mtp, memory.shortfall())


def default_prefill_ep(model: ModelConfig, hw: HardwareSpec, d: Deployment, prompt_len: int) -> int:
    """The smallest EP the layout allows (a divisor of the expert slots, TP ``d.tp``) whose weights and
    one chunk of prompts fit in memory; the largest allowed one if none fits."""
    slots = num_expert_slots(model, d)
    n = prompts_per_chunk(max(prompt_len, 1))
    allowed: list[int] = []
    first_error: PlanError | None = None
    for ep in (e for e in range(1, slots + 1) if slots % e == 0):
        candidate = replace(d, ep=ep, batch=n, kv_len=max(prompt_len, 1))
        try:
            check_deployment(model, hw, candidate)
        except PlanError as e:
            first_error = first_error or e
            continue
        allowed.append(ep)
        if estimate_memory(model, hw, candidate).fits:
            return ep
    if not allowed:
        raise first_error or PlanError("no prefill EP fits the layout")
    return allowed[-1]


@dataclass(frozen=True)
class KVTransfer:
    """A prompt's latent KV cache, from the prefill GPU that holds it to its decode DP group."""

    layers: int  # the model's layers, plus the MTP layer with MTP on
    kv_dim: int  # kv_lora_rank + qk_rope_head_dim
    dtype_bytes: int
    input_len: int
    copies: int  # sent by one prefill GPU: ceil(decode TP / prefill TP)
    bandwidth: float  # bytes/s one GPU's NIC achieves (ib_bandwidth x ib_efficiency)
    latency_us: float

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.kv_dim * self.dtype_bytes

    @property
    def bytes_per_request(self) -> int:
        return self.bytes_per_token * self.input_len

    @property
    def time_us(self) -> float:
        return self.latency_us + self.copies * self.bytes_per_request / self.bandwidth * 1e6

    def to_json(self) -> dict[str, Any]:
        return {"link": "ib", "layers": self.layers, "kv_dim": self.kv_dim, "dtype_bytes": self.dtype_bytes,
                "bytes_per_token": self.bytes_per_token, "bytes_per_request": self.bytes_per_request,
                "copies_per_sender": self.copies, "bandwidth_bytes_per_s": self.bandwidth,
                "latency_us": self.latency_us, "time_us": self.time_us}


def kv_transfer(model: ModelConfig, hw: HardwareSpec, prefill: Deployment, decode: Deployment,
                input_len: int) -> KVTransfer:
    per_token = planned_kv_bytes_per_token(model, decode.kv_dtype, decode.mtp_draft)
    dtype_bytes = KV_BYTES[decode.kv_dtype]
    return KVTransfer(layers=per_token // (model.kv_cache_dim * dtype_bytes), kv_dim=model.kv_cache_dim,
                      dtype_bytes=dtype_bytes, input_len=input_len, copies=math.ceil(decode.tp / prefill.tp),
                      bandwidth=hw.ib_bandwidth * hw.ib_efficiency, latency_us=hw.ib_latency_us)


def instance_pair(ratio: float, prefill_gpus: int, decode_gpus: int) -> tuple[int, int]:
    """(P, D): the smallest D whose P = ceil(D x ratio) uses at most ``PAIR_SLACK`` more GPUs than
    the exact ``ratio`` would; the least wasteful pair up to ``MAX_DECODE_INSTANCES`` if none does."""
    exact = ratio * prefill_gpus + decode_gpus  # GPUs per decode instance at the fractional ratio
    best: tuple[float, int, int] | None = None
    for d in range(1, MAX_DECODE_INSTANCES + 1):
        p = max(1, math.ceil(d * ratio - 1e-9))
        excess = (p * prefill_gpus + d * decode_gpus) / (d * exact)
        if excess <= 1 + PAIR_SLACK:
            return p, d
        if best is None or excess < best[0] - 1e-12:
            best = (excess, p, d)
    assert best is not None
    return best[1], best[2]


@dataclass(frozen=True)
class DisaggPlan:
    model_name: str
    hardware: str
    input_len: int
    output_len: int
    prefill: PrefillInstance
    decode: DecodePlan
    transfer: KVTransfer
    colocated_prefill: PrefillInstance  # the same prompts on the decode layout
    kv_len_given: bool = False  # decode priced at --kv-len, not input + output / 2

    @property
    def fits(self) -> bool:
        return self.prefill.fits and self.decode.fits

    @property
    def fits_reason(self) -> str | None:
        parts = [f"{side}: {r}" for side, r in (("prefill", self.prefill.fits_reason),
                                                 ("decode", self.decode.fits_reason)) if r]
        return "; ".join(parts) or None

    @property
    def ttft_us(self) -> float:
        return self.prefill.prompt_time_us + self.transfer.time_us

    @property
    def nic_share_prefill(self) -> float:
        """Share of a prefill GPU's NIC the KV it sends takes, the GPU prefilling without pause."""
        per_gpu = self.prefill.requests_per_s_per_instance / self.prefill.deployment.ep
        return per_gpu * self.transfer.copies * self.transfer.bytes_per_request / self.transfer.bandwidth

    @property
    def nic_share_decode(self) -> float:
        """Share of a decode GPU's NIC the KV it receives takes (every TP rank, its DP group's requests)."""
        per_group = self.decode_requests_per_s_per_instance / self.decode.deployment.dp
        return per_group * self.transfer.bytes_per_request / self.transfer.bandwidth

    @property
    def decode_tokens_per_s_per_instance(self) -> float:
        return self.decode.throughput_tokens_per_s_per_gpu * self.decode.deployment.ep

    @property
    def decode_requests_per_s_per_instance(self) -> float:
        return self.decode_tokens_per_s_per_instance / self.output_len

    @property
    def prefill_per_decode(self) -> float:
        """Prefill instances one decode instance keeps busy."""
        return self.decode_requests_per_s_per_instance / self.prefill.requests_per_s_per_instance

    @property
    def pair(self) -> tuple[int, int]:
        return instance_pair(self.prefill_per_decode, self.prefill.deployment.ep, self.decode.deployment.ep)

    @property
    def gpus(self) -> int:
        p, d = self.pair
        return p * self.prefill.deployment.ep + d * self.decode.deployment.ep

    @property
    def prefill_utilization(self) -> float:
        """Busy share of the pair's prefill instances (1 at an exact ratio; P is rounded up)."""
        p, d = self.pair
        return d * self.decode_requests_per_s_per_instance / (p * self.prefill.requests_per_s_per_instance)

    @property
    def output_tokens_per_s(self) -> float:
        """The whole deployment's output: its decode instances, every one kept fed (P >= D x ratio)."""
        return self.pair[1] * self.decode_tokens_per_s_per_instance

    @property
    def output_tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.gpus

    @property
    def colocated_busy_fraction(self) -> float:
        """Share of a colocated decode instance's time spent in prefills."""
        prefill = self.input_len / self.colocated_prefill.tokens_per_s_per_instance
        return prefill / (prefill + self.output_len / self.decode_tokens_per_s_per_instance)

    @property
    def colocated_tokens_per_s_per_gpu(self) -> float:
        return self.decode.throughput_tokens_per_s_per_gpu * (1 - self.colocated_busy_fraction)

    @property
    def disaggregation_gain(self) -> float:
        """Output per GPU, disaggregated over colocated (> 1: disaggregation pays)."""
        return self.output_tokens_per_s_per_gpu / self.colocated_tokens_per_s_per_gpu

    def to_json(self) -> dict[str, Any]:
        p, d = self.pair
        decode = self.decode.to_json()
        decode.update(gpus=self.decode.deployment.ep, kv_len_source="kv-len" if self.kv_len_given else "input+output/2",
                      tokens_per_s_per_instance=self.decode_tokens_per_s_per_instance,
                      requests_per_s_per_instance=self.decode_requests_per_s_per_instance)
        return {
            "model": self.model_name, "gpu": self.hardware, "disaggregated": True,
            "input_len": self.input_len, "output_len": self.output_len,
            "fits": self.fits, "fits_reason": self.fits_reason,
            "prefill": self.prefill.to_json(), "decode": decode,
            "kv_transfer": {**self.transfer.to_json(), "nic_share_prefill": self.nic_share_prefill,
                            "nic_share_decode": self.nic_share_decode},
            "ttft_us": self.ttft_us,
            "ratio": {
                "prefill_per_decode": self.prefill_per_decode,
                "prefill_gpus_per_decode_gpu": self.prefill_per_decode * self.prefill.deployment.ep
                / self.decode.deployment.ep,
                "prefill_instances": p, "decode_instances": d, "gpus": self.gpus,
                "prefill_utilization": self.prefill_utilization,
                "requests_per_s": d * self.decode_requests_per_s_per_instance,
                "output_tokens_per_s": self.output_tokens_per_s,
                "output_tokens_per_s_per_gpu": self.output_tokens_per_s_per_gpu,
            },
            "colocated": {
                "prefill_time_us": self.colocated_prefill.prompt_time_us,
                "prefill_tokens_per_s_per_instance": self.colocated_prefill.tokens_per_s_per_instance,
                "prefill_busy_fraction": self.colocated_busy_fraction,
                "output_tokens_per_s_per_gpu": self.colocated_tokens_per_s_per_gpu,
                "output_tokens_per_s_per_request": self.decode.output_tokens_per_s_per_request
                * (1 - self.colocated_busy_fraction),
                "ttft_us": self.colocated_prefill.prompt_time_us,
            },
            "disaggregation_gain": self.disaggregation_gain,
        }


def plan_disaggregated(
    model: ModelConfig, hw: HardwareSpec, prefill: Deployment, decode: Deployment, input_len: int,
    output_len: int = DEFAULT_OUTPUT_LEN, model_name: str = "model", kv_len_given: bool = False,
) -> DisaggPlan:
    """Price the prefill layout ``prefill`` (its batch and KV length are the chunk's) and the decode
    layout ``decode`` (at its own batch and ``kv_len``; see ``decode_kv_len``), the KV transfer
    between them, the instance ratio for ``input_len`` / ``output_len``, and the colocated alternative."""
    for name, value in (("input length", input_len), ("output length", output_len)):
        if value < 1:
            raise PlanError(f"{name} must be at least 1, got {value}")
    prefill_side = price_prefill(model, hw, prefill, input_len)
    decode_plan = plan_decode(model, hw, decode, model_name)
    colocated = price_prefill(model, hw, decode, input_len)
    return DisaggPlan(model_name, hw.name, input_len, output_len, prefill_side, decode_plan,
                      kv_transfer(model, hw, prefill, decode, input_len), colocated, kv_len_given)
