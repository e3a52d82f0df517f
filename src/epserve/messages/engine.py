"""The step loop's vocabulary: what a frontend (the offline ``LLM``, the gRPC service) sends the loop,
what the loop hands back after each step, and a leader's load figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from epserve.messages.kv import KVTransferRole, KVWanted, PrefilledKV
from epserve.messages.sampling import SamplingParams, TokenLogprobs


# ---- a frontend -> the step loop -------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """A request for the engine to run, as a frontend hands it over (the offline ``LLM`` or the gRPC
    service), checked once where it entered (``LLMEngine.check_request``). ``kv_transfer``: a prefill for
    a decode instance (``"send"``: it stops after its first token) or a decode whose prompt KV comes
    from a prefill instance (``"receive"``), from block ``kv_first_block`` on."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    kv_transfer: KVTransferRole | None = None
    kv_first_block: int = 0


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class GrammarCompiled:
    """A request's constraint finished compiling (or failed to), off the loop: the loop takes it now."""

    request_id: str


@dataclass(frozen=True)
class KVReceived:
    """Decode side: a request's KV arrived from its prefill instance."""

    arrival: PrefilledKV


# ---- the step loop -> a frontend -------------------------------------------------------------
@dataclass(frozen=True)
class RequestTimes:
    """Where a finished request's time went, on the engine's clock (vLLM's per-request histograms):
    from arrival to first scheduled, from then to its first token, and from that to its finish."""

    queued_s: float
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class GeneratedTokens:
    """What one step added to a request (``finish_reason`` set on its last message; ``times`` on its
    first with tokens (no decode time yet) and its last; ``prompt_logprobs``, when asked for, on its
    first: one per prompt token from the second on)."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]  # one per token when the request asked for logprobs, else ()
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    times: RequestTimes | None = None


@dataclass(frozen=True)
class RequestFailed:
    """The request did not run (or stopped) for a reason of the engine's, not the client's input."""

    request_id: str
    reason: Literal["invalid", "unavailable", "prefill"]  # prefill: its prefill instance failed (retry elsewhere)
    message: str


# The loop's outputs: a request's tokens or failure, and for disaggregation a decode request's blocks
# allocated (its transfer can start) or a finished prefill's blocks copied out (to be sent).
LoopOutput = GeneratedTokens | RequestFailed | KVWanted | PrefilledKV


# vLLM's ``iteration_tokens_total`` buckets: the tokens a step computes (the loop's histogram of them)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class EngineLoad:
    """A leader's load figures (the fields of the gRPC ``GetLoadResponse``)."""

    dp_rank: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    expert_imbalance: float
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions_total: int
    draining: bool
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()  # empty: no speculative decoding
    expert_layers: tuple[int, ...] = ()  # MoE layers, and each one's imbalance since the last rebalance
    expert_layer_imbalance: tuple[float, ...] = ()
    eplb_rebalances_total: int = 0
    stalled: bool = False  # the loop has made no progress for the step timeout
    restarts: int = 0
    role: str = "both"
    num_receiving: int = 0  # requests waiting for their prompt's KV (blocks or transfer)
    # tokens per step that computed any here: cumulative counts per bound of ITERATION_TOKENS_BUCKETS,
    # their sum, and the number of such steps
    iteration_tokens_buckets: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    iteration_steps_total: int = 0
