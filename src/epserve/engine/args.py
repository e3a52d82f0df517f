"""The engine's command-line options (``epserve generate``, ``serve``, ``engine``), made from their one
declaration (``engine/options.py``'s ``EngineOptions``): the model, its precision, the KV cache, the scheduler,
the parallel layout and EPLB, and the engine config they make. vLLM's and SGLang's names for the same options are
accepted too (docs/serving.md has the table), and their flags without an equivalent refused with what to use."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import Field, fields
from typing import Any, Literal

from epserve.engine.options import EngineOptions, Flag, build_engine_config

_HINTS = typing.get_type_hints(EngineOptions)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The checkpoint (MODEL or ``--model-path``), then a flag for each of ``EngineOptions``' spellings."""
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: built-in tiny model)")
    p.add_argument("--model-path", default=None, metavar="MODEL",
                   help="the MODEL argument given as an option (SGLang's --model-path)")
    groups: dict[str | None, Any] = {None: p}
    exclusive: dict[str, Any] = {}
    for f in fields(EngineOptions):
        for flag in f.metadata["flags"]:
            if flag.group not in groups:
                groups[flag.group] = p.add_argument_group(flag.group)
            into = groups[flag.group]
            if flag.exclusive is not None:
                if flag.exclusive not in exclusive:
                    exclusive[flag.exclusive] = into.add_mutually_exclusive_group()
                into = exclusive[flag.exclusive]
            _add_flag(into, f, flag)
    add_foreign_flags(p)


def _add_flag(into: Any, f: Field, flag: Flag) -> None:
    """One flag: a switch (``store_true``), or a value of the field's type (its Literal's values as choices)."""
    kind, choices = _kind(f)
    extra = {} if flag.metavar is None else {"metavar": flag.metavar}
    if _given(f, flag) is not None:
        into.add_argument(*flag.names, action="store_true", help=flag.help)
        return
    into.add_argument(*flag.names, type=flag.type or kind, default=None if flag.unset or flag.sets else f.default,
                      choices=flag.choices or choices, help=flag.help, **extra)


def _kind(f: Field) -> tuple[type, tuple[str, ...] | None]:
    """The field's value type with None taken out, and its Literal's values (less None) as choices."""
    hint = _HINTS[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is Literal:
        return str, tuple(a for a in typing.get_args(hint) if a is not None)
    return hint, None


def _given(f: Field, flag: Flag) -> bool | None:
    """What a switch sets its field to (None: the flag takes a value)."""
    if flag.given is not None:
        return flag.given
    return (not f.default) if _kind(f)[0] is bool else None


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


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options ``add_engine_args`` parsed, as keywords of ``build_engine_config`` / ``LLM`` (every field of
    ``EngineOptions`` with a flag); ValueError naming a flag whose value is refused."""
    options: dict[str, Any] = {}
    joint: list[tuple[Flag, Any]] = []  # the flags that give other fields (--speculative-config): after their own
    for f in fields(EngineOptions):
        for flag in f.metadata["flags"]:
            value = getattr(args, flag.dest)
            if flag.sets is not None:
                joint.append((flag, value))
            elif _given(f, flag) is not None:
                options[f.name] = _given(f, flag) if value else f.default
            elif value is None:
                options[f.name] = f.default
            else:
                options[f.name] = flag.parse(flag.names[0], value) if flag.parse else value
    for flag, value in joint:
        if value is None or not flag.sets:
            continue
        own = [g for f in fields(EngineOptions) if f.name in flag.sets for g in f.metadata["flags"] if g.sets is None]
        if any(getattr(args, g.dest) not in (None, False) for g in own):
            raise ValueError(f"{flag.names[0]} replaces {' and '.join(g.names[0] for g in own)}; give one or the other")
        options.update(flag.parse(flag.names[0], value))
    return options


def engine_config(args: argparse.Namespace, **overrides: object):
    """The engine config of the options (``overrides``: keywords that replace some, e.g. a layout)."""
    return build_engine_config(args.model, **{**engine_options(args), **overrides})
