"""The serving benchmark's per-request records and their summary (throughputs, latency percentiles)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

MAX_ERRORS_KEPT = 5


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
        d["request_rate"] = json_float(self.request_rate)
        return d


def json_float(x: float) -> float | str:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def stats_ms(values: Sequence[float]) -> tuple[float | None, float | None, float | None]:
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
    ttft, tpot = stats_ms([r.ttft for r in ok]), stats_ms(tpots)
    itl, e2e = stats_ms([g for r in ok for g in r.itl]), stats_ms([r.e2e for r in ok])
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


