"""The engine's command-line options (``epserve generate``, ``serve``, ``engine``): the model, its
precision, the KV cache, the scheduler, the parallel layout and EPLB, and the engine config they make."""

from __future__ import annotations

import argparse

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

# Every default below is the config dataclasses' own (config/engine.py), never a second literal.


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: built-in tiny model)")
    p.add_argument("--dtype", default=EngineConfig.dtype, choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default=EngineConfig.device, help="cpu or cuda[:N]")
    p.add_argument("--quantization", default=EngineConfig.quantization, choices=["auto", "fp8", "none"],
                   help="weights: fp8 keeps FP8 block-scaled weights (quantizes a bf16 checkpoint at load), "
                   "none dequantizes at load, auto = fp8 for an FP8 checkpoint on CUDA, none on CPU")
    p.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=KV_CACHE_DTYPES,
                   help="latent KV cache: auto (the model dtype) or fp8 (e4m3, twice the blocks)")
    p.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run decode steps eagerly, not as graphs")
    p.add_argument("--cuda-graph-max-bs", type=int, default=EngineConfig.cuda_graph_max_bs,
                   help="largest decode batch captured (CUDA graphs) or compiled (--compile); default max-num-seqs")
    p.add_argument("--compile", action="store_true",
                   help="CPU: decode steps through torch.compile(fullgraph=True), one graph per batch bucket")
    p.add_argument("--speculative", default=EngineConfig.speculative, choices=[m for m in SPECULATIVE_METHODS if m],
                   help="speculative decoding: mtp drafts with the checkpoint's multi-token prediction layer")
    p.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens,
                   help="draft tokens per decode step with --speculative (the MTP layer chained on itself; default %(default)s)")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size, help="tokens per KV block (default %(default)s)")
    p.add_argument("--num-blocks", type=int, default=CacheConfig.num_blocks, help="KV blocks (default: from memory)")
    p.add_argument("--memory-budget-gb", type=float, default=None, help="memory for weights + KV cache")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs,
                   help="running requests at most (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens,
                   help="tokens per step at most, prefill chunks and decodes (default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=SchedulerConfig.max_model_len)
    p.add_argument("--no-prefix-caching", action="store_true")
    par = p.add_argument_group("parallelism (world = dp x tp = EP ranks)")
    par.add_argument("--dp", type=int, default=ParallelConfig.dp, help="data-parallel attention groups (engine instances)")
    par.add_argument("--tp", type=int, default=ParallelConfig.tp, help="tensor-parallel ranks per DP group")
    par.add_argument("--dispatch", default=ParallelConfig.dispatch, choices=DISPATCH_BACKENDS,
                     help="MoE token exchange (auto: local for EP 1, else all_to_all)")
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


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options of ``_add_engine_args`` as keywords of ``build_engine_config`` / ``LLM``."""
    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    return dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
        memory_budget_bytes=budget, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, dp=args.dp, tp=args.tp, dispatch=args.dispatch, overlap=args.overlap,
        microbatch_threshold=args.microbatch_threshold, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port, node_ip=args.node_ip,
        rendezvous_timeout_s=args.rendezvous_timeout,
        quantization=None if args.quantization == "none" else args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        cuda_graph=False if args.no_cuda_graph else None, compile=args.compile, cuda_graph_max_bs=args.cuda_graph_max_bs,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        num_redundant_experts=args.num_redundant_experts, enable_eplb=args.enable_eplb,
        eplb_window_size=args.eplb_window_size, eplb_step_interval=args.eplb_step_interval,
        eplb_replica_selection=args.eplb_replica_selection,
    )


def engine_config(args: argparse.Namespace, **overrides: object):
    """The engine config of the options (``overrides``: keywords that replace some, e.g. a layout)."""
    from epserve.engine.llm import build_engine_config

    return build_engine_config(args.model, **{**engine_options(args), **overrides})
