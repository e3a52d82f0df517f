"""``epserve`` command line: serve, engine, router, generate, bench, make-checkpoint, plan."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import secrets
import sys

from epserve import env
from epserve.engine.args import (
    add_engine_args,
    apply_model_path,
    engine_config,
    engine_options,
    foreign_flags,
)
from epserve.launcher.args import (
    add_disaggregation_args,
    add_engine_serving_args,
    add_engine_token_arg,
    add_role_arg,
    add_router_args,
    disaggregated_layouts,
    router_options,
    serve_options,
    set_api_key,
)
from epserve.launcher.vllm_flags import judge_vllm_flags


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def _cmd_serve(args: argparse.Namespace) -> int:
    from epserve.launcher.processes import serve

    if args.nnodes != 1:
        raise ValueError("serve runs on one host; across hosts run `epserve engine` per host and `epserve router`")
    set_api_key(args)
    router = router_options(args)  # (first: a bad --chat-template is refused before the checkpoint is read)
    options = serve_options(args, 0)
    if options.token is None:  # one host: the router and the engines share a random token
        options = dataclasses.replace(options, token=secrets.token_urlsafe(24))
    layouts = disaggregated_layouts(args)
    if layouts is None:
        groups = [(engine_config(args), options)]
    else:  # prefill instances first, then decode instances (ports in that order when --engine-port is given)
        prefill_dp = layouts["prefill"]["dp"]
        spec = _disaggregated_speculation(args)
        groups = [(engine_config(args, **layouts[role], **spec),
                   dataclasses.replace(options, role=role, port=options.port + prefill_dp if options.port and
                                       role == "decode" else options.port))
                  for role in ("prefill", "decode")]
    return serve(groups, router, args.log_level.upper(), args.max_restarts)


def _disaggregated_speculation(args: argparse.Namespace) -> dict[str, object]:
    """Prefill and decode instances hand KV over, so they must agree on the MTP layer's: the default (each engine
    probing whether MTP pays) could decide differently on each side, so it is off there unless asked for."""
    options = engine_options(args)
    if options.get("speculative") == "mtp" or options.get("num_speculative_tokens") == 0:
        return {}
    logging.getLogger("epserve").info("speculative decoding: off for disaggregated serving (prefill and decode "
                                      "instances must agree on the KV layout); --speculative mtp forces it")
    return {"speculative": None, "num_speculative_tokens": 0}


def _cmd_engine(args: argparse.Namespace) -> int:
    from epserve.launcher.processes import run_engine

    return run_engine(engine_config(args), serve_options(args, 50051), args.max_restarts)


def _cmd_router(args: argparse.Namespace) -> int:

    from epserve.router.server import run_router

    set_api_key(args)
    run_router(router_options(args, tuple(args.engine or ()), tuple(args.prefill or ()), tuple(args.decode or ())),
               env.api_key())
    return 0


def _build_llm(args: argparse.Namespace):
    from epserve import LLM

    return LLM(args.model, **engine_options(args))


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


# make-checkpoint's shape flags: the config.json key each overrides (make_checkpoint's ``overrides``), and the
# least value it takes.
SHAPE_FLAGS: dict[str, tuple[str, int]] = {
    "--vocab-size": ("vocab_size", 2), "--hidden-size": ("hidden_size", 1),
    "--intermediate-size": ("intermediate_size", 1), "--moe-intermediate-size": ("moe_intermediate_size", 1),
    "--num-hidden-layers": ("num_hidden_layers", 1), "--first-k-dense-replace": ("first_k_dense_replace", 0),
    "--num-attention-heads": ("num_attention_heads", 1), "--n-routed-experts": ("n_routed_experts", 1),
    "--num-experts-per-tok": ("num_experts_per_tok", 1), "--n-group": ("n_group", 1), "--topk-group": ("topk_group", 1),
    "--q-lora-rank": ("q_lora_rank", 1), "--kv-lora-rank": ("kv_lora_rank", 1),
    "--max-position-embeddings": ("max_position_embeddings", 1),
    "--num-nextn-predict-layers": ("num_nextn_predict_layers", 0),
}


def _shape_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The config.json keys the shape flags and ``--override KEY=VALUE`` set; ValueError naming the flag for a
    value out of range, and for a shape the model's config refuses (``ModelConfig``'s own checks)."""
    import json

    overrides: dict[str, object] = {}
    for flag, (key, least) in SHAPE_FLAGS.items():
        value = getattr(args, key)
        if value is not None:
            if value < least:
                raise ValueError(f"{flag} must be an integer >= {least}, got {value}")
            overrides[key] = value
    if "num_attention_heads" in overrides:  # MLA: as many KV heads as query heads
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    for item in args.override or ():
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--override {item}: write KEY=VALUE (a config.json key; VALUE as JSON, else a string)")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text
    if overrides:
        from epserve.config import ModelConfig
        from epserve.presets import build_config

        try:
            ModelConfig.from_dict(build_config(args.preset, overrides=overrides))
        except ValueError as e:
            raise ValueError(f"the shape flags make a config the model refuses: {e}") from None
    return overrides


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    overrides = _shape_overrides(args)
    if args.train and (overrides or args.max_shard_bytes is not None):
        raise ValueError("--train trains its preset's shape: the shape flags, --override and --max-shard-bytes are "
                         "for random weights")
    if args.max_shard_bytes is not None and args.max_shard_bytes < 1:
        raise ValueError(f"--max-shard-bytes must be >= 1, got {args.max_shard_bytes}")
    if args.train:
        from epserve.training import TRAIN_PRESETS, train_checkpoint

        if args.preset not in TRAIN_PRESETS or args.fp8 or args.quantization != "none":
            quant = " --fp8" if args.fp8 else f" --quantization {args.quantization}" * (args.quantization != "none")
            raise ValueError(f"--train trains the {' or '.join(TRAIN_PRESETS)} shape in bfloat16/float32 (no --fp8, "
                             f"no --quantization); got --preset {args.preset}{quant}")
        path = train_checkpoint(args.dir, preset=args.preset, steps=args.train_steps, max_seconds=args.train_seconds,
                                seed=args.seed, dtype=args.dtype, progress=not env.progress_disabled())
        print(f"wrote trained {args.preset} checkpoint (with its MTP layer) to {path}; summary in {path}/training.json")
        return 0
    from epserve.presets import make_checkpoint

    quantization = "fp8" if args.fp8 else None if args.quantization == "none" else args.quantization
    if args.fp8 and args.quantization not in ("none", "fp8"):
        raise ValueError(f"--fp8 and --quantization {args.quantization} contradict each other")
    shards = {} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}
    path = make_checkpoint(args.dir, preset=args.preset, seed=args.seed, dtype=args.dtype, quantization=quantization,
                           overrides=overrides or None, **shards)
    shape = "".join(f" {k}={v}" for k, v in overrides.items())
    print(f"wrote {args.preset}{f' {quantization}' if quantization else ''} checkpoint{shape and ' with' + shape} "
          f"to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epserve", description="Expert-parallel inference for DeepSeek-V3-class MoE models."
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline with the engine")
    add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.set_defaults(func=_cmd_generate)

    srv = sub.add_parser("serve", help="serve the OpenAI API: engine ranks and the router on this host")
    add_engine_args(srv)
    add_engine_serving_args(srv)
    add_disaggregation_args(srv)
    add_router_args(srv)
    srv.set_defaults(func=_cmd_serve)

    eng = sub.add_parser("engine", help="this host's engine ranks (gRPC) of a multi-host deployment")
    add_engine_args(eng)
    add_engine_serving_args(eng)
    add_role_arg(eng)
    eng.set_defaults(func=_cmd_engine)

    rt = sub.add_parser("router", help="the OpenAI API router in front of running engine instances")
    rt.add_argument("model", nargs="?", default=None, help="checkpoint directory for the tokenizer (default: built-in)")
    rt.add_argument("--engine", action="append", metavar="HOST:PORT",
                    help="an engine instance's gRPC address (repeat for each)")
    rt.add_argument("--prefill", action="append", metavar="HOST:PORT",
                    help="disaggregation: a prefill instance (repeat; needs --decode instead of --engine)")
    rt.add_argument("--decode", action="append", metavar="HOST:PORT",
                    help="disaggregation: a decode instance (repeat; needs --prefill)")
    add_router_args(rt)
    add_engine_token_arg(rt)
    rt.set_defaults(func=_cmd_router)

    mk = sub.add_parser("make-checkpoint", help="write a random-weight (or --train: trained) checkpoint in the HF "
                        "DeepSeek-V3 format")
    mk.add_argument("dir")
    mk.add_argument("--preset", default="tiny", choices=["tiny", "small", "test"],
                    help="random weights: tiny or small; --train: tiny (or test, a very small shape)")
    mk.add_argument("--train", action="store_true",
                    help="train the model and its MTP layer on the built-in English corpus (Python's reference "
                    "help topics) instead of random weights, retraining the tokenizer: minutes on a CPU")
    mk.add_argument("--train-seconds", type=float, default=540.0,
                    help="--train: wall-clock budget (default 540); the last 30%% self-distils the MTP layer on "
                    "the main model's own predictions")
    mk.add_argument("--train-steps", type=int, default=None, help="--train: a fixed number of steps instead")
    mk.add_argument("--fp8", action="store_true", help="FP8 e4m3 weights with 128x128 block scales")
    mk.add_argument("--quantization", default="none", choices=["none", "fp8", "nvfp4"],
                    help="fp8: as --fp8; nvfp4: MLP and expert weights in NVFP4 as NVIDIA's ModelOpt exports them")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    shape = mk.add_argument_group("shape (random weights)", "override the preset's config.json fields, as "
                                  "make_checkpoint(overrides=...) does; e.g. --vocab-size 129280 fits DeepSeek's "
                                  "tokenizer files, copied into the directory afterwards")
    for flag, (key, _) in SHAPE_FLAGS.items():
        shape.add_argument(flag, type=int, default=None, dest=key, metavar="N")
    shape.add_argument("--override", action="append", metavar="KEY=VALUE",
                       help="any other config.json field (VALUE as JSON, else a string); repeatable")
    shape.add_argument("--max-shard-bytes", type=int, default=None, metavar="N",
                       help="the largest safetensors shard (default: make_checkpoint's)")
    mk.set_defaults(func=_cmd_make_checkpoint)

    from epserve.bench.cli import add_parser as add_bench_parser
    from epserve.planner.cli import add_parser as add_plan_parser

    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    env.quiet_grpc()
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    # (neither import loads torch: `epserve router` runs without it)
    from epserve.config import OutOfMemoryError
    from epserve.parallel.process import RankFailure

    try:
        apply_model_path(args)
        for note in (*foreign_flags(args), *judge_vllm_flags(args)):  # (refused ones raise ValueError: one line)
            logging.getLogger("epserve").warning("%s", note)
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
