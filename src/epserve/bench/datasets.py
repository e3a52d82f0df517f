"""The serving benchmark's synthetic datasets (token-id prompts) and request arrival times."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DATASETS = ("random", "shared-prefix")
DEFAULT_NUM_PROMPTS = 128  # random dataset (shared-prefix: groups x prompts per group)
DEFAULT_RANDOM_INPUT_LEN = 256
DEFAULT_RANDOM_OUTPUT_LEN = 32
DEFAULT_NUM_GROUPS = 16
DEFAULT_PROMPTS_PER_GROUP = 8
DEFAULT_SYSTEM_PROMPT_LEN = 512
DEFAULT_QUESTION_LEN = 64
DEFAULT_OUTPUT_LEN = 32


@dataclass
class BenchRequest:
    """One request of the dataset: the prompt's token ids and the number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int
    group: int | None = None  # shared-prefix: the index of the group whose system prompt it starts with


def _length_range(length: int, ratio: float) -> tuple[int, int]:
    lo = max(1, int(length * (1.0 - ratio)))
    return lo, max(lo, int(length * (1.0 + ratio)))


def _clamp_random(prompt_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    out = min(output_len, max_model_len - 1)
    return min(prompt_len, max_model_len - out), out


def _clamp_shared(system_len: int, question_len: int, output_len: int,
                  max_model_len: int) -> tuple[int, int, int]:
    """Fit system + question + output into max_model_len: output first, then the question, then the system."""
    out = min(output_len, max_model_len - 1)
    budget = max_model_len - out
    q = question_len
    if system_len + q > budget:
        q = max(min(q, budget - system_len), min(q, 1))
    return min(system_len, budget - q), q, out


def _distinct_tokens(rng: np.random.Generator, count: int, vocab_size: int) -> np.ndarray:
    """``count`` token ids, pairwise different while the vocabulary allows it."""
    return rng.choice(vocab_size, size=count, replace=count > vocab_size)


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int, first: int | None = None) -> list[int]:
    ids = rng.integers(0, vocab_size, size=n)
    if first is not None and n:
        ids[0] = first
    return ids.tolist()


@dataclass(frozen=True)
class DatasetOptions:
    """The synthetic datasets' knobs (the CLI options of the same names)."""

    num_prompts: int | None = None
    random_input_len: int = DEFAULT_RANDOM_INPUT_LEN
    random_output_len: int = DEFAULT_RANDOM_OUTPUT_LEN
    random_range_ratio: float = 0.0
    num_groups: int = DEFAULT_NUM_GROUPS
    prompts_per_group: int = DEFAULT_PROMPTS_PER_GROUP
    system_prompt_len: int = DEFAULT_SYSTEM_PROMPT_LEN
    question_len: int = DEFAULT_QUESTION_LEN
    output_len: int = DEFAULT_OUTPUT_LEN


def make_dataset(dataset: str, *, vocab_size: int, max_model_len: int, seed: int = 0,
                 **options: Any) -> list[BenchRequest]:
    """Build the requests of a synthetic dataset, deterministically from ``seed``.

    ``random``: ``num_prompts`` (default 128) independent prompts of uniform random token ids; prompt and
    output lengths uniform in ``[len * (1 - ratio), len * (1 + ratio)]``.

    ``shared-prefix``: ``num_groups`` random system prompts of ``system_prompt_len`` tokens, each followed by
    ``prompts_per_group`` random questions of ``question_len`` tokens. Questions of a group start with
    different tokens (and groups' system prompts too, vocabulary permitting), so two prompts of a group share
    exactly the system prompt. The requests are shuffled so groups interleave; ``num_prompts`` (default: all)
    truncates or cycles the shuffled list.

    Lengths are clamped so that prompt + output <= ``max_model_len`` (one warning if any is).
    """
    check_dataset_options(dataset, vocab_size=vocab_size, **options)
    o = DatasetOptions(**options)
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 (a prompt and an output token), not {max_model_len}")
    rng = np.random.default_rng(seed)
    if dataset == "random":
        return _random_dataset(rng, o.num_prompts or DEFAULT_NUM_PROMPTS, vocab_size, max_model_len,
                               o.random_input_len, o.random_output_len, o.random_range_ratio)
    return _shared_prefix_dataset(rng, o.num_prompts, vocab_size, max_model_len, o.num_groups, o.prompts_per_group,
                                  o.system_prompt_len, o.question_len, o.output_len)


def check_dataset_options(dataset: str, *, vocab_size: int = 1, **options: Any) -> None:
    """ValueError naming the option for a bad dataset option (only the chosen dataset's are checked)."""
    if dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, not {dataset!r}")
    o = DatasetOptions(**options)
    num_prompts = o.num_prompts
    if vocab_size < 1:
        raise ValueError(f"--vocab-size must be >= 1, not {vocab_size}")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, not {num_prompts}")
    if dataset == "random":
        checks = [("--random-input-len", o.random_input_len, 1), ("--random-output-len", o.random_output_len, 1)]
        if not 0.0 <= o.random_range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1], not {o.random_range_ratio}")
    else:
        checks = [("--num-groups", o.num_groups, 1), ("--prompts-per-group", o.prompts_per_group, 1),
                  ("--system-prompt-len", o.system_prompt_len, 0), ("--question-len", o.question_len, 0),
                  ("--output-len", o.output_len, 1)]
        if o.system_prompt_len + o.question_len < 1:
            raise ValueError("--system-prompt-len + --question-len must be >= 1")
    for name, value, low in checks:
        if value < low:
            raise ValueError(f"{name} must be >= {low}, not {value}")


def _random_dataset(rng: np.random.Generator, n: int, vocab_size: int, max_model_len: int, input_len: int,
                    output_len: int, ratio: float) -> list[BenchRequest]:
    in_lo, in_hi = _length_range(input_len, ratio)
    out_lo, out_hi = _length_range(output_len, ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=n)
    out_lens = rng.integers(out_lo, out_hi + 1, size=n)
    requests, clamped = [], 0
    for p_len, o_len in zip(in_lens.tolist(), out_lens.tolist()):
        p, o = _clamp_random(p_len, o_len, max_model_len)
        clamped += (p, o) != (p_len, o_len)
        requests.append(BenchRequest(_random_tokens(rng, p, vocab_size), o))
    if clamped:
        logger.warning("clamped %d of %d requests so that prompt + output <= max_model_len %d",
                       clamped, n, max_model_len)
    return requests


def _shared_prefix_dataset(rng: np.random.Generator, num_prompts: int | None, vocab_size: int,
                           max_model_len: int, num_groups: int, per_group: int, system_len: int,
                           question_len: int, output_len: int) -> list[BenchRequest]:
    sys_len, q_len, out = _clamp_shared(system_len, question_len, output_len, max_model_len)
    if (sys_len, q_len, out) != (system_len, question_len, output_len):
        logger.warning("clamped shared-prefix lengths to system prompt %d + question %d + output %d tokens "
                       "to fit max_model_len %d", sys_len, q_len, out, max_model_len)
    group_firsts = _distinct_tokens(rng, num_groups, vocab_size).tolist()
    requests = []
    for g in range(num_groups):
        system = _random_tokens(rng, sys_len, vocab_size, group_firsts[g])
        question_firsts = _distinct_tokens(rng, per_group, vocab_size).tolist()
        for j in range(per_group):
            question = _random_tokens(rng, q_len, vocab_size, question_firsts[j])
            requests.append(BenchRequest(system + question, out, group=g))
    requests = [requests[i] for i in rng.permutation(len(requests)).tolist()]
    n = num_prompts or len(requests)
    return [requests[i % len(requests)] for i in range(n)]


# --------------------------------------------------------------------------------------------- arrivals


def poisson_delays(rate: float, n: int, seed: int = 0) -> list[float]:
    """``n`` exponential inter-arrival gaps (seconds) of a Poisson process at ``rate`` requests/s.

    ``rate == inf`` gives zeros (every request at once). Request ``i`` is sent ``sum(gaps[:i])`` after the
    start.
    """
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), not {rate}")
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n).tolist()


def arrival_offsets(delays: Sequence[float]) -> list[float]:
    """Send times from the start: the first request at 0, request ``i`` after the first ``i`` gaps."""
    return [0.0, *np.cumsum(delays[:-1]).tolist()] if len(delays) else []


