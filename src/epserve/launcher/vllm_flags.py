"""vLLM's (and SGLang's) serving flags as their users type them, on ``epserve serve``, ``engine`` and
``router``: each accepted with its meaning here (``--max-logprobs``, ``--response-role`` and
``--return-tokens-as-token-ids`` become the router's ``OutputOptions``), accepted changing nothing, or
refused in one line naming what to use instead (:func:`judge_vllm_flags`, after parsing: never a bare
argparse error). The engine's own spellings
(``--dtype auto``, ``--kv-cache-dtype fp8_e4m3``, ``--enable-prefix-caching``, ``--enable-chunked-prefill``)
are declared with the engine's options (``engine/options.py``)."""

from __future__ import annotations

import argparse

from epserve.messages.sampling import MAX_LOGPROBS

# --tool-call-parser: the parsers here, and SGLang's names for them.
TOOL_CALL_PARSERS = {"deepseek_v3": "deepseek_v3", "deepseek_v31": "deepseek_v31",
                     "deepseekv3": "deepseek_v3", "deepseekv31": "deepseek_v31"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_seed_flag(g) -> None:  # noqa: ANN001 (an argument group)
    g.add_argument("--seed", type=int, default=None,
                   help="vLLM's: the engine's random state for requests without a seed; here always 0 (vLLM's "
                   "default), so only --seed 0 is accepted (a request's own seed makes it reproducible)")


def add_vllm_router_flags(g) -> None:  # noqa: ANN001 (an argument group)
    g.add_argument("--uvicorn-log-level", default=None, type=str.lower, metavar="LEVEL",
                   help=f"the HTTP server's log level ({', '.join(UVICORN_LOG_LEVELS)}; default: --log-level)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's command lines, changes nothing: the router logs no line per request")
    g.add_argument("--max-logprobs", type=int, default=None, metavar="N",
                   help="the most logprobs a request may ask for (logprobs, top_logprobs, prompt_logprobs); more is "
                   f"a 400 naming the field (default and most: {MAX_LOGPROBS}, vLLM's default)")
    g.add_argument("--response-role", default="assistant", metavar="ROLE",
                   help="the role of chat responses' messages (default: assistant)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs' tokens written token_id:<id> (for tokens that are not valid UTF-8 alone) in "
                   "requests that do not set return_tokens_as_token_ids themselves")


def tool_call_parser(value: str | None) -> str | None:
    """``--tool-call-parser``'s parser (SGLang's ``deepseekv3`` is ``deepseek_v3``); ValueError naming the
    choices for any other."""
    if value is None:
        return None
    parser = TOOL_CALL_PARSERS.get(value.replace("-", "_"))
    if parser is None:
        raise ValueError(f"--tool-call-parser {value}: no such parser here; DeepSeek-V3/R1's format is deepseek_v3 "
                         "(SGLang: deepseekv3), V3.1's deepseek_v31 (deepseekv31)")
    return parser


def uvicorn_log_level(args: argparse.Namespace) -> str:
    """The HTTP server's log level: ``--uvicorn-log-level``, else ``--log-level``."""
    level = getattr(args, "uvicorn_log_level", None)
    if level is None:
        return args.log_level.upper()
    if level not in UVICORN_LOG_LEVELS:
        raise ValueError(f"--uvicorn-log-level {level}: choose from {', '.join(UVICORN_LOG_LEVELS)}")
    return level.upper()


def judge_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Notes for the vLLM flags given that change nothing here; ValueError (one line: the flag, why, what to
    use) for one whose value epserve cannot honour."""
    notes = []
    seed = getattr(args, "seed", None) if getattr(args, "command", None) in ("serve", "engine") else None
    if seed is not None:
        if seed != 0:
            raise ValueError(f"--seed {seed}: the engine's random state for unseeded requests always starts at 0 "
                             "here (vLLM's default); give each request a seed to make it reproducible")
        notes.append("--seed 0 changes nothing: it is the engine's own")
    if getattr(args, "disable_log_requests", False):
        notes.append("--disable-log-requests changes nothing: the router logs no line per request")
    max_logprobs = getattr(args, "max_logprobs", None)
    if max_logprobs is not None and not 0 <= max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs {max_logprobs}: the engine gives at most {MAX_LOGPROBS} logprobs a token "
                         f"(vLLM's default); choose one in [0, {MAX_LOGPROBS}]")
    if max_logprobs == MAX_LOGPROBS:
        notes.append(f"--max-logprobs {MAX_LOGPROBS} changes nothing: it is the default")
    if not getattr(args, "response_role", "assistant").strip():
        raise ValueError("--response-role: give a role (vLLM's default: assistant)")
    if getattr(args, "enable_prefix_caching", False) and getattr(args, "no_prefix_caching", False):
        raise ValueError("--enable-prefix-caching and --no-prefix-caching contradict each other; give one")
    return notes
