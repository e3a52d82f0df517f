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
import os
import sys
import time
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from epserve import env
from epserve.bench.datasets import (
    BenchRequest,
    DatasetOptions,
    arrival_offsets,
    check_dataset_options,
    make_dataset,
    poisson_delays,
)
from epserve.bench.metrics import (
    BenchResult,
    RequestRecord,
    StreamAccumulator,
    format_result,
    json_float,
    summarize,
)
from epserve.bench.roles import RoleFigures, format_roles, role_figures
from epserve.bench.sse import DONE, SSEDecoder, StreamError, decode_chunk, error_message

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_MODEL_LEN = 2048  # when /v1/models does not say
DEFAULT_VOCAB_SIZE = 512
READ_TIMEOUT_S = 6 * 3600.0
CONNECT_TIMEOUT_S = 60.0
MODELS_TIMEOUT_S = 30.0
PROBE_PROMPT_LEN = 8


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
    return env.progress_disabled()


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


async def _scrape(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The router's /metrics ("" if it has none): per-role figures come from it."""
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers)
    except Exception:  # noqa: BLE001 - optional: any server, not only epserve's, can be benchmarked
        return ""
    return r.text if r.status_code == 200 else ""


async def _bench(
    args: argparse.Namespace,
) -> tuple[ServerInfo, list[BenchRequest], list[RequestRecord], float, float, list[RoleFigures]]:
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
        before = await _scrape(client, base_url, headers)
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
        duration, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = await _scrape(client, base_url, headers)
        roles = role_figures(before, after, list(records)) if before and after else []
        return info, requests, list(records), duration, cpu, roles


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "api_key"}
    return {k: json_float(v) for k, v in vars(args).items()
            if k not in skip and not callable(v) and isinstance(v, (str, int, float, bool, type(None)))}


def run_bench(args: argparse.Namespace) -> BenchResult:
    """Run ``epserve bench serve`` from parsed CLI args: print the table, write ``--json``, return the result.

    Raises ValueError (the CLI's exit code 2) for bad options, an unreachable server, or a failing test
    request.
    """
    validate_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    info, requests, records, duration, client_cpu, roles = asyncio.run(_bench(args))
    result = summarize(records, duration, max_concurrency=args.max_concurrency,
                       request_rate=args.request_rate)
    json_path = getattr(args, "json", None)
    table = format_result(result, label=getattr(args, "label", None), model=info.model)
    if roles:  # a disaggregated deployment
        table += "\n" + format_roles(roles)
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
            "roles": [r.to_dict() for r in roles],
            "args": _args_json(args),
        }
        text = json.dumps(out, indent=2, allow_nan=False)
        if json_path == "-":
            print(text, flush=True)
        else:
            Path(json_path).expanduser().write_text(text + "\n", encoding="utf-8")
            print(f"wrote {json_path}", file=sys.stderr)
    return result
