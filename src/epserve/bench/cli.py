"""``epserve bench serve``: the serving benchmark's command line.

``epserve.cli`` calls ``add_parser(subparsers)`` and dispatches to ``args.func(args)``, which returns the
exit code (0, or 1 when every request failed) and raises ValueError for bad options or an unreachable
server (``epserve: error: ...``, exit code 2).
"""

from __future__ import annotations

import argparse
from typing import Any

from epserve.bench import datasets as D
from epserve.bench import serve as S


def add_parser(subparsers: Any) -> None:
    """Register ``bench`` (with its ``serve`` action) on an argparse subparsers object."""
    b = subparsers.add_parser(
        "bench", help="benchmark a running server",
        description="Benchmark clients for a running epserve (or any OpenAI-compatible) server.")
    actions = b.add_subparsers(dest="bench_command", metavar="{serve}", required=True)
    p = actions.add_parser(
        "serve", help="load a server with streamed completions and measure throughput and latency",
        description="Send a synthetic dataset of token-id prompts to POST /v1/completions (streamed, "
        "ignore_eos) at a Poisson request rate under an optional concurrency cap; report throughput, "
        "TTFT, TPOT, ITL, end-to-end latency and the prefix-cache hit rate.")
    p.add_argument("--base-url", default=S.DEFAULT_BASE_URL,
                   help=f"server URL (default {S.DEFAULT_BASE_URL})")
    p.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times (0)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0.0)")
    p.add_argument("--label", help="free text stored in the JSON and shown in the table")
    p.add_argument("--json", metavar="PATH", help="write the results and the options as JSON ('-': stdout "
                   "only, the table goes to stderr)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar (also EPSERVE_NO_PROGRESS=1)")

    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=D.DATASETS, default="random",
                   help="random: independent prompts; shared-prefix: groups sharing a system prompt")
    d.add_argument("--num-prompts", type=int,
                   help=f"requests to send (random: default {D.DEFAULT_NUM_PROMPTS}; shared-prefix: default "
                   "groups x prompts per group, fewer truncate, more cycle)")
    d.add_argument("--vocab-size", type=int,
                   help="token ids are drawn from [0, N) (default: from /v1/models, "
                   f"else {S.DEFAULT_VOCAB_SIZE})")
    d.add_argument("--random-input-len", type=int, default=D.DEFAULT_RANDOM_INPUT_LEN,
                   help=f"random: prompt tokens ({D.DEFAULT_RANDOM_INPUT_LEN})")
    d.add_argument("--random-output-len", type=int, default=D.DEFAULT_RANDOM_OUTPUT_LEN,
                   help=f"random: output tokens ({D.DEFAULT_RANDOM_OUTPUT_LEN})")
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len*(1-r), len*(1+r)] (0.0)")
    d.add_argument("--num-groups", type=int, default=D.DEFAULT_NUM_GROUPS,
                   help=f"shared-prefix: system prompts ({D.DEFAULT_NUM_GROUPS})")
    d.add_argument("--prompts-per-group", type=int, default=D.DEFAULT_PROMPTS_PER_GROUP,
                   help=f"shared-prefix: questions per system prompt ({D.DEFAULT_PROMPTS_PER_GROUP})")
    d.add_argument("--system-prompt-len", type=int, default=D.DEFAULT_SYSTEM_PROMPT_LEN,
                   help=f"shared-prefix: tokens of each system prompt ({D.DEFAULT_SYSTEM_PROMPT_LEN})")
    d.add_argument("--question-len", type=int, default=D.DEFAULT_QUESTION_LEN,
                   help=f"shared-prefix: tokens of each question ({D.DEFAULT_QUESTION_LEN})")
    d.add_argument("--output-len", type=int, default=D.DEFAULT_OUTPUT_LEN,
                   help=f"shared-prefix: output tokens ({D.DEFAULT_OUTPUT_LEN})")

    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests/s with Poisson arrivals; inf (default): all at once")
    load.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: unlimited)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0, or 1 when every request failed. ValueError for bad options or no server."""
    result = S.run_bench(args)
    return 1 if result.completed == 0 else 0
