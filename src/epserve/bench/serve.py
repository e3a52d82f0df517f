"""``epserve bench serve``: load an OpenAI-compatible server with streamed completions and measure it.

The client builds a synthetic dataset of token-id prompts (``random`` or ``shared-prefix``), sends them to
``POST /v1/completions`` with ``stream=True`` at a Poisson request rate (or all at once) under an optional
concurrency cap, times every server-sent event, and reports throughput, TTFT, TPOT, ITL, end-to-end latency
and the prefix-cache hit rate the server reports in ``usage.prompt_tokens_details.cached_tokens``.

Timing conventions (all per successful request):

* TTFT: from sending the request to the first chunk that carries a choice (the server sends one for every
  engine output step, even when the step's text is held back and the chunk's text is ``""``).
* ITL: the gaps between successive chunks that carry a choice (a chunk may hold several tokens).
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` for requests with more than one output token.
* e2e: from sending the request to ``data: [DONE]``.

``output_tokens`` is ``usage.completion_tokens`` when the server sends usage, else the number of choice
chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

DATASETS = ("random", "shared-prefix")
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_MODEL_LEN = 2048  # when /v1/models does not say
DEFAULT_VOCAB_SIZE = 512
DEFAULT_NUM_PROMPTS = 128  # random dataset (shared-prefix: groups x prompts per group)
DEFAULT_RANDOM_INPUT_LEN = 256
DEFAULT_RANDOM_OUTPUT_LEN = 32
DEFAULT_NUM_GROUPS = 16
DEFAULT_PROMPTS_PER_GROUP = 8
DEFAULT_SYSTEM_PROMPT_LEN = 512
DEFAULT_QUESTION_LEN = 64
DEFAULT_OUTPUT_LEN = 32
READ_TIMEOUT_S = 6 * 3600.0
CONNECT_TIMEOUT_S = 60.0
MODELS_TIMEOUT_S = 30.0
PROBE_PROMPT_LEN = 8
MAX_ERRORS_KEPT = 5
DONE = "[DONE]"


class StreamError(RuntimeError):
    """The server sent an error inside a stream, or the stream was malformed."""


# --------------------------------------------------------------------------------------------- datasets


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


# --------------------------------------------------------------------------------------------- SSE


class SSEDecoder:
    """Incremental server-sent-events decoder: feed lines (without the newline), get each event's data."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line; return the event's data when this (blank) line ends an event that had data."""
        line = line.rstrip("\r\n")
        if not line:
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event's data (a stream that ends without a blank line), or None."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def parse_sse_lines(lines: Iterable[str]) -> tuple[list[dict[str, Any]], bool]:
    """Decode a complete completion stream: its JSON chunks before ``[DONE]``, and whether ``[DONE]`` came.

    Raises StreamError for a chunk that is not JSON or that carries an ``error`` object.
    """
    decoder, chunks = SSEDecoder(), []
    for data in [*(decoder.feed(line) for line in lines), decoder.flush()]:
        if data is None:
            continue
        if data.strip() == DONE:
            return chunks, True
        chunks.append(decode_chunk(data))
    return chunks, False


def decode_chunk(data: str) -> dict[str, Any]:
    """Parse one event's JSON data; raise StreamError for bad JSON or an error payload."""
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"bad JSON in the stream: {data[:200]!r}") from e
    if not isinstance(chunk, dict):
        raise StreamError(f"unexpected stream event: {data[:200]!r}")
    if chunk.get("error"):
        raise StreamError(f"error in the stream: {_error_text(chunk)}")
    return chunk


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            msg = err.get("message") or json.dumps(err)
            kind = err.get("type")
            return f"{msg} ({kind})" if kind else str(msg)
        if err is not None:
            return str(err) if not isinstance(err, list) else json.dumps(err)
    return json.dumps(body)[:300]


def error_message(status: int, body: bytes | str) -> str:
    """``HTTP <status>: <message>`` from an error response (OpenAI ``{"error": {...}}``, FastAPI, or text)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        msg = _error_text(json.loads(text))
    except json.JSONDecodeError:
        msg = text.strip()[:300] or "(empty body)"
    return f"HTTP {status}: {msg}"


# --------------------------------------------------------------------------------------------- records


@dataclass
class RequestRecord:
    """What one request measured. Times in seconds; ``start_time`` is relative to the benchmark's start."""

    success: bool
    prompt_len: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    start_time: float = 0.0
    error: str = ""


class StreamAccumulator:
    """Turns the timed chunks of one streamed completion into a RequestRecord."""

    def __init__(self, start: float, prompt_len: int) -> None:
        self.start = start
        self.prompt_len = prompt_len
        self.ttft: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self._last = start

    def add(self, chunk: dict[str, Any], now: float) -> None:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not chunk.get("choices"):
            return
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self._last)
        self._last = now
        self.chunks += 1

    def finish(self, now: float, done: bool) -> RequestRecord:
        rec = RequestRecord(success=False, prompt_len=self.prompt_len, e2e=now - self.start)
        usage = self.usage or {}
        if isinstance(usage.get("prompt_tokens"), int):
            rec.prompt_len = usage["prompt_tokens"]
        completion = usage.get("completion_tokens")
        rec.output_tokens = completion if isinstance(completion, int) else self.chunks
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)
        if not done:
            rec.error = "the stream ended without data: [DONE]"
        elif self.ttft is None:
            rec.error = "the stream carried no completion chunk"
        else:
            rec.success, rec.ttft, rec.itl = True, self.ttft, self.itl
        return rec


# --------------------------------------------------------------------------------------------- metrics


@dataclass
class BenchResult:
    """Summary of a benchmark run; latencies in milliseconds, throughputs per second of ``duration_s``."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    total_token_throughput: float
    cache_hit_rate: float | None
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2e_ms: float | None
    median_e2e_ms: float | None
    p99_e2e_ms: float | None
    max_concurrency: int | None = None
    request_rate: float = math.inf
    errors: list[str] = field(default_factory=list)  # the first few distinct error messages, with counts

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: an infinite request rate becomes the string ``"inf"``."""
        d = asdict(self)
        d["request_rate"] = _json_float(self.request_rate)
        return d


def _json_float(x: float) -> float | str:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def _stats_ms(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
    if not len(values):
        return None, None, None
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))


def summarize(records: Sequence[RequestRecord], duration: float, *, max_concurrency: int | None = None,
              request_rate: float = math.inf, max_errors: int = MAX_ERRORS_KEPT) -> BenchResult:
    """Aggregate per-request records; failed requests count only in ``failed`` and ``errors``."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    counts: dict[str, int] = {}
    for r in failed:
        counts[r.error] = counts.get(r.error, 0) + 1
    errors = [f"{msg} (x{n})" if n > 1 else msg for msg, n in list(counts.items())[:max_errors]]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    n_cached = sum(r.cached_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    ttft, tpot = _stats_ms([r.ttft for r in ok]), _stats_ms(tpots)
    itl, e2e = _stats_ms([g for r in ok for g in r.itl]), _stats_ms([r.e2e for r in ok])
    return BenchResult(
        completed=len(ok), failed=len(failed), duration_s=duration,
        total_input_tokens=n_in, total_output_tokens=n_out, total_cached_tokens=n_cached,
        request_throughput=per_s(len(ok)), input_token_throughput=per_s(n_in),
        output_token_throughput=per_s(n_out), total_token_throughput=per_s(n_in + n_out),
        cache_hit_rate=n_cached / n_in if n_in else None,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], p99_ttft_ms=ttft[2],
        mean_tpot_ms=tpot[0], median_tpot_ms=tpot[1], p99_tpot_ms=tpot[2],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], p99_itl_ms=itl[2],
        mean_e2e_ms=e2e[0], median_e2e_ms=e2e[1], p99_e2e_ms=e2e[2],
        max_concurrency=max_concurrency, request_rate=request_rate, errors=errors,
    )


def format_result(result: BenchResult, label: str | None = None, model: str | None = None) -> str:
    """The human-readable table."""
    width = 50

    def title(text: str, fill: str) -> str:
        return f" {text} ".center(width, fill)

    def row(name: str, value: Any, fmt: str = ".2f") -> str:
        if value is None:
            shown = "n/a"
        elif isinstance(value, float) and math.isfinite(value):
            shown = format(value, fmt)
        else:
            shown = str(value)
        return f"{name + ':':<40}{shown:>10}"

    lines = [title("Serving Benchmark Result", "=")]
    if label:
        lines.append(row("Label", label))
    if model:
        lines.append(row("Model", model))
    lines += [
        row("Successful requests", result.completed),
        row("Failed requests", result.failed),
        row("Maximum request concurrency", result.max_concurrency if result.max_concurrency else "inf"),
        row("Request rate (req/s)", result.request_rate),
        row("Benchmark duration (s)", result.duration_s),
        row("Total input tokens", result.total_input_tokens),
        row("Total generated tokens", result.total_output_tokens),
        row("Cached prompt tokens", result.total_cached_tokens),
        row("Prefix cache hit rate (%)",
            None if result.cache_hit_rate is None else 100 * result.cache_hit_rate),
        row("Request throughput (req/s)", result.request_throughput),
        row("Input token throughput (tok/s)", result.input_token_throughput),
        row("Output token throughput (tok/s)", result.output_token_throughput),
        row("Total token throughput (tok/s)", result.total_token_throughput),
    ]
    for key, name, heading in (("ttft", "TTFT", "Time to First Token"),
                               ("tpot", "TPOT", "Time per Output Token (excl. 1st)"),
                               ("itl", "ITL", "Inter-token Latency"), ("e2e", "E2E", "End-to-end Latency")):
        lines.append(title(heading, "-"))
        for stat in ("mean", "median", "p99"):
            lines.append(row(f"{stat.capitalize() if stat != 'p99' else 'P99'} {name} (ms)",
                             getattr(result, f"{stat}_{key}_ms")))
    if result.errors:
        lines.append(title("Errors", "-"))
        lines += [f"  {e}" for e in result.errors]
    lines.append("=" * width)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- client


@dataclass
class ServerInfo:
    """What ``GET /v1/models`` told about the model to benchmark."""

    model: str
    max_model_len: int
    vocab_size: int
    models: list[str]


def normalize_base_url(url: str) -> str:
    """``http://host:port`` without a trailing ``/`` or ``/v1``."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, not {url!r}")
    return url


async def fetch_server_info(client: httpx.AsyncClient, base_url: str, model: str | None,
                            headers: dict[str, str]) -> ServerInfo:
    """``GET /v1/models``; ValueError("cannot reach the server at ...") when that fails."""
    import httpx

    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url, headers=headers, timeout=MODELS_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {base_url}: {str(e) or type(e).__name__}") from None
    if resp.status_code != 200:
        raise ValueError(f"cannot reach the server at {base_url}: GET /v1/models answered "
                         f"{error_message(resp.status_code, resp.content)}")
    try:
        entries = [e for e in resp.json().get("data", []) if isinstance(e, dict) and "id" in e]
    except (ValueError, AttributeError):
        raise ValueError(f"cannot reach the server at {base_url}: GET /v1/models did not answer a model "
                         f"list: {resp.text[:200]!r}") from None
    names = [str(e["id"]) for e in entries]
    if model is None:
        if not entries:
            raise ValueError(f"the server at {base_url} lists no models; pass --model")
        model = names[0]
    entry = next((e for e in entries if e["id"] == model), {})
    mml, vocab = entry.get("max_model_len"), entry.get("vocab_size")
    return ServerInfo(model=model, models=names,
                      max_model_len=mml if isinstance(mml, int) and mml > 0 else DEFAULT_MAX_MODEL_LEN,
                      vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else DEFAULT_VOCAB_SIZE)


def completion_payload(model: str, req: BenchRequest, temperature: float) -> dict[str, Any]:
    return {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str],
                       origin: float | None = None) -> RequestRecord:
    """POST one streamed completion and time its chunks; never raises for server or network errors.

    ``origin``: the ``time.perf_counter()`` of the benchmark's start, for the record's ``start_time``.
    """
    start = time.perf_counter()
    rec = await _send(client, url, payload, headers, start)
    rec.start_time = start - (start if origin is None else origin)
    return rec


async def _send(client: httpx.AsyncClient, url: str, payload: dict[str, Any], headers: dict[str, str],
                start: float) -> RequestRecord:
    prompt_len = len(payload["prompt"])
    acc = StreamAccumulator(start, prompt_len)
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = await resp.aread()
                return RequestRecord(False, prompt_len, e2e=time.perf_counter() - start,
                                     error=error_message(resp.status_code, body))
            decoder, end = SSEDecoder(), None
            async for line in resp.aiter_lines():
                data = decoder.feed(line)
                if data is None or end is not None:  # after [DONE]: drain, so the connection is reused
                    continue
                if data.strip() == DONE:
                    end = time.perf_counter()
                else:
                    acc.add(decode_chunk(data), time.perf_counter())
            tail = None if end is not None else decoder.flush()  # a last event without its blank line
            if tail is not None:
                if tail.strip() == DONE:
                    end = time.perf_counter()
                else:
                    acc.add(decode_chunk(tail), time.perf_counter())
    except StreamError as e:
        return RequestRecord(False, prompt_len, e2e=time.perf_counter() - start, error=str(e))
    except Exception as e:  # network errors, timeouts, protocol errors: a failed request, not a crash
        return RequestRecord(False, prompt_len, e2e=time.perf_counter() - start,
                             error=f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return acc.finish(time.perf_counter() if end is None else end, done=end is not None)


def _progress_disabled(args: argparse.Namespace) -> bool:
    if getattr(args, "disable_tqdm", False):
        return True
    return os.environ.get("EPSERVE_NO_PROGRESS", "") not in ("", "0")


def validate_args(args: argparse.Namespace) -> None:
    """ValueError naming the option for values argparse cannot reject; runs before contacting the server."""
    check_dataset_options(args.dataset, vocab_size=args.vocab_size or 1,
                          **{k: v for k, v in _dataset_kwargs(args).items() if k != "seed"})
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), not {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, not {args.max_concurrency}")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(f"--vocab-size must be >= 1, not {args.vocab_size}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, not {args.temperature}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, not {args.seed}")
    json_path = getattr(args, "json", None)
    if json_path and json_path != "-":
        parent = Path(json_path).expanduser().resolve().parent
        if not parent.is_dir():
            raise ValueError(f"--json {json_path}: the directory {parent} does not exist")
    normalize_base_url(args.base_url)


def _dataset_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"seed": args.seed, **{f.name: getattr(args, f.name) for f in fields(DatasetOptions)}}


def _make_dataset_from_args(args: argparse.Namespace, info: ServerInfo) -> list[BenchRequest]:
    vocab = args.vocab_size or info.vocab_size
    return make_dataset(args.dataset, vocab_size=vocab, max_model_len=info.max_model_len,
                        **_dataset_kwargs(args))


async def _bench(
    args: argparse.Namespace,
) -> tuple[ServerInfo, list[BenchRequest], list[RequestRecord], float, float]:
    import httpx

    base_url = normalize_base_url(args.base_url)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=args.max_concurrency or 1024)
    # trust_env=False: a benchmark must not go through an HTTP proxy from the environment.
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        info = await fetch_server_info(client, base_url, args.model, headers)
        requests = _make_dataset_from_args(args, info)
        url = f"{base_url}/v1/completions"
        n = len(requests)
        mean_in = sum(len(r.prompt_token_ids) for r in requests) / n
        mean_out = sum(r.output_len for r in requests) / n
        print(f"epserve bench serve: {base_url} model {info.model} (max_model_len {info.max_model_len}); "
              f"{args.dataset}: {n} requests, mean prompt {mean_in:.1f} / output {mean_out:.1f} tokens; "
              f"rate {args.request_rate} req/s, max concurrency {args.max_concurrency or 'inf'}",
              file=sys.stderr)

        # One short request first, with a prompt outside the dataset (so it warms no prefix the run uses):
        # a wrong --model, a bad key or a broken server fails here, before the timed run.
        probe_rng = np.random.default_rng([args.seed, 0x7E57])
        probe_len = min(PROBE_PROMPT_LEN, info.max_model_len - 1)
        probe = BenchRequest(probe_rng.integers(0, args.vocab_size or info.vocab_size, probe_len).tolist(), 1)
        probe_payload = completion_payload(info.model, probe, args.temperature)
        rec = await send_request(client, url, probe_payload, headers)
        if not rec.success:
            hint = ""
            if rec.error.startswith("HTTP 404") and info.model not in info.models:
                hint = f" (--model {info.model!r}; the server lists {', '.join(info.models) or 'no models'})"
            raise ValueError(f"the test request to {url} failed: {rec.error}{hint}")

        from tqdm.auto import tqdm

        offsets = arrival_offsets(poisson_delays(args.request_rate, n, args.seed))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=n, disable=_progress_disabled(args), desc="requests", unit="req", file=sys.stderr)
        t0, cpu0 = time.perf_counter(), time.process_time()

        async def one(i: int, req: BenchRequest) -> RequestRecord:
            wait = t0 + offsets[i] - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            payload = completion_payload(info.model, req, args.temperature)
            if sem is None:
                rec = await send_request(client, url, payload, headers, t0)
            else:
                async with sem:
                    rec = await send_request(client, url, payload, headers, t0)
            bar.update(1)
            return rec

        try:
            records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        finally:
            bar.close()
        return info, requests, list(records), time.perf_counter() - t0, time.process_time() - cpu0


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "api_key"}
    return {k: _json_float(v) for k, v in vars(args).items()
            if k not in skip and not callable(v) and isinstance(v, (str, int, float, bool, type(None)))}


def run_bench(args: argparse.Namespace) -> BenchResult:
    """Run ``epserve bench serve`` from parsed CLI args: print the table, write ``--json``, return the result.

    Raises ValueError (the CLI's exit code 2) for bad options, an unreachable server, or a failing test
    request.
    """
    validate_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    info, requests, records, duration, client_cpu = asyncio.run(_bench(args))
    result = summarize(records, duration, max_concurrency=args.max_concurrency,
                       request_rate=args.request_rate)
    json_path = getattr(args, "json", None)
    table = format_result(result, label=getattr(args, "label", None), model=info.model)
    print(table, file=sys.stderr if json_path == "-" else sys.stdout, flush=True)
    if json_path:
        out = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "label": getattr(args, "label", None),
            "base_url": normalize_base_url(args.base_url),
            "model": info.model,
            "max_model_len": info.max_model_len,
            "vocab_size": args.vocab_size or info.vocab_size,
            "num_requests": len(requests),
            "client_cpu_s": client_cpu,  # this client's own CPU time during the run
            **result.to_dict(),
            "args": _args_json(args),
        }
        text = json.dumps(out, indent=2, allow_nan=False)
        if json_path == "-":
            print(text, flush=True)
        else:
            Path(json_path).expanduser().write_text(text + "\n", encoding="utf-8")
            print(f"wrote {json_path}", file=sys.stderr)
    return result
