"""The engine's command-line options (``epserve generate``, ``serve``, ``engine``): the model, its
precision, the KV cache, the scheduler, the parallel layout and EPLB, and the engine config they make.
vLLM's and SGLang's names for the same options are accepted too (docs/serving.md has the table)."""

from __future__ import annotations

import argparse
import json

from epserve.config import (
    DISPATCH_BACKENDS,
    KV_CACHE_DTYPES,
    OVERLAP_CHOICES,
    REPLICA_SELECTIONS,
    SPECULATIVE_METHODS,
    CacheConfig,
    EngineConfig,
    EplbConfig,
    ParallelConfig,
    SchedulerConfig,
)
from epserve.config.engine import DISPATCH_DTYPES

# Every default below is the config dataclasses' own (config/engine.py), never a second literal.


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: built-in tiny model)")
    p.add_argument("--model-path", default=None, metavar="MODEL",
                   help="the MODEL argument given as an option (SGLang's --model-path)")
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default=EngineConfig.device, help="cpu or cuda[:N]")
    p.add_argument("--quantization", default=EngineConfig.quantization, choices=["auto", "fp8", "none"],
                   help="weights: fp8 keeps FP8 block-scaled weights (quantizes a bf16 checkpoint at load), "
                   "none dequantizes at load, auto = fp8 for an FP8 checkpoint on CUDA, none on CPU")
    p.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="latent KV cache: auto (the model dtype) or fp8 (e4m3, twice the blocks)")
    p.add_argument("--no-cuda-graph", "--enforce-eager", "--disable-cuda-graph", action="store_true",
                   help="run decode steps eagerly, not as CUDA graphs (on one CPU rank: not as recorded kernel "
                   "calls) (vLLM: --enforce-eager, SGLang: --disable-cuda-graph)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=EngineConfig.cuda_graph_max_bs,
                   help="largest decode batch captured (CUDA graphs) or compiled (--compile); default max-num-seqs")
    p.add_argument("--compile", action="store_true",
                   help="CPU: decode steps through torch.compile(fullgraph=True), one graph per batch bucket")
    p.add_argument("--speculative", default=EngineConfig.speculative, choices=[m for m in SPECULATIVE_METHODS if m],
                   help="speculative decoding: mtp drafts with the checkpoint's multi-token prediction layer")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per decode step with --speculative (the MTP layer chained on itself; default "
                   f"{EngineConfig.num_speculative_tokens})")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's speculative decoding option: '{\"method\": \"deepseek_mtp\" (or \"mtp\"), "
                   "\"num_speculative_tokens\": K}' is --speculative mtp --num-speculative-tokens K")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=CacheConfig.num_blocks, help="KV blocks (default: from memory)")
    memory = p.add_mutually_exclusive_group()
    memory.add_argument("--memory-budget-gb", type=float, default=None,
                        help="memory for weights + KV cache (default: half of what is free once the weights are "
                        "loaded)")
    memory.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=None,
                        metavar="FRACTION",
                        help="the fraction (0, 1] of the device's total memory for weights + KV cache + activation "
                        "headroom, as vLLM's --gpu-memory-utilization (--mem-fraction-static: SGLang's name); "
                        "refused at start when that much is not free")
    p.add_argument("--max-num-seqs", "--max-running-requests", type=int, default=SchedulerConfig.max_num_seqs,
                   help="running requests at most (default %(default)s; --max-running-requests: SGLang's name)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens per step at most, prefill chunks and decodes (default %(default)s)")
    p.add_argument("--max-model-len", "--context-length", type=int, default=SchedulerConfig.max_model_len,
                   help="the context: prompt + completion tokens (--context-length: SGLang's name)")
    p.add_argument("--no-prefix-caching", "--no-enable-prefix-caching", "--disable-radix-cache", action="store_true",
                   help="no prefix caching (vLLM: --no-enable-prefix-caching, SGLang: --disable-radix-cache)")
    par = p.add_argument_group("parallelism (world = dp x tp = EP ranks)")
    par.add_argument("--dp", "--data-parallel-size", "-dp", "--dp-size", type=int, default=ParallelConfig.dp,
                     help="data-parallel attention groups (engine instances); --data-parallel-size and -dp (vLLM), "
                     "--dp-size (SGLang) are aliases")
    par.add_argument("--tp", "--tensor-parallel-size", "-tp", "--tp-size", type=int, default=ParallelConfig.tp,
                     help="tensor-parallel ranks per DP group; --tensor-parallel-size and -tp (vLLM), --tp-size "
                     "(SGLang) are aliases")
    par.add_argument("--enable-expert-parallel", action="store_true",
                     help="accepted for vLLM's command lines, changes nothing: epserve always runs the MoE layers "
                     "expert-parallel over all DP x TP ranks")
    par.add_argument("--dispatch", default=ParallelConfig.dispatch, choices=DISPATCH_BACKENDS,
                     help="MoE token exchange (auto: local for EP 1, else all_to_all; padded: fixed shape, "
                     "capturable; symm_mem: exact and capturable, CUDA with NVSHMEM)")
    par.add_argument("--dispatch-dtype", default=ParallelConfig.dispatch_dtype, choices=DISPATCH_DTYPES,
                     help="the token rows the MoE exchange sends: auto/model in the activation dtype, fp8 quantized "
                     "as the FP8 expert GEMM would (e4m3 + a scale per 128 columns: about half the bytes; needs "
                     "FP8 expert weights)")
    par.add_argument("--overlap", default=ParallelConfig.overlap, choices=OVERLAP_CHOICES)
    par.add_argument("--microbatch-threshold", type=int, default=ParallelConfig.microbatch_threshold,
                     help="auto overlap: tokens per rank from which two micro-batches run (default: 256 on "
                     "CUDA, never on CPU)")
    eplb = p.add_argument_group("expert load balancing (EPLB)")
    eplb.add_argument("--num-redundant-experts", type=int, default=ParallelConfig.num_redundant_experts,
                      help="extra expert slots holding replicas that share a busy expert's tokens")
    eplb.add_argument("--enable-eplb", action="store_true",
                      help="place experts (and replicas) by the recent load while serving, moving weights between steps")
    eplb.add_argument("--eplb-window-size", type=int, default=EplbConfig.window_size,
                      help="steps of expert load a rebalance looks at (default %(default)s)")
    eplb.add_argument("--eplb-step-interval", type=int, default=EplbConfig.step_interval,
                      help="steps between rebalances (default %(default)s)")
    eplb.add_argument("--eplb-replica-selection", default=EplbConfig.replica_selection, choices=REPLICA_SELECTIONS,
                      help="position: a token's replica by its row (even shares); local: the sender's rank, then "
                      "node first")
    par.add_argument("--nnodes", type=int, default=ParallelConfig.nnodes, help="hosts of the world; run the same command on each")
    par.add_argument("--node-rank", type=int, default=ParallelConfig.node_rank)
    par.add_argument("--master-addr", default=ParallelConfig.master_addr, help="address of node 0 (rendezvous)")
    par.add_argument("--master-port", type=int, default=ParallelConfig.master_port, help="rendezvous port (default: a free one)")
    par.add_argument("--node-ip", default=ParallelConfig.node_ip,
                     help="this host's address the other hosts reach; gloo/NCCL use its interface (default: the "
                     "interface that routes to --master-addr; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME win)")
    par.add_argument("--rendezvous-timeout", type=float, default=ParallelConfig.rendezvous_timeout_s,
                     help="seconds a rank waits for the rendezvous store at --master-addr to answer (default %(default)s)")
    add_foreign_flags(p)


_MULTI_HOST = "a world over several hosts is --nnodes, --node-rank, --master-addr, --master-port (docs/deployment.md)"
# vLLM's and SGLang's flags with no equivalent here (docs/serving.md's table): (names, nargs, the value that
# is harmless here, or "*" for any, or None for none; why). ``foreign_flags`` judges them after parsing.
FOREIGN_FLAGS: list[tuple[tuple[str, ...], int | str | None, str | None, str]] = [
    (("--trust-remote-code",), 0, "*", "changes nothing: epserve runs no code from the checkpoint"),
    (("--enable-ep-moe",), 0, "*", "changes nothing: the MoE layers always run expert-parallel over all dp x tp ranks"),
    (("--pipeline-parallel-size", "-pp", "--pp-size"), None, "1",
     "no pipeline parallelism: every rank runs all the layers (attention split by --tp, the experts spread over "
     "all dp x tp ranks); give --dp and --tp"),
    (("--ep-size", "--expert-parallel-size"), None, None,
     "expert parallelism always spans all dp x tp ranks: give --dp and --tp (EP = dp x tp)"),
    (("--tokenizer", "--tokenizer-path"), None, None, "the checkpoint's own tokenizer files are read (put them "
     "beside the weights)"),
    (("--cuda-graph-sizes",), "+", None, "give the largest captured batch with --cuda-graph-max-bs"),
    (("--chunked-prefill-size", "--max-prefill-tokens"), None, None,
     "--max-num-batched-tokens bounds the tokens of one step (prefill chunks and decodes)"),
    (("--page-size",), None, None, "--block-size is the tokens of one KV block"),
    (("--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
      "--speculative-num-draft-tokens"), None, None, "--speculative mtp --num-speculative-tokens K"),
    (("--data-parallel-address", "--data-parallel-rpc-port", "--data-parallel-size-local",
      "--data-parallel-start-rank", "--dist-init-addr"), None, None, _MULTI_HOST),
    (("--headless",), 0, None, _MULTI_HOST),
    (("--eplb-config", "--ep-num-redundant-experts", "--eplb-rebalance-num-iterations"), None, None,
     "--enable-eplb with --num-redundant-experts, --eplb-window-size, --eplb-step-interval"),
]
_FOREIGN = {name: (harmless, why) for names, _, harmless, why in FOREIGN_FLAGS for name in names}


class _ForeignFlag(argparse.Action):
    """A vLLM or SGLang flag with no equivalent here: recorded, judged by ``foreign_flags``."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        value = (" ".join(values) or None) if isinstance(values, list) else values  # (nargs 0: None)
        namespace.foreign_flags = [*(getattr(namespace, "foreign_flags", None) or ()), (option_string, value)]


def add_foreign_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM's and SGLang's flags without an equivalent",
                             "refused with the reason and what to use (docs/serving.md's table); --trust-remote-code, "
                             "--enable-ep-moe, --pipeline-parallel-size 1 and --ep-size DPxTP change nothing: accepted")
    for names, nargs, _, _ in FOREIGN_FLAGS:
        g.add_argument(*names, nargs=nargs, action=_ForeignFlag, dest="foreign_flags", default=None,
                       help=argparse.SUPPRESS)


def foreign_flags(args: argparse.Namespace) -> list[str]:
    """The notes for the harmless vLLM/SGLang flags given (``FOREIGN_FLAGS``); ValueError naming the first
    that has no equivalent, why, and what to use."""
    notes = []
    for flag, value in getattr(args, "foreign_flags", None) or ():
        harmless, why = _FOREIGN[flag]
        if flag in ("--ep-size", "--expert-parallel-size"):
            harmless = str(args.dp * args.tp)
        given = f"{flag} {value}" if value is not None else flag
        if harmless is None or (harmless != "*" and value != harmless):
            raise ValueError(f"{given}: no equivalent in epserve: {why} (docs/serving.md: vLLM's and SGLang's flags)")
        notes.append(f"{given} {why}" if why.startswith("changes nothing") else f"{given} changes nothing")
    return notes


def apply_model_path(args: argparse.Namespace) -> None:
    """``--model-path`` (SGLang's) as the MODEL argument; ValueError when both name different models."""
    path = getattr(args, "model_path", None)
    if path is not None:
        if args.model is not None and args.model != path:
            raise ValueError(f"MODEL {args.model} and --model-path {path} name different checkpoints; give one")
        args.model = path


def speculative_options(args: argparse.Namespace) -> tuple[str | None, int]:
    """``--speculative`` and ``--num-speculative-tokens``, or vLLM's ``--speculative-config`` JSON as
    them; ValueError naming what it cannot take."""
    num = EngineConfig.num_speculative_tokens if args.num_speculative_tokens is None else args.num_speculative_tokens
    if args.speculative_config is None:
        return args.speculative, num
    flag = "--speculative-config"
    if args.speculative is not None or args.num_speculative_tokens is not None:
        raise ValueError(f"{flag} replaces --speculative and --num-speculative-tokens; give one or the other")
    try:
        spec = json.loads(args.speculative_config)
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
    return "mtp", num


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options of ``_add_engine_args`` as keywords of ``build_engine_config`` / ``LLM``."""
    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    fraction = args.gpu_memory_utilization
    if fraction is not None and not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {fraction}")
    speculative, num_speculative_tokens = speculative_options(args)
    return dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
        memory_budget_bytes=budget, memory_fraction=fraction, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, dp=args.dp, tp=args.tp, dispatch=args.dispatch, overlap=args.overlap,
        dispatch_dtype=args.dispatch_dtype,
        microbatch_threshold=args.microbatch_threshold, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, node_ip=args.node_ip,
        rendezvous_timeout_s=args.rendezvous_timeout,
        quantization=None if args.quantization == "none" else args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        cuda_graph=False if args.no_cuda_graph else None, compile=args.compile, cuda_graph_max_bs=args.cuda_graph_max_bs,
        speculative=speculative, num_speculative_tokens=num_speculative_tokens,
        num_redundant_experts=args.num_redundant_experts, enable_eplb=args.enable_eplb,
        eplb_window_size=args.eplb_window_size, eplb_step_interval=args.eplb_step_interval,
        eplb_replica_selection=args.eplb_replica_selection,
    )


def engine_config(args: argparse.Namespace, **overrides: object):
    """The engine config of the options (``overrides``: keywords that replace some, e.g. a layout)."""
    from epserve.engine.llm import build_engine_config

    return build_engine_config(args.model, **{**engine_options(args), **overrides})
