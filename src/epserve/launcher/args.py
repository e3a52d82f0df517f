"""The serving command-line options: engine instances (gRPC, timeouts, restarts, the engine token,
prefill/decode roles) and the router (OpenAI API, routing policy, HTTP limits), and the option objects
they make."""

from __future__ import annotations

import argparse

from epserve import env
from epserve.chat_template import load_chat_template
from epserve.config import ENGINE_ROLES
from epserve.engine_server.options import ServeOptions
from epserve.launcher.vllm_flags import (
    add_seed_flag,
    add_vllm_router_flags,
    tool_call_parser,
    uvicorn_log_level,
)
from epserve.router.server import RouterOptions


def add_engine_serving_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine instances (gRPC)")
    g.add_argument("--engine-host", default=ServeOptions.host, help="where DP-group leaders listen for gRPC")
    g.add_argument("--engine-port", type=int, default=None,
                   help="the leader of DP group i listens on ENGINE_PORT + i (serve: any free port; engine: 50051)")
    g.add_argument("--drain-timeout", type=float, default=ServeOptions.drain_timeout_s,
                   help="seconds running requests get to finish after Ctrl-C/SIGTERM before they are aborted")
    g.add_argument("--step-timeout", type=float, default=ServeOptions.step_timeout_s,
                   help="an instance whose step makes no progress this long (a rank hung or died) stops serving, "
                   "fails its requests, and its group is restarted")
    g.add_argument("--dist-timeout", type=float, default=None,
                   help="while serving, collectives give up after this many seconds (default: --step-timeout)")
    g.add_argument("--max-restarts", type=int, default=3,
                   help="times the engine group is restarted after a rank dies or hangs (one host only)")
    g.add_argument("--kv-transfer-timeout", type=float, default=ServeOptions.kv_transfer_timeout_s,
                   help="prefill/decode disaggregation: a decode instance gives up a request's prefill and KV "
                   "transfer after this many seconds (the router retries it on another prefill instance)")
    add_engine_token_arg(g)
    add_seed_flag(g)


def add_role_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--role", default=ServeOptions.role, choices=ENGINE_ROLES,
                   help="prefill/decode disaggregation: prefill instances run prompts and send their KV to decode "
                   "instances, which only decode (a router with --prefill and --decode pairs them)")


def add_disaggregation_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (one host)")
    g.add_argument("--disaggregate", action="store_true",
                   help="run prefill instances and decode instances, each side in its own layout, the router "
                   "pairing them (instead of --dp/--tp)")
    g.add_argument("--prefill-dp", type=int, default=None, help="prefill instances (DP groups; default 1)")
    g.add_argument("--prefill-tp", type=int, default=None, help="tensor-parallel ranks per prefill instance")
    g.add_argument("--decode-dp", type=int, default=None, help="decode instances (DP groups; default 1)")
    g.add_argument("--decode-tp", type=int, default=None, help="tensor-parallel ranks per decode instance")


def disaggregated_layouts(args: argparse.Namespace) -> dict[str, dict[str, int]] | None:
    """``{"prefill": {"dp": P, "tp": T}, "decode": {...}}`` for ``serve --disaggregate`` (None without
    it); ValueError for the side options without it, or with --dp/--tp."""
    sides = {"prefill": (args.prefill_dp, args.prefill_tp), "decode": (args.decode_dp, args.decode_tp)}
    if not args.disaggregate:
        given = [f"--{side}-{k}" for side, values in sides.items() for k, v in zip(("dp", "tp"), values)
                 if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} need --disaggregate")
        return None
    if args.dp != 1 or args.tp != 1:
        raise ValueError("with --disaggregate give each side's layout: --prefill-dp/--prefill-tp, "
                         "--decode-dp/--decode-tp")
    layouts = {}
    for side, (dp, tp) in sides.items():
        for name, value in (("dp", dp), ("tp", tp)):
            if value is not None and value < 1:
                raise ValueError(f"--{side}-{name} must be >= 1, got {value}")
        layouts[side] = {"dp": dp or 1, "tp": tp or 1}
    return layouts


def add_engine_token_arg(g) -> None:
    g.add_argument("--engine-token", default=None,
                   help="engines, routers and prefill/decode peers know each other by it: mutual TLS under a key "
                   "derived from it, never sent (or set EPSERVE_ENGINE_TOKEN; serve: a random one; otherwise none: "
                   "plaintext gRPC)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    from epserve.router.policy import POLICIES

    g = p.add_argument_group("router (OpenAI API)")
    g.add_argument("--host", default=RouterOptions.host)
    g.add_argument("--port", type=int, default=RouterOptions.port)
    g.add_argument("--served-model-name", default=None, help="model id in the API (default: the MODEL argument)")
    key = g.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 (or set EPSERVE_API_KEY)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="... with the key read from this file (keeps it off the command line)")
    g.add_argument("--policy", default=RouterOptions.policy, choices=POLICIES)
    g.add_argument("--cache-threshold", type=float, default=RouterOptions.cache_threshold,
                   help="cache_aware: route to the longest prefix match above this fraction of the prompt")
    g.add_argument("--balance-abs-threshold", type=int, default=RouterOptions.balance_abs_threshold,
                   help="cache_aware: load is imbalanced when max - min exceeds this ...")
    g.add_argument("--balance-rel-threshold", type=float, default=RouterOptions.balance_rel_threshold,
                   help="... and max > this x min")
    g.add_argument("--max-tree-tokens", type=int, default=RouterOptions.max_tree_tokens,
                   help="cache_aware: prefix tokens remembered per instance (LRU beyond)")
    g.add_argument("--engine-wait-timeout", type=float, default=RouterOptions.engine_wait_s,
                   help="seconds a request that has not started waits for a healthy engine instance (one being "
                   "restarted) before a 503")
    g.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="the chat template instead of the checkpoint's: a file's path, or the jinja template itself "
                   "(as vLLM's --chat-template)")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1"], type=lambda s: s.replace("-", "_"),
                   help="chat completions: the model's reasoning (DeepSeek-R1's and V3.1's <think>...</think>) as "
                   "reasoning_content beside content, whole and streamed (vLLM's and SGLang's flag)")
    g.add_argument("--tool-call-parser", default=None, metavar="deepseek_v3|deepseek_v31",
                   help="chat completions with tools: the checkpoint's tool-call format, parsed into tool_calls "
                   "(DeepSeek-V3/R1: deepseek_v3, V3.1: deepseek_v31; SGLang's deepseekv3, deepseekv31 too); "
                   "tool_choice required or a named function is then forced by a grammar (vLLM's flag)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice auto (the model decides whether to call a tool; needs --tool-call-parser)")
    g.add_argument("--generation-config", default=RouterOptions.generation_config, metavar="auto|vllm|DIR",
                   help="default sampling for requests that do not set it: auto = the checkpoint's "
                   "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, extra EOS ids), "
                   "vllm = none (OpenAI's defaults), or a directory holding a generation_config.json")
    add_vllm_router_flags(p.add_argument_group("vLLM's router flags", "accepted where they mean something here, "
                                               "else refused with what to use"))
    lim = p.add_argument_group("router limits (per HTTP request, per client, per router)")
    lim.add_argument("--max-request-bytes", type=int, default=RouterOptions.max_request_bytes,
                     help="larger bodies get 413 (default 4 MiB)")
    lim.add_argument("--max-choices-per-request", type=int, default=RouterOptions.max_choices_per_request,
                     help="most generations one request may ask for (prompts x n)")
    lim.add_argument("--header-timeout", type=float, default=RouterOptions.header_timeout_s,
                     help="seconds for a request's headers to arrive, else the connection is closed")
    lim.add_argument("--body-timeout", type=float, default=RouterOptions.body_timeout_s,
                     help="seconds for a request's body to arrive after its headers, else 408")
    lim.add_argument("--keep-alive-timeout", type=float, default=RouterOptions.keep_alive_timeout_s,
                     help="seconds an idle kept-alive connection stays open")
    lim.add_argument("--max-connections", type=int, default=RouterOptions.max_connections,
                     help="connections open at once; one more is answered 503 too_many_connections and closed")
    lim.add_argument("--max-body-bytes", type=int, default=None,
                     help="bytes of request bodies the router holds at once, all clients together; a request past "
                     "it gets 503 too_many_request_bytes before its body is read (default 16 x --max-request-bytes)")
    lim.add_argument("--max-client-body-bytes", type=int, default=None,
                     help="... and one client (its address) alone: 429 too_many_request_bytes past it (default 8 x "
                     "--max-request-bytes; behind a proxy every client has the proxy's address)")


def router_options(args: argparse.Namespace, engines: tuple[str, ...] = (), prefill: tuple[str, ...] = (),
                   decode: tuple[str, ...] = ()):

    return RouterOptions(
        model=args.model, engines=engines, prefill=prefill, decode=decode, host=args.host, port=args.port,
        policy=args.policy,
        served_model_name=args.served_model_name, cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold, balance_rel_threshold=args.balance_rel_threshold,
        max_tree_tokens=args.max_tree_tokens, engine_wait_s=args.engine_wait_timeout, log_level=uvicorn_log_level(args),
        max_request_bytes=args.max_request_bytes, max_choices_per_request=args.max_choices_per_request,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
        keep_alive_timeout_s=args.keep_alive_timeout, max_connections=args.max_connections,
        max_body_bytes=args.max_body_bytes, max_client_body_bytes=args.max_client_body_bytes,
        engine_token=engine_token(args), api_key=set_api_key(args),
        chat_template=None if args.chat_template is None else load_chat_template(args.chat_template),
        generation_config=args.generation_config,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=tool_call_parser(args.tool_call_parser),
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        response_role=args.response_role, return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_logprobs=RouterOptions.max_logprobs if args.max_logprobs is None else args.max_logprobs,
    )


def serve_options(args: argparse.Namespace, default_port: int):

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
    if not args.kv_transfer_timeout > 0:
        raise ValueError(f"--kv-transfer-timeout must be > 0, got {args.kv_transfer_timeout}")
    return ServeOptions(host=args.engine_host, port=port, drain_timeout_s=args.drain_timeout,
                        token=engine_token(args), step_timeout_s=args.step_timeout, dist_timeout_s=args.dist_timeout,
                        role=getattr(args, "role", "both"), kv_transfer_timeout_s=args.kv_transfer_timeout)


def engine_token(args: argparse.Namespace) -> str | None:
    """--engine-token, else $EPSERVE_ENGINE_TOKEN. Never the API key: whoever may call the HTTP API must
    not be able to pose as an engine or a router."""
    return args.engine_token or env.engine_token()


def set_api_key(args: argparse.Namespace) -> str | None:
    """The router's API key: --api-key, the key in --api-key-file, else $EPSERVE_API_KEY; kept in
    ``args.api_key`` (the router's options carry it to the router process, never on a command line) and
    taken out of this process's environment, which every process started from here inherits (the
    forkserver, the ranks, the router: none has a use for it). ValueError naming the file if it cannot
    be read or holds no key. Asking again gives the same key."""
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
    from_env = env.take_api_key()  # (out of the environment, whichever key is used)
    args.api_key = key or from_env or None
    return args.api_key
