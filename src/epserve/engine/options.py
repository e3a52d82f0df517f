"""The engine's options, declared once: a field of ``EngineOptions`` each, carrying where it goes in the frozen
configs (and so its default: that config's own, config/engine.py), its command-line flags (ours first, then
vLLM's and SGLang's spellings) and its help. The command line (``engine/args.py``), ``LLM``'s keywords and
:func:`build_engine_config` are made from these fields; an option added here is on all three."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from epserve.config import (
    CacheConfig,
    DispatchBackend,
    EngineConfig,
    EplbConfig,
    KvCacheDtype,
    ModelConfig,
    OverlapSetting,
    ParallelConfig,
    Quantization,
    ReplicaSelection,
    SchedulerConfig,
    SpeculativeMethod,
)
from epserve.config.engine import DispatchDtype

logger = logging.getLogger(__name__)

# Where an option goes (``option``'s first argument, "section" or "section.name"), and the argument groups.
SECTIONS = {"engine": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
            "eplb": EplbConfig}
PARALLEL = "parallelism (world = dp x tp = EP ranks)"
EPLB = "expert load balancing (EPLB)"


@dataclass(frozen=True)
class Flag:
    """One command-line spelling of an option. The value's type and choices are the field's (its Literal's
    values, less None) unless given here; a flag with ``given``, or a bool field's, is a switch that sets
    ``given`` (default: the opposite of the field's default). ``parse(flag, value)`` turns what was typed
    into the field's value (ValueError: refused, naming ``flag``). ``sets``: a flag that gives other fields
    at once, ``parse`` returning their values; it conflicts with their own flags (``()``: accepted, changes
    nothing)."""

    names: tuple[str, ...]
    help: str | None = None
    choices: tuple[str, ...] | None = None
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    given: bool | None = None
    parse: Callable[[str, Any], Any] | None = None
    sets: tuple[str, ...] | None = None
    group: str | None = None  # an argument group's title (PARALLEL, EPLB); None: the command's own options
    exclusive: str | None = None  # flags with the same key exclude one another
    unset: bool = False  # the parser's default is None (not given), the field's default applying after it

    @property
    def dest(self) -> str:
        """The parser's attribute for it (argparse's: the first long name)."""
        return next(n for n in self.names if n.startswith("--"))[2:].replace("-", "_")


def option(into: str, *names: str, help: str | None = None, also: tuple[Flag, ...] = (), **flag: Any) -> Any:
    """A field of ``EngineOptions``: placed at ``into`` (``section.name``), defaulting to that config field's
    default, with the flag ``names`` (none: a keyword only) and ``also``: further flags shown after it."""
    section, name = into.split(".")
    flags = (Flag(names, help, **flag),) if names else ()
    return field(default=getattr(SECTIONS[section], name), metadata={"into": (section, name), "flags": flags + also})


def _fraction(flag: str, value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"{flag} must be in (0, 1], got {value}")
    return value


# vLLM's --kv-cache-dtype values: what each is here (None: refused, with why).
VLLM_KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": None, "fp8_ds_mla": None, "fp8_inc": None}


def _kv_cache_dtype(flag: str, value: str) -> str:
    kind = VLLM_KV_CACHE_DTYPES[value]
    if kind is None:
        raise ValueError(f"{flag} {value}: the FP8 latent cache here is e4m3 with a per-layer scale: use {flag} fp8 "
                         "(or fp8_e4m3, vLLM's name for it), or auto")
    return kind


def _speculative_config(flag: str, text: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON as ``speculative`` and ``num_speculative_tokens``."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. '{{\"method\": \"deepseek_mtp\", "
                         f"\"num_speculative_tokens\": 1}}'")
    method = spec.get("method")
    if method not in ("deepseek_mtp", "mtp"):
        raise ValueError(f"{flag}: method {method!r} is not supported; epserve drafts with the checkpoint's own MTP "
                         "layer: \"deepseek_mtp\" or \"mtp\"")
    unknown = sorted(set(spec) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"{flag}: {', '.join(map(repr, unknown))} not supported (only method and "
                         "num_speculative_tokens)")
    num = spec.get("num_speculative_tokens", EngineConfig.num_speculative_tokens)
    if type(num) is not int or num < 1:
        raise ValueError(f"{flag}: num_speculative_tokens must be an integer >= 1, got {num!r}")
    return {"speculative": "mtp", "num_speculative_tokens": num}


@dataclass(frozen=True)
class EngineOptions:
    """Every engine option, in the order ``--help`` shows them (the checkpoint itself is ``build_engine_config``'s
    first argument and the command's MODEL)."""

    dtype: str = option(
        "engine.dtype", "--dtype", choices=("auto", "bfloat16", "float32", "float16"),
        help="the activations' and unquantized weights' dtype; auto (vLLM's): the checkpoint's own torch_dtype "
        "(bfloat16 for DeepSeek's bf16 and FP8 checkpoints)")
    device: str = option("engine.device", "--device", help="cpu or cuda[:N]")
    quantization: Quantization = option(
        "engine.quantization", "--quantization", choices=("auto", "fp8", "none"),
        parse=lambda flag, value: None if value == "none" else value,
        help="weights: fp8 keeps FP8 block-scaled weights (quantizes a bf16 checkpoint at load), none dequantizes at "
        "load, auto = fp8 for an FP8 checkpoint on CUDA, none on CPU")
    kv_cache_dtype: KvCacheDtype = option(
        "cache.kv_cache_dtype", "--kv-cache-dtype", choices=tuple(VLLM_KV_CACHE_DTYPES), parse=_kv_cache_dtype,
        help="latent KV cache: auto (the model dtype) or fp8 (e4m3 with a per-layer scale, twice the blocks; "
        "vLLM's fp8_e4m3 is the same)")
    cuda_graph: bool | None = option(
        "engine.cuda_graph", "--no-cuda-graph", "--enforce-eager", "--disable-cuda-graph", given=False,
        help="run decode steps eagerly, not as CUDA graphs (on one CPU rank: not as recorded kernel calls) "
        "(vLLM: --enforce-eager, SGLang: --disable-cuda-graph)")
    cuda_graph_max_bs: int | None = option(
        "engine.cuda_graph_max_bs", "--cuda-graph-max-bs",
        help="largest decode batch captured (CUDA graphs) or compiled (--compile); default max-num-seqs")
    compile: bool = option(
        "engine.compile", "--compile",
        help="CPU: decode steps through torch.compile(fullgraph=True), one graph per batch bucket")
    speculative: SpeculativeMethod | Literal["auto"] = option(
        "engine.speculative", "--speculative", choices=("auto", "mtp"),
        help="speculative decoding with the checkpoint's multi-token prediction (MTP) layer: mtp always drafts; "
        "auto (the default): on one rank, where the checkpoint has an MTP layer, the engine loads it and measures "
        "at start-up (the drafts' acceptance on a few greedy continuations, then decode tokens/s with and without "
        "one draft token a step) whether drafting pays here, and drafts only if it does (the log says why); off "
        "with dp x tp > 1 or --compile")
    num_speculative_tokens: int = option(
        "engine.num_speculative_tokens", "--num-speculative-tokens", unset=True,
        help="draft tokens per decode step with --speculative mtp (the MTP layer chained on itself; default "
        f"{EngineConfig.num_speculative_tokens}; 0: speculative decoding off, without a probe)",
        also=(Flag(("--speculative-config",), metavar="JSON", type=str, parse=_speculative_config,
                   sets=("speculative", "num_speculative_tokens"),
                   help="vLLM's speculative decoding option: '{\"method\": \"deepseek_mtp\" (or \"mtp\"), "
                   "\"num_speculative_tokens\": K}' is --speculative mtp --num-speculative-tokens K"),))
    block_size: int = option("cache.block_size", "--block-size", help="tokens per KV block (default %(default)s)")
    num_blocks: int | None = option("cache.num_blocks", "--num-blocks", help="KV blocks (default: from memory)")
    memory_budget_bytes: int | None = option(
        "cache.memory_budget_bytes", "--memory-budget-gb", type=float, exclusive="memory",
        parse=lambda flag, gb: int(gb * 2**30),
        help="memory for weights + KV cache (default: half of what is free once the weights are loaded)")
    memory_fraction: float | None = option(
        "cache.memory_fraction", "--gpu-memory-utilization", "--mem-fraction-static", metavar="FRACTION",
        exclusive="memory", parse=_fraction,
        help="the fraction (0, 1] of the device's total memory for weights + KV cache + activation headroom, as "
        "vLLM's --gpu-memory-utilization (--mem-fraction-static: SGLang's name); refused at start when that much "
        "is not free")
    memory_utilization: float = option("cache.memory_utilization")  # of the memory free after the weights
    max_num_seqs: int = option(
        "scheduler.max_num_seqs", "--max-num-seqs", "--max-running-requests",
        help="running requests at most (default %(default)s; --max-running-requests: SGLang's name)")
    max_num_batched_tokens: int = option(
        "scheduler.max_num_batched_tokens", "--max-num-batched-tokens",
        help="tokens per step at most, prefill chunks and decodes (default %(default)s)",
        also=(Flag(("--enable-chunked-prefill",), given=True, sets=(),
                   help="accepted for vLLM's command lines, changes nothing: a prompt longer than "
                   "--max-num-batched-tokens is always prefilled in chunks"),))
    max_model_len: int | None = option(
        "scheduler.max_model_len", "--max-model-len", "--context-length",
        help="the context: prompt + completion tokens (--context-length: SGLang's name)")
    enable_prefix_caching: bool = option(
        "cache.enable_prefix_caching", "--no-prefix-caching", "--no-enable-prefix-caching", "--disable-radix-cache",
        help="no prefix caching (vLLM: --no-enable-prefix-caching, SGLang: --disable-radix-cache)",
        also=(Flag(("--enable-prefix-caching",), given=True, sets=(),
                   help="accepted for vLLM's command lines, changes nothing: prefix caching is on unless "
                   "--no-prefix-caching"),))
    dp: int = option(
        "parallel.dp", "--dp", "--data-parallel-size", "-dp", "--dp-size", group=PARALLEL,
        help="data-parallel attention groups (engine instances); --data-parallel-size and -dp (vLLM), --dp-size "
        "(SGLang) are aliases")
    tp: int = option(
        "parallel.tp", "--tp", "--tensor-parallel-size", "-tp", "--tp-size", group=PARALLEL,
        help="tensor-parallel ranks per DP group; --tensor-parallel-size and -tp (vLLM), --tp-size (SGLang) are "
        "aliases",
        also=(Flag(("--enable-expert-parallel",), given=True, sets=(), group=PARALLEL,
                   help="accepted for vLLM's command lines, changes nothing: epserve always runs the MoE layers "
                   "expert-parallel over all DP x TP ranks"),))
    dispatch: DispatchBackend = option(
        "parallel.dispatch", "--dispatch", group=PARALLEL,
        help="MoE token exchange (auto: local for EP 1, else all_to_all; padded: fixed shape, capturable; symm_mem: "
        "exact and capturable, CUDA with NVSHMEM)")
    dispatch_dtype: DispatchDtype = option(
        "parallel.dispatch_dtype", "--dispatch-dtype", group=PARALLEL,
        help="the token rows the MoE exchange sends: auto/model in the activation dtype, fp8 quantized as the FP8 "
        "expert GEMM would (e4m3 + a scale per 128 columns: about half the bytes; needs FP8 expert weights), nvfp4 "
        "as NVFP4 (e2m1 + an e4m3 scale per 16 columns + an fp32 scale per token: 0.28x the bf16 bytes; lossy; "
        "needs an NVFP4 checkpoint)")
    overlap: OverlapSetting = option("parallel.overlap", "--overlap", group=PARALLEL)
    microbatch_threshold: int | None = option(
        "parallel.microbatch_threshold", "--microbatch-threshold", group=PARALLEL,
        help="auto overlap: tokens per rank from which two micro-batches run (default: 256 on CUDA, never on CPU)")
    num_redundant_experts: int = option(
        "parallel.num_redundant_experts", "--num-redundant-experts", group=EPLB,
        help="extra expert slots holding replicas that share a busy expert's tokens")
    enable_eplb: bool = option(
        "eplb.enabled", "--enable-eplb", group=EPLB,
        help="place experts (and replicas) by the recent load while serving, moving weights between steps")
    eplb_window_size: int = option(
        "eplb.window_size", "--eplb-window-size", group=EPLB,
        help="steps of expert load a rebalance looks at (default %(default)s)")
    eplb_step_interval: int = option(
        "eplb.step_interval", "--eplb-step-interval", group=EPLB, help="steps between rebalances (default %(default)s)")
    eplb_replica_selection: ReplicaSelection = option(
        "eplb.replica_selection", "--eplb-replica-selection", group=EPLB,
        help="position: a token's replica by its row (even shares); local: the sender's rank, then node first")
    nnodes: int = option(
        "parallel.nnodes", "--nnodes", group=PARALLEL, help="hosts of the world; run the same command on each")
    node_rank: int = option("parallel.node_rank", "--node-rank", group=PARALLEL)
    master_addr: str = option(
        "parallel.master_addr", "--master-addr", group=PARALLEL, help="address of node 0 (rendezvous)")
    master_port: int | None = option(
        "parallel.master_port", "--master-port", group=PARALLEL, help="rendezvous port (default: a free one)")
    node_ip: str | None = option(
        "parallel.node_ip", "--node-ip", group=PARALLEL,
        help="this host's address the other hosts reach; gloo/NCCL use its interface (default: the interface that "
        "routes to --master-addr; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win)")
    rendezvous_timeout_s: float = option(
        "parallel.rendezvous_timeout_s", "--rendezvous-timeout", group=PARALLEL,
        help="seconds a rank waits for the rendezvous store at --master-addr to answer (default %(default)s)")

    @classmethod
    def of(cls, **options: Any) -> EngineOptions:
        """The options from keywords; TypeError naming any that is not one."""
        unknown = sorted(set(options) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown engine option{'s' * (len(unknown) > 1)} {', '.join(unknown)} (the options are "
                            "the fields of epserve.engine.options.EngineOptions)")
        return cls(**options)

    def placed(self) -> dict[str, dict[str, Any]]:
        """The options by the config they go in (``SECTIONS``): {section: {its field: value}}."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for f in fields(self):
            section, name = f.metadata["into"]
            sections[section][name] = getattr(self, f.name)
        return sections


def build_engine_config(
    model: str | Path | None = None, dtype: str = EngineOptions.dtype, device: str = EngineOptions.device,
    **options: Any,
) -> EngineConfig:
    """The engine configuration ``LLM`` and ``epserve serve`` start from (``model=None``: the built-in tiny
    checkpoint); the keywords are ``EngineOptions``' fields (TypeError for any other), ValueError for an
    inconsistent configuration. ``quantization``: ``"fp8"`` keeps FP8 block-scaled weights (quantizing a
    higher-precision checkpoint at load), ``None`` dequantizes at load, ``"auto"`` keeps an FP8 checkpoint's
    weights on CUDA and dequantizes on the CPU. ``dtype="auto"``: the checkpoint's ``torch_dtype`` (vLLM's).
    ``memory_fraction``: the share of the device's total memory for weights, KV cache and activations (vLLM's
    ``gpu_memory_utilization``; ``CacheConfig``). ``kv_cache_dtype``:
    ``"auto"`` (the model dtype) or ``"fp8"`` (e4m3, per-layer scale: twice the blocks in the same memory).
    ``cuda_graph`` (default on for CUDA) / ``compile`` (CPU): pure-decode steps run one captured CUDA graph / one
    ``torch.compile(fullgraph=True)`` forward per batch bucket up to ``cuda_graph_max_bs`` (default:
    ``max_num_seqs``, at most 256). ``speculative="mtp"``: decode with the checkpoint's MTP layer drafting
    ``num_speculative_tokens`` tokens per step (0: off), verified by the model in one forward (the output
    distribution is unchanged); ``"auto"`` (or None, the default): on one rank with a checkpoint that has an MTP
    layer, the engine measures at start-up whether one draft token a step pays and drafts only if it does
    (``engine/spec_probe.py``). ``num_redundant_experts`` extra expert slots hold replicas that share their
    expert's tokens; ``enable_eplb``: every ``eplb_step_interval`` steps the experts are placed by the load of the
    last ``eplb_window_size`` steps (``config.EplbConfig``)."""
    options = _speculative_options(options)
    placed = EngineOptions.of(dtype=dtype, device=device, **options).placed()
    if model is None:
        from epserve.presets import default_model_path

        model = default_model_path()
    path = str(model)
    model_config = ModelConfig.from_hf(path)
    if placed["engine"]["dtype"] == "auto":  # vLLM's: the checkpoint's own (FP8 checkpoints keep bf16 beside)
        stored = model_config.torch_dtype
        placed["engine"]["dtype"] = stored if stored in ("bfloat16", "float32", "float16") else "bfloat16"
    max_model_len = placed["scheduler"]["max_model_len"]
    if max_model_len is not None and max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len={max_model_len} exceeds the model's {model_config.max_position_embeddings} positions"
        )
    parallel = ParallelConfig(**placed["parallel"], eplb=EplbConfig(**placed["eplb"]))
    parallel.check_model(model_config)
    if device.startswith("cuda") and parallel.world_size > 1:
        import torch

        if parallel.local_world_size > torch.cuda.device_count():
            raise ValueError(
                f"{parallel.local_world_size} ranks per host need as many GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
    config = EngineConfig(model=model_config, model_path=path, cache=CacheConfig(**placed["cache"]),
                          scheduler=SchedulerConfig(**placed["scheduler"]), parallel=parallel, **placed["engine"])
    from epserve.model.quantization import resolve_fp8_weights  # (torch: not imported with the command line)

    resolve_fp8_weights(config.quantization, model_config, parallel.tp, device.split(":")[0])  # refuses what FP8 cannot
    return _speculation(config)


def _speculative_options(options: dict[str, Any]) -> dict[str, Any]:
    """``speculative="auto"`` is the default (None in the configuration); ValueError for a draft count it
    cannot go with: auto probes one draft token, more drafts are ``speculative="mtp"``'s."""
    method, num = options.get("speculative"), options.get("num_speculative_tokens")
    if method == "auto" and num is not None and num != 1:
        raise ValueError(f"speculative 'auto' (--speculative auto) probes one draft token a step at start-up; "
                         f"num_speculative_tokens {num} goes with --speculative mtp (always drafting), 0 with "
                         "neither (off)")
    if method is None and num is not None and num > 1:
        raise ValueError(f"num_speculative_tokens {num} (--num-speculative-tokens {num}) drafts with --speculative "
                         "mtp; the default (auto) probes one draft token a step, 0 is off")
    return {**options, "speculative": None} if method == "auto" else options


def _speculation(config: EngineConfig) -> EngineConfig:
    """The configuration, logged with whether the engine drafts and why (:func:`speculation_without_probe`)."""
    reason = speculation_without_probe(config)
    logger.info("speculative decoding: %s", reason or "auto: the engine measures at start-up whether the "
                "checkpoint's MTP layer pays")
    return config


def speculation_without_probe(config: EngineConfig) -> str | None:
    """Whether an engine of ``config`` drafts, and why, where its options decide it: ``speculative="mtp"`` drafts,
    0 draft tokens is off, and the default is off without an MTP layer, on several ranks or with ``compile``;
    None where the default is left to the engine's start-up probe (``engine/spec_probe.py``: one rank, a
    checkpoint with an MTP layer)."""
    if config.num_spec_tokens:
        return f"MTP, {config.num_spec_tokens} draft tokens a decode step"
    if config.speculative or not config.num_speculative_tokens:
        return "off (num_speculative_tokens 0)"
    if not config.model.num_nextn_predict_layers:
        return "off (the checkpoint has no MTP layer)"
    if config.parallel.world_size > 1:
        return (f"off: the start-up probe that decides it runs on one rank, not dp x tp = "
                f"{config.parallel.world_size}; --speculative mtp forces it")
    if config.compile:
        return ("off: the start-up probe does not run with --compile (each batch it ran would compile); "
                "--speculative mtp forces it")
    return None


# Its keywords, as inspect and help() show them: EngineOptions' fields, each with its default.
build_engine_config.__signature__ = inspect.signature(build_engine_config).replace(parameters=[
    *list(inspect.signature(build_engine_config).parameters.values())[:3],
    *(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
      for f in fields(EngineOptions) if f.name not in ("dtype", "device"))])
