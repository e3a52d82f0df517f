"""``epserve`` command line: serve, engine, router, generate, bench, make-checkpoint, plan."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import secrets
import sys

from epserve import env
from epserve.config import (
    DISPATCH_BACKENDS,
    KV_CACHE_DTYPES,
    OVERLAP_CHOICES,
    REPLICA_SELECTIONS,
    SPECULATIVE_METHODS,
    EplbConfig,
)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: built-in tiny model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--quantization", default="auto", choices=["auto", "fp8", "none"],
                   help="weights: fp8 keeps FP8 block-scaled weights (quantizes a bf16 checkpoint at load), "
                   "none dequantizes at load, auto = fp8 for an FP8 checkpoint on CUDA, none on CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="latent KV cache: auto (the model dtype) or fp8 (e4m3, twice the blocks)")
    p.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run decode steps eagerly, not as graphs")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None,
                   help="largest decode batch captured (CUDA graphs) or compiled (--compile); default max-num-seqs")
    p.add_argument("--compile", action="store_true",
                   help="CPU: decode steps through torch.compile(fullgraph=True), one graph per batch bucket")
    p.add_argument("--speculative", default=None, choices=[m for m in SPECULATIVE_METHODS if m],
                   help="speculative decoding: mtp drafts with the checkpoint's multi-token prediction layer")
    p.add_argument("--num-speculative-tokens", type=int, default=1,
                   help="draft tokens per decode step with --speculative (the MTP layer chained on itself)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from memory)")
    p.add_argument("--memory-budget-gb", type=float, default=None, help="memory for weights + KV cache")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    par = p.add_argument_group("parallelism (world = dp x tp = EP ranks)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel attention groups (engine instances)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per DP group")
    par.add_argument("--dispatch", default="auto", choices=DISPATCH_BACKENDS,
                     help="MoE token exchange (auto: local for EP 1, else all_to_all)")
    par.add_argument("--overlap", default="auto", choices=OVERLAP_CHOICES)
    par.add_argument("--microbatch-threshold", type=int, default=None,
                     help="auto overlap: tokens per rank from which two micro-batches run (default: 256 on "
                     "CUDA, never on CPU)")
    eplb = p.add_argument_group("expert load balancing (EPLB)")
    eplb.add_argument("--num-redundant-experts", type=int, default=0,
                      help="extra expert slots holding replicas that share a busy expert's tokens")
    eplb.add_argument("--enable-eplb", action="store_true",
                      help="place experts (and replicas) by the recent load while serving, moving weights between steps")
    eplb.add_argument("--eplb-window-size", type=int, default=EplbConfig.window_size,
                      help="steps of expert load a rebalance looks at")
    eplb.add_argument("--eplb-step-interval", type=int, default=EplbConfig.step_interval,
                      help="steps between rebalances")
    eplb.add_argument("--eplb-replica-selection", default=EplbConfig.replica_selection, choices=REPLICA_SELECTIONS,
                      help="position: a token's replica by its row (even shares); local: the sender's rank, then "
                      "node first")
    par.add_argument("--nnodes", type=int, default=1, help="hosts of the world; run the same command on each")
    par.add_argument("--node-rank", type=int, default=0)
    par.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 (rendezvous)")
    par.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free one)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def _add_engine_serving_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine instances (gRPC)")
    g.add_argument("--engine-host", default="127.0.0.1", help="where DP-group leaders listen for gRPC")
    g.add_argument("--engine-port", type=int, default=None,
                   help="the leader of DP group i listens on ENGINE_PORT + i (serve: any free port; engine: 50051)")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after Ctrl-C/SIGTERM before they are aborted")
    g.add_argument("--step-timeout", type=float, default=60.0,
                   help="an instance whose step makes no progress this long (a rank hung or died) stops serving, "
                   "fails its requests, and its group is restarted")
    g.add_argument("--dist-timeout", type=float, default=None,
                   help="while serving, collectives give up after this many seconds (default: --step-timeout)")
    g.add_argument("--max-restarts", type=int, default=3,
                   help="times the engine group is restarted after a rank dies or hangs (one host only)")
    _add_engine_token_arg(g)


def _add_engine_token_arg(g) -> None:
    g.add_argument("--engine-token", default=None,
                   help="engines require it as gRPC call metadata, routers send it (or set EPSERVE_ENGINE_TOKEN; "
                   "default: the API key; serve: a random one)")


def _add_router_args(p: argparse.ArgumentParser) -> None:
    from epserve.serve.policy import POLICIES

    g = p.add_argument_group("router (OpenAI API)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: the MODEL argument)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 (or set EPSERVE_API_KEY)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="... with the key read from this file (keeps it off the command line)")
    g.add_argument("--policy", default="cache_aware", choices=POLICIES)
    g.add_argument("--cache-threshold", type=float, default=0.3,
                   help="cache_aware: route to the longest prefix match above this fraction of the prompt")
    g.add_argument("--balance-abs-threshold", type=int, default=32,
                   help="cache_aware: load is imbalanced when max - min exceeds this ...")
    g.add_argument("--balance-rel-threshold", type=float, default=1.5, help="... and max > this x min")
    g.add_argument("--max-tree-tokens", type=int, default=1 << 22,
                   help="cache_aware: prefix tokens remembered per instance (LRU beyond)")
    g.add_argument("--engine-wait-timeout", type=float, default=20.0,
                   help="seconds a request that has not started waits for a healthy engine instance (one being "
                   "restarted) before a 503")
    lim = p.add_argument_group("router limits (per HTTP request)")
    lim.add_argument("--max-request-bytes", type=int, default=4 << 20, help="larger bodies get 413 (default 4 MiB)")
    lim.add_argument("--max-choices-per-request", type=int, default=256,
                     help="most generations one request may ask for (prompts x n)")
    lim.add_argument("--header-timeout", type=float, default=10.0,
                     help="seconds for a request's headers to arrive, else the connection is closed")
    lim.add_argument("--body-timeout", type=float, default=30.0,
                     help="seconds for a request's body to arrive after its headers, else 408")
    lim.add_argument("--keep-alive-timeout", type=float, default=5.0,
                     help="seconds an idle kept-alive connection stays open")


def _router_options(args: argparse.Namespace, engines: tuple[str, ...] = ()):
    from epserve.serve.launcher import RouterOptions

    return RouterOptions(
        model=args.model, engines=engines, host=args.host, port=args.port, policy=args.policy,
        served_model_name=args.served_model_name, cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold, balance_rel_threshold=args.balance_rel_threshold,
        max_tree_tokens=args.max_tree_tokens, engine_wait_s=args.engine_wait_timeout, log_level=args.log_level.upper(),
        max_request_bytes=args.max_request_bytes, max_choices_per_request=args.max_choices_per_request,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout, engine_token=_engine_token(args),
    )


def _engine_options(args: argparse.Namespace) -> dict:
    """The engine options of ``_add_engine_args`` as keywords of ``build_engine_config`` / ``LLM``."""
    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    return dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size, num_blocks=args.num_blocks,
        memory_budget_bytes=budget, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, dp=args.dp, tp=args.tp, dispatch=args.dispatch, overlap=args.overlap,
        microbatch_threshold=args.microbatch_threshold, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=args.master_addr, master_port=args.master_port,
        quantization=None if args.quantization == "none" else args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        cuda_graph=False if args.no_cuda_graph else None, compile=args.compile, cuda_graph_max_bs=args.cuda_graph_max_bs,
        speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens,
        num_redundant_experts=args.num_redundant_experts, enable_eplb=args.enable_eplb,
        eplb_window_size=args.eplb_window_size, eplb_step_interval=args.eplb_step_interval,
        eplb_replica_selection=args.eplb_replica_selection,
    )


def _engine_config(args: argparse.Namespace):
    from epserve.engine.llm import build_engine_config

    return build_engine_config(args.model, **_engine_options(args))


def _serve_options(args: argparse.Namespace, default_port: int):
    from epserve.serve.engine_server import ServeOptions

    port = default_port if args.engine_port is None else args.engine_port
    if not 0 <= port < 65536:
        raise ValueError(f"--engine-port must be in [0, 65535], got {port}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not args.step_timeout > 0:
        raise ValueError(f"--step-timeout must be > 0, got {args.step_timeout}")
    if args.dist_timeout is not None and not args.dist_timeout > 0:
        raise ValueError(f"--dist-timeout must be > 0, got {args.dist_timeout}")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    return ServeOptions(host=args.engine_host, port=port, drain_timeout_s=args.drain_timeout,
                        token=_engine_token(args), step_timeout_s=args.step_timeout, dist_timeout_s=args.dist_timeout)


def _engine_token(args: argparse.Namespace) -> str | None:
    """--engine-token, else $EPSERVE_ENGINE_TOKEN, else the API key (--api-key or $EPSERVE_API_KEY)."""
    return args.engine_token or env.engine_token() or getattr(args, "api_key", None) or env.api_key()


def _set_api_key(args: argparse.Namespace) -> None:
    """--api-key, or the key in --api-key-file, as $EPSERVE_API_KEY: how the router (process) finds it,
    never on a command line. ValueError naming the file if it cannot be read or holds no key."""
    key = args.api_key
    if args.api_key_file is not None:
        from pathlib import Path

        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ValueError(f"--api-key-file {args.api_key_file} is not UTF-8 text") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
    if key:
        env.set_api_key(key)


def _cmd_serve(args: argparse.Namespace) -> int:
    from epserve.serve.launcher import serve

    if args.nnodes != 1:
        raise ValueError("serve runs on one host; across hosts run `epserve engine` per host and `epserve router`")
    _set_api_key(args)
    options = _serve_options(args, 0)
    if options.token is None:  # one host: the router and the engines share a random token
        options = dataclasses.replace(options, token=secrets.token_urlsafe(24))
    return serve(_engine_config(args), options, _router_options(args), args.log_level.upper(), args.max_restarts)


def _cmd_engine(args: argparse.Namespace) -> int:
    from epserve.serve.launcher import run_engine

    return run_engine(_engine_config(args), _serve_options(args, 50051), args.max_restarts)


def _cmd_router(args: argparse.Namespace) -> int:

    from epserve.serve.launcher import run_router

    _set_api_key(args)
    run_router(_router_options(args, tuple(args.engine)), env.api_key())
    return 0


def _build_llm(args: argparse.Namespace):
    from epserve import LLM

    return LLM(args.model, **_engine_options(args))


def _cmd_generate(args: argparse.Namespace) -> int:
    with _build_llm(args) as llm:
        return _generate(llm, args)


def _generate(llm, args: argparse.Namespace) -> int:
    from epserve import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["The quick brown fox", "Expert parallelism spreads"]
    if args.chat:
        if llm.tokenizer is None:
            raise ValueError("--chat needs a tokenizer in the checkpoint")
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            for p in prompts
        ]
    outputs = llm.generate(prompts, params)
    if not llm.is_main_process:  # one rank of a torchrun world, or a front end on a node other than 0
        return 0
    for prompt, out in zip(prompts, outputs):
        print(f"prompt: {prompt!r}\noutput: {out.text!r}\ntokens: {out.token_ids} ({out.finish_reason})\n")
    return 0


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    if args.train:
        from epserve.training import TRAIN_PRESETS, train_checkpoint

        if args.preset not in TRAIN_PRESETS or args.fp8:
            raise ValueError(f"--train trains the {' or '.join(TRAIN_PRESETS)} shape in bfloat16/float32 (no --fp8); "
                             f"got --preset {args.preset}{' --fp8' if args.fp8 else ''}")
        path = train_checkpoint(args.dir, preset=args.preset, steps=args.train_steps, max_seconds=args.train_seconds,
                                seed=args.seed, dtype=args.dtype, progress=not env.progress_disabled())
        print(f"wrote trained {args.preset} checkpoint (with its MTP layer) to {path}; summary in {path}/training.json")
        return 0
    from epserve.presets import make_checkpoint

    path = make_checkpoint(args.dir, preset=args.preset, fp8=args.fp8, seed=args.seed, dtype=args.dtype)
    print(f"wrote {args.preset}{' fp8' if args.fp8 else ''} checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epserve", description="Expert-parallel inference for DeepSeek-V3-class MoE models."
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline with the engine")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API: engine ranks and the router on this host")
    _add_engine_args(srv)
    _add_engine_serving_args(srv)
    _add_router_args(srv)
    srv.set_defaults(func=_cmd_serve)

    eng = sub.add_parser("engine", help="this host's engine ranks (gRPC) of a multi-host deployment")
    _add_engine_args(eng)
    _add_engine_serving_args(eng)
    eng.set_defaults(func=_cmd_engine)

    rt = sub.add_parser("router", help="the OpenAI API router in front of running engine instances")
    rt.add_argument("model", nargs="?", default=None, help="checkpoint directory for the tokenizer (default: built-in)")
    rt.add_argument("--engine", action="append", required=True, metavar="HOST:PORT",
                    help="an engine instance's gRPC address (repeat for each)")
    _add_router_args(rt)
    _add_engine_token_arg(rt)
    rt.set_defaults(func=_cmd_router)

    mk = sub.add_parser("make-checkpoint", help="write a random-weight (or --train: trained) checkpoint in the HF "
                        "DeepSeek-V3 format")
    mk.add_argument("dir")
    mk.add_argument("--preset", default="tiny", choices=["tiny", "small", "test"],
                    help="random weights: tiny or small; --train: tiny (or test, a very small shape)")
    mk.add_argument("--train", action="store_true",
                    help="train the model and its MTP layer on the built-in English corpus (Python's reference "
                    "help topics) instead of random weights, retraining the tokenizer: minutes on a CPU")
    mk.add_argument("--train-seconds", type=float, default=540.0, help="--train: wall-clock budget (default 540)")
    mk.add_argument("--train-steps", type=int, default=None, help="--train: a fixed number of steps instead")
    mk.add_argument("--fp8", action="store_true", help="FP8 e4m3 weights with 128x128 block scales")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    mk.set_defaults(func=_cmd_make_checkpoint)

    from epserve.bench.cli import add_parser as add_bench_parser
    from epserve.planner.cli import add_parser as add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from epserve.engine.memory import OutOfMemoryError
    from epserve.parallel.launch import RankFailure

    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, OutOfMemoryError) as e:  # ConfigError, CheckpointError: ValueError
        print(f"epserve: error: {e}", file=sys.stderr)
        return 2
    except RankFailure as e:
        print(f"epserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
