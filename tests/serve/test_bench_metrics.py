"""Tests of ``epserve bench serve``'s result summary: throughput, latency percentiles, errors, and the table."""

from __future__ import annotations

import json

import pytest

from epserve.bench.metrics import RequestRecord, format_result, summarize


def rec(ttft: float, e2e: float, out: int, itl: list[float], prompt: int = 100, cached: int = 0,
        ok: bool = True, error: str = "") -> RequestRecord:
    return RequestRecord(success=ok, prompt_len=prompt, output_tokens=out, cached_tokens=cached, ttft=ttft,
                         itl=itl, e2e=e2e, error=error)


def test_summarize_math() -> None:
    records = [
        rec(0.1, 1.1, 11, [0.1] * 10, prompt=100, cached=50),
        rec(0.3, 0.7, 5, [0.1] * 4, prompt=200, cached=0),
        rec(0.2, 0.2, 1, [], prompt=100, cached=100),
        rec(9.0, 99.0, 0, [], prompt=1000, ok=False, error="HTTP 500: boom"),
        rec(9.0, 99.0, 0, [], prompt=1000, ok=False, error="HTTP 500: boom"),
        rec(9.0, 99.0, 0, [], prompt=1000, ok=False, error="ReadTimeout"),
    ]
    r = summarize(records, 2.0, max_concurrency=4, request_rate=10.0)
    assert (r.completed, r.failed) == (3, 3)
    assert (r.total_input_tokens, r.total_output_tokens, r.total_cached_tokens) == (400, 17, 150)
    assert r.request_throughput == pytest.approx(1.5)
    assert r.input_token_throughput == pytest.approx(200.0)
    assert r.output_token_throughput == pytest.approx(8.5)
    assert r.total_token_throughput == pytest.approx(208.5)
    assert r.cache_hit_rate == pytest.approx(150 / 400)
    assert r.mean_ttft_ms == pytest.approx(200.0) and r.median_ttft_ms == pytest.approx(200.0)
    assert r.p99_ttft_ms == pytest.approx(100 + 200 * 0.99 * 1)  # numpy linear interpolation: 0.1..0.3
    # tpot only for > 1 output token: (1.1 - 0.1) / 10 = 100 ms, (0.7 - 0.3) / 4 = 100 ms
    assert r.mean_tpot_ms == pytest.approx(100.0) and r.p99_tpot_ms == pytest.approx(100.0)
    assert r.mean_itl_ms == pytest.approx(100.0) and r.median_itl_ms == pytest.approx(100.0)
    assert r.mean_e2e_ms == pytest.approx(2000 / 3) and r.median_e2e_ms == pytest.approx(700.0)
    assert r.p99_e2e_ms == pytest.approx(700 + 400 * 0.98)
    assert r.errors == ["HTTP 500: boom (x2)", "ReadTimeout"]
    d = r.to_dict()
    assert d["max_concurrency"] == 4 and d["request_rate"] == 10.0
    json.dumps(d, allow_nan=False)
    table = format_result(r, label="x", model="m")
    assert "Serving Benchmark Result" in table and "HTTP 500: boom (x2)" in table and "37.50" in table


def test_summarize_percentiles_and_empty() -> None:
    records = [rec(i / 1000, 1.0, 2, [i / 1000]) for i in range(1, 101)]
    r = summarize(records, 10.0)
    assert r.median_ttft_ms == pytest.approx(50.5) and r.p99_ttft_ms == pytest.approx(99.01)
    assert r.median_itl_ms == pytest.approx(50.5)
    none = summarize([rec(0, 0, 0, [], ok=False, error="e")], 0.0)
    assert (none.completed, none.failed, none.request_throughput) == (0, 1, 0.0)
    assert none.mean_ttft_ms is None and none.cache_hit_rate is None and none.p99_e2e_ms is None
    d = none.to_dict()
    assert d["request_rate"] == "inf"
    json.dumps(d, allow_nan=False)
    assert "n/a" in format_result(none)
    assert summarize([rec(0.1, 0.2, 1, [])], 1.0).mean_tpot_ms is None  # one output token: no tpot
