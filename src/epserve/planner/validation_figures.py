"""The published figures the planner is validated against (``validation`` compares them), what a figure
is (:class:`Figure`, measured on a :class:`Setting`; :class:`NotPriced`: one left out), and how each is priced.

Every figure is priced on the publisher's setting as far as the planner can express it; where it
cannot (TensorRT-LLM's min-latency runs split the MoE as TP x EP, the planner only as EP), the
nearest setting is priced and the ``Setting`` says so. Nothing is fitted to a figure here: the
planner prices with its built-in hardware entries, the settings are the publishers'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

from epserve.planner.cost import Kernel, Work, all_to_all, kernel_time
from epserve.planner.deployment import Deployment
from epserve.planner.gpus import BUILTIN
from epserve.planner.kernel_fits import fit_gemm, gemm_class
from epserve.planner.kernel_tables import (
    COLLECTIVE_CITATIONS,
    COLLECTIVE_ROWS,
    DEEPGEMM,
    DEEPGEMM_ROWS,
    CollectiveRow,
    GemmRow,
)
from epserve.planner.models import resolve_model
from epserve.planner.prefill import plan_prefill
from epserve.planner.step import DecodePlan, estimate_step, plan_decode
from epserve.planner.workload import WorkloadPlan, plan_workload


@dataclass(frozen=True)
class Setting:
    """What a figure was measured on, in the publisher's terms (as the table prints it)."""

    hardware: str
    layout: str
    io_mix: str
    precision: str
    mtp: str
    model: str = "DeepSeek-V3/R1"


@dataclass(frozen=True)
class Figure:
    key: str
    system: str  # who published it
    metric: str  # what was measured, with its unit
    published: float
    source: str  # repository + path + commit, or URL
    setting: Setting
    price: Callable[[], float]  # the planner's figure for the same setting
    band: float  # |predicted / published - 1| the test allows
    points_at: str  # which assumption the error points at
    in_sample: bool = False  # a fit was computed from this figure


@dataclass(frozen=True)
class NotPriced:
    """A published figure left out of the table, and why."""

    system: str
    figure: str
    source: str
    reason: str


NAME, V3 = resolve_model("deepseek-v3")
DEEPSEEK = ("deepseek-ai/open-infra-index 202502OpenSourceWeek/day_6_one_more_thing_deepseekV3R1_inference_system_"
            "overview.md @56d86855fc")
DEEPSEEK_MTP = "DeepSeek-V3 technical report (arXiv 2412.19437), sec. 5.4.3: second-token acceptance 85-90%"
SGLANG = "lm-sys/lm-sys.github.io blog/2025-05-05-large-scale-ep.md @2db4e4042b"
PROFILE = "deepseek-ai/profile-data README.md (setting), as priced in " + SGLANG
TRTLLM_BEST = "NVIDIA/TensorRT-LLM docs/source/blogs/Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md @01c4ece911"
TRTLLM_BLOG1 = ("NVIDIA/TensorRT-LLM docs/source/blogs/tech_blog/blog1_Pushing_Latency_Boundaries_Optimizing_"
                "DeepSeek-R1_Performance_on_NVIDIA_B200_GPUs.md @01c4ece911")
INFERENCEMAX = ("https://developer.nvidia.com/blog/nvidia-blackwell-leads-on-new-semianalysis-inferencemax-benchmarks"
                " (InferenceMAX v1, Figure 1)")
MTP3_ACCEPTED = 2.82  # TensorRT-LLM blog 1: tokens per step with 3 MTP layers on its (real) dataset
BAND = 0.25  # the default band: a figure priced within 20% on median, each within 25%


def _accept(tokens_per_step: float, drafts: int) -> float:
    """The per-draft acceptance ``a`` with ``1 + a + ... + a^drafts = tokens_per_step`` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(drafts + 1)) < tokens_per_step else (lo, mid)
    return lo


@cache
def _decode(gpu: str, d: Deployment) -> DecodePlan:
    return plan_decode(V3, BUILTIN[gpu], d, NAME)


@cache
def _workload(gpu: str, d: Deployment, input_len: int, output_len: int, budget: int) -> WorkloadPlan:
    return plan_workload(V3, BUILTIN[gpu], d, input_len, output_len, budget, NAME)


def _prefill_node(gpu: str, d: Deployment, prompt_len: int, tokens_per_gpu: int = 16384) -> float:
    return plan_prefill(V3, BUILTIN[gpu], d, prompt_len, tokens_per_gpu // prompt_len).tokens_per_s_per_gpu * 8


def _tbo_speedup(gpu: str, d: Deployment) -> float:
    """Step time with one batch (shared expert beside the dispatch) over two micro-batches."""
    one = estimate_step(V3, BUILTIN[gpu], d, "dispatch").step_time_us
    return one / estimate_step(V3, BUILTIN[gpu], d, "microbatch").step_time_us


def _gemm_us(row: GemmRow) -> float:
    """A DeepGEMM row priced as the planner prices that kernel (FP8, the row's M per group)."""
    k = Kernel(gemm_class(row), Work(row.flops, row.bytes), "fp8", rows=row.m, matrix_bytes=row.n * row.k,
               depth=row.k)
    return kernel_time(BUILTIN["h800"], k).time_us


def _a2a_us(gpu: str, row: CollectiveRow) -> float:
    return all_to_all(BUILTIN[gpu], row.ep, row.gpus_per_node, row.tokens, 8, row.payload_bytes,
                      direction=row.direction).time_us


# ---- settings ----------------------------------------------------------------------------------------
DS_DECODE = Deployment(ep=144, num_redundant_experts=32, batch=88, kv_len=4989, mtp_draft=1, mtp_accept=0.85)
PROFILE_DECODE = Deployment(ep=128, batch=128, kv_len=4096, mtp_draft=1, mtp_accept=0.6)
EP32_PREFILL = Deployment(ep=32, num_redundant_experts=32)
SGL_DECODE = Deployment(ep=72, num_redundant_experts=32, batch=256, kv_len=2000)
TRT_H200_MAX = Deployment(ep=8, batch=128)
TRT_MIN = Deployment(ep=8, tp=8, batch=1 / 8, mtp_draft=3, mtp_accept=_accept(MTP3_ACCEPTED, 3))
B200_FP4 = Deployment(ep=8, weight_dtype="fp4")

_H800 = "H800 (8 per node, CX7 400 Gb/s)"
_H100 = "H100 (8 per node, IB)"
_FP8 = "FP8 weights, BF16 KV"
_FP4 = "NVFP4 MoE (planner: all weights FP4), BF16 KV"
_DS_SKEW = "production, not a saturated benchmark: uneven lengths and batches across DP ranks, EPLB imperfect"

FIGURES: tuple[Figure, ...] = (
    Figure("deepseek-decode", "DeepSeek", "output tok/s per user, decode", 21.0, DEEPSEEK + "; " + DEEPSEEK_MTP,
           Setting(_H800, "EP144 (+32 redundant), DP144, batch 88/GPU (14.8k tok/s/node / 21)", "KV 4,989 (mean)",
                   _FP8, "1 draft, 85%"),
           lambda: _decode("h800", DS_DECODE).output_tokens_per_s_per_request, 0.50, _DS_SKEW),
    Figure("deepseek-profile-prefill", "DeepSeek", "prompt tok/s per node, prefill", 62713, PROFILE,
           Setting(_H800, "EP32 (+32 redundant), DP32, 16K tokens/GPU, 2 micro-batches", "4,096-token prompts",
                   _FP8, "none"),
           lambda: _prefill_node("h800", EP32_PREFILL, 4096), BAND,
           "communication-bound in the planner (InfiniBand at the constant 0.78, not a fit): the profile's "
           "balanced routing is what the planner assumes"),
    Figure("deepseek-profile-decode", "DeepSeek", "output tok/s per node, decode", 18598, PROFILE,
           Setting(_H800, "EP128, DP128, batch 128/GPU, 2 micro-batches", "KV 4,096", _FP8,
                   "1 draft at 60% (assumed: SGLang's comparison)"),
           lambda: _decode("h800", PROFILE_DECODE).throughput_tokens_per_s_per_node, BAND,
           "the acceptance behind the derived figure is not published"),
    *(Figure(f"sglang-prefill-{n}k", "SGLang", "prompt tok/s per node, prefill", v, SGLANG,
             Setting(_H100, "EP32 (+32 redundant), DP32, 16K tokens/GPU, TBO, EPLB", f"{n}K-token prompts", _FP8,
                     "none"),
             lambda n=n: _prefill_node("h100", EP32_PREFILL, 1024 * n), BAND,
             "real routing skew (EPLB on in-distribution data) against uniform; the planner hides attention "
             "behind communication, so its prefill does not slow with the prompt as SGLang's does")
      for n, v in ((1, 57674), (2, 54543), (4, 50302))),
    Figure("sglang-prefill-4k-balanced", "SGLang", "prompt tok/s per node, prefill", 59337, SGLANG,
           Setting(_H100, "EP32, DP32, 16K tokens/GPU, TBO, simulated perfect EPLB", "4K-token prompts", _FP8, "none"),
           lambda: _prefill_node("h100", EP32_PREFILL, 4096), BAND, "balanced routing, as the planner assumes"),
    Figure("sglang-decode", "SGLang", "output tok/s per node, decode", 22282, SGLANG,
           Setting(_H100, "EP72 (+32 redundant), DP72, batch 256/GPU, TBO, DeepEP low-latency", "KV 2,000", _FP8,
                   "none"),
           lambda: _decode("h100", SGL_DECODE).throughput_tokens_per_s_per_node, BAND,
           "the transfers priced for the mean rank (EPLB leaves some imbalance); SGLang's MoE kernels 25% "
           "slower than DeepSeek's by its own profile"),
    Figure("sglang-tbo-256", "SGLang", "decode speedup, two micro-batches over one", 1.255, SGLANG,
           Setting(_H100, "EP72, DP72, 256 tokens/GPU", "KV 2,000", _FP8, "none"),
           lambda: _tbo_speedup("h100", SGL_DECODE), BAND, "the overlap schedule"),
    Figure("sglang-tbo-32", "SGLang", "decode speedup, two micro-batches over one", 0.73, SGLANG,
           Setting(_H100, "EP72, DP72, 32 tokens/GPU", "KV 2,000", _FP8, "none"),
           lambda: _tbo_speedup("h100", replace(SGL_DECODE, batch=32)), BAND,
           "kernel floors and weight re-reads of two half batches"),
    Figure("trtllm-h200-max-throughput", "TensorRT-LLM", "output tok/s per GPU, end to end", 1436.2, TRTLLM_BEST,
           Setting("H200 (8)", "attention DP8, EP8, 128 requests/GPU, budget 1,151 tokens", "1K/2K, colocated", _FP8,
                   "none"),
           lambda: _workload("h200", TRT_H200_MAX, 1024, 2048, 1151).output_tokens_per_s_per_gpu, BAND,
           "prefill chunks priced apart from the decode step they share"),
    Figure("trtllm-h200-min-latency", "TensorRT-LLM", "output tok/s per user, with TTFT", 158.1, TRTLLM_BEST,
           Setting("H200 (8)", "attention TP8; MoE TP2 x EP4 (planner: EP8), batch 1", "1K/2K", _FP8,
                   f"3 drafts, {MTP3_ACCEPTED} tokens/step"),
           lambda: _workload("h200", TRT_MIN, 1024, 2048, 8192).tokens_per_s_per_request_with_ttft, BAND,
           "all-to-all floors on NVLink (pplx-kernels' 42 us) where TensorRT-LLM all-reduces"),
    Figure("trtllm-b200-min-latency", "TensorRT-LLM", "output tok/s per user, with TTFT", 274.7, TRTLLM_BEST,
           Setting("B200 (8)", "attention TP8; MoE TP4 x EP2 (planner: EP8), batch 1", "1K/2K", _FP4,
                   f"3 drafts, {MTP3_ACCEPTED} tokens/step"),
           lambda: _workload("b200", replace(TRT_MIN, weight_dtype="fp4"), 1024, 2048, 8192)
           .tokens_per_s_per_request_with_ttft, BAND, "Blackwell: Hopper GEMM fractions assumed"),
    Figure("trtllm-b200-no-mtp", "TensorRT-LLM", "output tok/s per user, with TTFT", 111, TRTLLM_BLOG1,
           Setting("B200 (8)", "attention TP8, MoE TP x EP (planner: EP8), batch 1", "1K/2K", _FP4, "none"),
           lambda: _workload("b200", replace(TRT_MIN, weight_dtype="fp4", mtp_draft=0), 1024, 2048, 8192)
           .tokens_per_s_per_request_with_ttft, BAND, "Blackwell: Hopper GEMM fractions assumed"),
    Figure("trtllm-b200-max-throughput", "TensorRT-LLM", "output tok/s per GPU, end to end", 4548.0, TRTLLM_BEST,
           Setting("B200 (8)", "attention DP8, EP8, 384 requests/GPU, budget 1,536 tokens", "1K/2K, colocated", _FP4,
                   "none"),
           lambda: _workload("b200", replace(B200_FP4, batch=384), 1024, 2048, 1536).output_tokens_per_s_per_gpu,
           0.35, "Blackwell: Hopper GEMM fractions assumed, MLA decode estimated from FlashMLA's sparse kernel"),
    Figure("trtllm-b200-max-throughput-fp8kv", "TensorRT-LLM", "output tok/s per GPU, end to end", 5393.3,
           TRTLLM_BEST,
           Setting("B200 (8)", "attention DP8, EP8, 896 requests/GPU, budget 2,048 tokens", "1K/2K, colocated",
                   "NVFP4 MoE, FP8 KV (planner: BF16 attention math)", "none"),
           lambda: _workload("b200", replace(B200_FP4, batch=896, kv_dtype="fp8"), 1024, 2048, 2048)
           .output_tokens_per_s_per_gpu, 0.35,
           "Blackwell: Hopper GEMM fractions assumed, MLA decode estimated from FlashMLA's sparse kernel; FP8 MQA "
           "not modelled"),
)


def _gemm_figure(row: GemmRow, in_sample: bool) -> Figure:
    return Figure(f"deepgemm-{row.layout}-{row.groups}x{row.m}-{row.n}x{row.k}", "DeepGEMM", "kernel time (us)",
                  row.time_us, DEEPGEMM.cite(row.label),
                  Setting("H800", f"{row.layout}, {row.groups} x M={row.m}", f"N={row.n}, K={row.k}", "FP8", "-"),
                  lambda row=row: _gemm_us(row), 0.25 if not in_sample else 0.30,
                  "the roofline's knee (max of compute and memory)" if not in_sample else "shape (N, K) within M",
                  in_sample)


def _a2a_figure(gpu: str, row: CollectiveRow, in_sample: bool, note: str) -> Figure:
    return Figure(f"{row.source}-{row.link}-{row.direction}-ep{row.ep}-{row.tokens}", COLLECTIVE_CITATIONS[
        row.source].repository.split("/")[1], f"{row.direction} latency (us)", row.time_us,
        COLLECTIVE_CITATIONS[row.source].cite(row.label),
        Setting(gpu.upper(), f"EP{row.ep}, {row.tokens} tokens/GPU", row.link, "FP8 dispatch, BF16 combine", "-"),
        lambda row=row: _a2a_us(gpu, row), 0.35 if not in_sample else 0.25, note, in_sample)


_FIT = fit_gemm()
KERNEL_FIGURES: tuple[Figure, ...] = (
    *(_gemm_figure(r, False) for r in _FIT.held_out),
    *(_a2a_figure("h800", r, False, "NVLink efficiency from DeepEP's normal kernels, floor from pplx-kernels")
      for r in COLLECTIVE_ROWS if r.source == "deepep_ll" and r.ep == 8),
    *(_a2a_figure("h100", r, False, "DeepEP's H800 NVLink share assumed at 450 GB/s: small messages reach less")
      for r in COLLECTIVE_ROWS if r.source == "pplx" and r.link == "nvlink" and r.tokens == 128),
)
IN_SAMPLE: tuple[Figure, ...] = (
    *(_gemm_figure(r, True) for r in DEEPGEMM_ROWS if r not in _FIT.held_out and r.m <= 128),
    *(_a2a_figure("h800", r, True, "the line through DeepEP's rows")
      for r in COLLECTIVE_ROWS if r.source == "deepep_ll" and r.ep > 8),
    *(_a2a_figure("h100", r, True, "the floor") for r in COLLECTIVE_ROWS if r.source == "pplx" and r.tokens == 1),
)
FIGURES = FIGURES + KERNEL_FIGURES + IN_SAMPLE

NOT_PRICED: tuple[NotPriced, ...] = (
    NotPriced("InferenceMAX", "DeepSeek-R1 FP8 on H200, 8K/1K: ~667 output tok/s per GPU at 50 tok/s/user (GB200's "
              "10,000 over the 15x quoted)", INFERENCEMAX,
              "derived from a ratio; the H200 layout, MTP use and concurrency behind it are not published. "
              "Without MTP the planner's single-node front only just reaches 50 tok/s/user (about 52 tok/s/GPU "
              "there, EP8 TP8, batch 1), so the point presumably used MTP"),
    NotPriced("vLLM", "2.2k output tok/s per H200, wide-EP decode (CoreWeave, CX7 InfiniBand)",
              "vllm-project/vllm-project.github.io _posts/2025-12-17-large-scale-serving.md @341df868aa",
              "the post gives neither the batch per GPU nor the KV length, nor the decode EP size"),
    NotPriced("DeepSeek", "prefill 73.7k input tok/s per H800 node, 56.3% of it cache hits (32.2k without, "
              "SGLang's reading)", DEEPSEEK, "prompt lengths and where the cached prefixes sit are not published"),
    NotPriced("SGLang", "17,373 output tok/s per node, decode with simulated MTP", SGLANG,
              "attention slowed by dummy kernels to match DeepSeek's profile: not a configuration the planner "
              "(or anyone) serves"),
    NotPriced("SGLang", "7,583 output tok/s per GPU, GB200 NVL72 decode (EP48, 2K inputs)",
              "lm-sys/lm-sys.github.io blog/2025-06-16-gb200-part-1.md @00766f6b72",
              "the batch per GPU is not in the post (only in its reproduction issue)"),
    NotPriced("pplx-kernels", "IBGDA dispatch 308-622 us and combine 481-668 us at 128 tokens per GPU, EP16-128",
              COLLECTIVE_CITATIONS["pplx"].cite(),
              "another implementation than the DeepEP low-latency kernels the planner's InfiniBand fit models "
              "(1.6-3.4x DeepEP's times at the same shape); the planner prices DeepEP's"),
)
