"""The router's Prometheus metrics in process: vLLM's names, kinds, labels and buckets; what a finished
choice records (the engine's queue/prefill/decode times, token counts, a prompt's n once); and the
engine figures from ``GetLoad``/``GetInfo`` (tokens per step, the cache configuration)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epserve.messages.engine import ITERATION_TOKENS_BUCKETS, GeneratedTokens, RequestTimes
from epserve.messages.sampling import SamplingParams
from epserve.router.choices import Choice
from epserve.router.engine_client import EngineUnavailable
from epserve.router.errors import APIError
from epserve.router.generation import Generation, GenerationContext
from epserve.router.instances import Instance
from epserve.router.metrics import RouterMetrics, build_1_2_5_buckets
from epserve.router.protocol import CompletionRequest
from epserve.rpc.proto import engine_pb2 as pb

# vllm/v1/metrics/loggers.py (PrometheusStatLogger), copied by hand: what a vLLM dashboard expects
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_STEP_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
MAX_MODEL_LEN = 1024
VLLM_LENGTHS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # vLLM's build_1_2_5_buckets(1024)
BUCKETS = {
    "time_to_first_token_seconds": VLLM_TTFT, "inter_token_latency_seconds": VLLM_ITL,
    "time_per_output_token_seconds": VLLM_ITL, "request_time_per_output_token_seconds": VLLM_ITL,
    "e2e_request_latency_seconds": VLLM_LATENCY, "request_queue_time_seconds": VLLM_LATENCY,
    "request_prefill_time_seconds": VLLM_LATENCY, "request_decode_time_seconds": VLLM_LATENCY,
    "request_inference_time_seconds": VLLM_LATENCY, "request_params_n": [1, 2, 5, 10, 20],
    "request_prompt_tokens": VLLM_LENGTHS, "request_generation_tokens": VLLM_LENGTHS,
    "request_params_max_tokens": VLLM_LENGTHS, "request_max_num_generation_tokens": VLLM_LENGTHS,
    "iteration_tokens_total": VLLM_STEP_TOKENS,
}


def router(*instances: Instance) -> SimpleNamespace:
    info = next((i.info for i in instances if i.info is not None), None)
    return SimpleNamespace(instances=list(instances), decisions={}, info=info)


def instance(index: int, load: pb.GetLoadResponse | None = None, info: pb.GetInfoResponse | None = None) -> Instance:
    client = SimpleNamespace(index=index, address=f"127.0.0.1:{9000 + index}")
    return Instance(client, healthy=True, load=load, info=info)  # type: ignore[arg-type]


def families(metrics: RouterMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


def samples(fams: dict, name: str) -> dict[tuple, float]:
    """``epserve:<name>``'s samples: (sample name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fams[f"epserve:{name}"].samples}


def value(fams: dict, name: str, suffix: str, **labels: str) -> float:
    return sum(s.value for s in fams[f"epserve:{name}"].samples
               if s.name == f"epserve:{name}{suffix}" and labels.items() <= s.labels.items())


def bounds(fams: dict, name: str) -> list[float]:
    return [float(s.labels["le"]) for s in fams[f"epserve:{name}"].samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def test_build_1_2_5_buckets_is_vllms():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(MAX_MODEL_LEN) == tuple(VLLM_LENGTHS)
    assert build_1_2_5_buckets(4) == (1, 2)


def test_every_histogram_has_vllms_name_kind_labels_and_buckets():
    load = pb.GetLoadResponse(iteration_tokens_buckets=[0] * len(ITERATION_TOKENS_BUCKETS))
    info = pb.GetInfoResponse(max_model_len=MAX_MODEL_LEN)
    fams = families(RouterMetrics(router(instance(0, load, info)), "m"))  # type: ignore[arg-type]
    for name, want in BUCKETS.items():
        assert fams[f"epserve:{name}"].type == "histogram", name
        assert bounds(fams, name) == want, name
        labels = {k for s in fams[f"epserve:{name}"].samples for k in s.labels} - {"le"}
        assert labels == ({"model_name", "engine", "role"} if name == "iteration_tokens_total" else {"model_name"})
    # and the counters and gauges vLLM's dashboards read, under its names
    for name, kind in [("prompt_tokens", "counter"), ("generation_tokens", "counter"),
                       ("request_success", "counter"), ("num_requests_running", "gauge"),
                       ("num_requests_waiting", "gauge"), ("kv_cache_usage_perc", "gauge"),
                       ("gpu_cache_usage_perc", "gauge"), ("prefix_cache_queries", "counter"),
                       ("prefix_cache_hits", "counter"), ("num_preemptions", "counter"),
                       ("cache_config_info", "gauge")]:
        assert fams[f"epserve:{name}"].type == kind, name


def test_token_count_histograms_wait_for_the_context_length():
    fams = families(RouterMetrics(router(instance(0)), "m"))  # type: ignore[arg-type]
    assert "epserve:request_prompt_tokens" not in fams  # no engine has told max_model_len yet
    assert "epserve:request_queue_time_seconds" in fams
    fams = families(RouterMetrics(router(instance(0)), "m", max_model_len=100))  # type: ignore[arg-type]
    assert bounds(fams, "request_prompt_tokens") == [1, 2, 5, 10, 20, 50, 100]


def _stream(tokens: int, times: tuple[float, float, float] | None, fail: bool = False):
    """A fake engine stream: ``tokens`` one-token messages, the first with the queue and prefill ``times``
    and the last finishing ("length") with all three, as the engine sends them; with ``fail`` the
    instance is lost after the first."""

    async def generate(rid: str, prompt: list[int], params: SamplingParams):
        for i in range(1, tokens + 1):
            if fail and i == 2:
                raise EngineUnavailable("lost")
            last, sent = i == tokens, None
            if times and last:
                sent = RequestTimes(*times)
            elif times and i == 1:
                sent = RequestTimes(times[0], times[1], 0.0)
            yield GeneratedTokens(rid, (7,), (), len(prompt), 0, i, "length" if last else None, times=sent)
            await asyncio.sleep(0)

    return generate


def _run(metrics: RouterMetrics, generate, prompts: list[list[int]], n: int, max_tokens: int) -> None:
    ctx = GenerationContext(generate, None, metrics, "m")
    req = CompletionRequest(model="m", prompt=prompts, n=n, max_tokens=max_tokens)
    choices = [Choice(p * n + j, ids, SamplingParams(max_tokens=max_tokens), j == 0)
               for p, ids in enumerate(prompts) for j in range(n)]
    asyncio.run(Generation(ctx, req, choices, "cmpl-test").complete())


def test_finished_choices_record_vllms_request_histograms():
    metrics = RouterMetrics(router(instance(0)), "m", max_model_len=MAX_MODEL_LEN)  # type: ignore[arg-type]
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    _run(metrics, _stream(5, (0.5, 0.25, 2.0)), prompts, n=2, max_tokens=5)
    fams = families(metrics)
    # four choices (vLLM's requests), each: queued 0.5 s, prefill 0.25 s, decode 2 s
    for name, each in [("request_queue_time_seconds", 0.5), ("request_prefill_time_seconds", 0.25),
                       ("request_decode_time_seconds", 2.0), ("request_inference_time_seconds", 2.25),
                       ("request_time_per_output_token_seconds", 0.5)]:
        assert value(fams, name, "_count") == 4, name
        assert value(fams, name, "_sum") == pytest.approx(4 * each), name
    assert value(fams, "request_queue_time_seconds", "_bucket", le="0.3") == 0
    assert value(fams, "request_queue_time_seconds", "_bucket", le="0.5") == 4
    assert value(fams, "request_inference_time_seconds", "_bucket", le="2.0") == 0
    assert value(fams, "request_inference_time_seconds", "_bucket", le="2.5") == 4
    # token counts per choice; the prompt counter counts each prompt once (usage's count)
    assert value(fams, "request_prompt_tokens", "_sum") == 2 * 3 + 2 * 7
    assert value(fams, "request_prompt_tokens", "_bucket", le="5.0") == 2
    assert value(fams, "prompt_tokens", "_total") == 3 + 7
    assert value(fams, "request_generation_tokens", "_sum") == value(fams, "generation_tokens", "_total") == 20
    assert value(fams, "request_params_max_tokens", "_count") == 4
    assert value(fams, "request_params_max_tokens", "_bucket", le="5.0") == 4
    # per prompt: n, and the most tokens one of its choices generated
    assert value(fams, "request_params_n", "_count") == 2 and value(fams, "request_params_n", "_sum") == 4
    assert value(fams, "request_max_num_generation_tokens", "_count") == 2
    assert value(fams, "request_max_num_generation_tokens", "_sum") == 10
    assert value(fams, "request_success", "_total", finished_reason="length") == 4
    assert value(fams, "e2e_request_latency_seconds", "_count") == 4
    # inter-token latency: 4 gaps per choice, and the same series under vLLM's older name
    assert value(fams, "inter_token_latency_seconds", "_count") == 16
    assert samples(fams, "time_per_output_token_seconds") == {
        (name.replace("inter_token_latency", "time_per_output_token"), labels): v
        for (name, labels), v in samples(fams, "inter_token_latency_seconds").items()}


def test_a_choice_the_router_ended_counts_only_its_first_tokens_times():
    metrics = RouterMetrics(router(instance(0)), "m", max_model_len=MAX_MODEL_LEN)  # type: ignore[arg-type]
    with pytest.raises(APIError):
        _run(metrics, _stream(5, (0.5, 0.25, 2.0), fail=True), [[1, 2, 3]], n=1, max_tokens=5)
    fams = families(metrics)
    assert value(fams, "request_success", "_total", finished_reason="abort") == 1
    assert value(fams, "e2e_request_latency_seconds", "_count") == 1
    assert value(fams, "request_generation_tokens", "_sum") == 1
    # the engine sent the queue and prefill times with the first token; the rest it never said: nothing made up
    assert value(fams, "request_queue_time_seconds", "_sum") == 0.5
    assert value(fams, "request_prefill_time_seconds", "_sum") == 0.25
    for name in ["request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"]:
        assert value(fams, name, "_count") == 0, name
    metrics = RouterMetrics(router(instance(0)), "m", max_model_len=MAX_MODEL_LEN)  # type: ignore[arg-type]
    with pytest.raises(APIError):  # an engine that sent no times (none reached the router): none counted
        _run(metrics, _stream(5, None, fail=True), [[1, 2, 3]], n=1, max_tokens=5)
    assert value(families(metrics), "request_queue_time_seconds", "_count") == 0


def test_engine_figures_tokens_per_step_and_cache_config():
    cumulative = [3, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]  # steps: 3 of 1 token, 2 of 2..8, 1 of 17..32, 1 above all
    load = pb.GetLoadResponse(kv_blocks_used=16, kv_blocks_total=64, iteration_tokens_buckets=cumulative,
                              iteration_tokens_sum=3 + 12 + 20 + 40000, iteration_steps_total=7)
    info = pb.GetInfoResponse(max_model_len=MAX_MODEL_LEN, block_size=16, num_blocks=64, cache_dtype="fp8",
                              enable_prefix_caching=True)
    old = instance(1, pb.GetLoadResponse(kv_blocks_total=8), pb.GetInfoResponse(block_size=16, num_blocks=8))
    fams = families(RouterMetrics(router(instance(0, load, info), old), "m"))  # type: ignore[arg-type]
    steps = {s.labels["le"]: s.value for s in fams["epserve:iteration_tokens_total"].samples
             if s.name.endswith("_bucket") and s.labels["engine"] == "0"}
    assert steps == {**{f"{b}.0": n for b, n in zip(VLLM_STEP_TOKENS, cumulative)}, "+Inf": 7}
    assert value(fams, "iteration_tokens_total", "_count", engine="0") == 7
    assert value(fams, "iteration_tokens_total", "_sum", engine="0") == 40035
    # an instance that reports no step histogram (an older engine) has none, and no error
    assert value(fams, "iteration_tokens_total", "_count", engine="1") == 0
    assert value(fams, "kv_cache_usage_perc", "", engine="0") == value(fams, "gpu_cache_usage_perc", "", engine="0")
    assert value(fams, "gpu_cache_usage_perc", "", engine="0") == 0.25
    info_rows = {s.labels["engine"]: s for s in fams["epserve:cache_config_info"].samples}
    assert info_rows["0"].value == 1
    assert {k: info_rows["0"].labels[k] for k in ("block_size", "num_gpu_blocks", "cache_dtype",
                                                    "enable_prefix_caching")} == {
        "block_size": "16", "num_gpu_blocks": "64", "cache_dtype": "fp8", "enable_prefix_caching": "True"}
    assert info_rows["1"].labels["cache_dtype"] == "auto"  # unset: the model dtype, vLLM's "auto"
