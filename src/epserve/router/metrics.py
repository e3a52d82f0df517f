"""Prometheus metrics of the router, vLLM-style names with the ``epserve:`` prefix.

Request metrics (tokens, latencies, finished requests) are counted by the router as responses go
out. Engine metrics (running/waiting requests, KV-cache usage, prefix-cache queries and hits,
expert-load imbalance, health, in-flight load) come from each instance's ``GetLoad``, refreshed
just before a scrape is rendered, labelled ``engine="<index>"`` and ``role`` (``both``, or ``prefill`` /
``decode`` behind a disaggregated router): per-role request counts are ``epserve:router_requests_total``
by role. KV transfers between prefill and decode instances: bytes by direction, the decode side's
transfer times (``epserve:kv_transfer_seconds``), failures.

Names after the prefix, kinds, labels and buckets are vLLM's (v1 ``PrometheusStatLogger``), so a vLLM
dashboard reads these after relabelling ``epserve:`` to ``vllm:`` (docs/serving.md, "Metrics"). A finished
choice is one of vLLM's requests: its queue, prefill and decode times are the engine's (its last message
carries them), its token counts and latencies the router's; a prompt's ``n`` and longest generation are
counted once all its choices finished. Tokens per engine step and the cache configuration come from the
instances.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from epserve.messages.engine import ITERATION_TOKENS_BUCKETS, GeneratedTokens, RequestTimes
from epserve.router.instances import Router
from epserve.rpc.convert import KV_TRANSFER_BUCKETS

if TYPE_CHECKING:
    from epserve.router.choices import Choice

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger), so that its dashboards read ours alike
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)  # inter-token latency, and a request's mean time per output token
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # e2e, queue, prefill, decode, inference
_N_BUCKETS = (1, 2, 5, 10, 20)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets of token counts (up to max_model_len)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


_CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching")


class _EngineCollector:
    def __init__(self, router: Router, model_name: str) -> None:
        self.router = router
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine", "role"]
        fams = {
            "running": GaugeMetricFamily("epserve:num_requests_running", "Requests in the engine's running batch",
                                         labels=labels),
            "waiting": GaugeMetricFamily("epserve:num_requests_waiting", "Requests waiting to be scheduled",
                                         labels=labels),
            "kv": GaugeMetricFamily("epserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)",
                                    labels=labels),
            "gpu_kv": GaugeMetricFamily("epserve:gpu_cache_usage_perc", "The same, under vLLM's deprecated name "
                                        "(its example dashboard reads it)", labels=labels),
            "step_tokens": HistogramMetricFamily("epserve:iteration_tokens_total",
                                                 "Tokens per engine step (steps that computed any)", labels=labels),
            "cache_info": GaugeMetricFamily("epserve:cache_config_info", "The engine's KV-cache configuration "
                                            "(vLLM's CacheConfig labels; always 1)",
                                            labels=[*labels, *_CACHE_CONFIG_LABELS]),
            "queries": CounterMetricFamily("epserve:prefix_cache_queries",
                                           "Prompt tokens looked up in the prefix cache", labels=labels),
            "hits": CounterMetricFamily("epserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                        labels=labels),
            "preempt": CounterMetricFamily("epserve:num_preemptions", "Requests preempted by the scheduler",
                                           labels=labels),
            "imbalance": GaugeMetricFamily("epserve:expert_load_imbalance",
                                           "Max over mean routed tokens per EP rank since the last expert "
                                           "rebalance (1 = even)", labels=labels),
            "layer_imbalance": GaugeMetricFamily("epserve:expert_load_layer_imbalance",
                                                 "The same for one MoE layer (what its busiest rank costs)",
                                                 labels=[*labels, "layer"]),
            "rebalances": CounterMetricFamily("epserve:eplb_rebalances",
                                              "Expert placements recomputed from the load (EPLB)", labels=labels),
            "healthy": GaugeMetricFamily("epserve:engine_healthy", "1 if the router sends requests to the engine",
                                         labels=labels),
            "restarts": CounterMetricFamily("epserve:engine_restarts",
                                            "Times the engine's group was restarted after a rank died or hung",
                                            labels=labels),
            "in_flight": GaugeMetricFamily("epserve:engine_load",
                                           "Requests in flight on the engine (the router's load signal)",
                                           labels=labels),
            "routed": CounterMetricFamily("epserve:router_requests", "Requests the router sent to the engine",
                                          labels=labels),
            "drafts": CounterMetricFamily("epserve:spec_decode_num_drafts",
                                          "Decode steps that verified speculative drafts", labels=labels),
            "draft_tokens": CounterMetricFamily("epserve:spec_decode_num_draft_tokens",
                                                "Draft tokens proposed (MTP)", labels=labels),
            "accepted": CounterMetricFamily("epserve:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted by verification", labels=labels),
            "receiving": GaugeMetricFamily("epserve:num_requests_receiving",
                                           "Requests waiting for their prompt's KV from a prefill instance",
                                           labels=labels),
            "kv_bytes": CounterMetricFamily("epserve:kv_transfer_bytes",
                                            "KV-cache bytes moved between prefill and decode instances",
                                            labels=[*labels, "direction"]),
            "kv_failures": CounterMetricFamily("epserve:kv_transfer_failures",
                                               "KV transfers that failed or timed out (decode side)", labels=labels),
            "kv_seconds": HistogramMetricFamily("epserve:kv_transfer_seconds",
                                                "Time from a decode instance's blocks being allocated to its KV "
                                                "arriving (prefill included)", labels=labels),
            "accepted_pos": CounterMetricFamily("epserve:spec_decode_num_accepted_tokens_per_pos",
                                                "Draft tokens accepted, by draft position",
                                                labels=[*labels, "position"]),
        }
        for inst in self.router.instances:
            values = [self.model_name, str(inst.index), inst.role]
            fams["healthy"].add_metric(values, float(inst.healthy))
            fams["in_flight"].add_metric(values, float(inst.load_signal))
            fams["routed"].add_metric(values, float(inst.requests_total))
            info = inst.info
            if info is not None:
                fams["cache_info"].add_metric([*values, str(info.block_size), str(info.num_blocks),
                                               info.cache_dtype or "auto", str(info.enable_prefix_caching)], 1.0)
            load = inst.load
            if load is None:
                continue
            fams["running"].add_metric(values, load.num_running)
            fams["waiting"].add_metric(values, load.num_waiting)
            fams["kv"].add_metric(values, load.kv_blocks_used / max(load.kv_blocks_total, 1))
            fams["gpu_kv"].add_metric(values, load.kv_blocks_used / max(load.kv_blocks_total, 1))
            steps = load.iteration_tokens_buckets
            if len(steps) == len(ITERATION_TOKENS_BUCKETS):  # (bounds written as prometheus_client writes them)
                buckets = [(floatToGoString(b), n) for b, n in zip(ITERATION_TOKENS_BUCKETS, steps)]
                fams["step_tokens"].add_metric(values, [*buckets, ("+Inf", load.iteration_steps_total)],
                                               load.iteration_tokens_sum)
            fams["queries"].add_metric(values, load.prefix_query_tokens)
            fams["hits"].add_metric(values, load.prefix_hit_tokens)
            fams["preempt"].add_metric(values, load.num_preemptions_total)
            fams["imbalance"].add_metric(values, load.expert_imbalance)
            for layer, value in zip(load.expert_layers, load.expert_layer_imbalance):
                fams["layer_imbalance"].add_metric([*values, str(layer)], value)
            fams["rebalances"].add_metric(values, load.eplb_rebalances_total)
            fams["restarts"].add_metric(values, load.restarts)
            if inst.role != "both" or load.kv_transfers_total or load.kv_transfer_bytes_sent:
                fams["receiving"].add_metric(values, load.num_receiving)
                fams["kv_bytes"].add_metric([*values, "received"], load.kv_transfer_bytes_received)
                fams["kv_bytes"].add_metric([*values, "sent"], load.kv_transfer_bytes_sent)
                fams["kv_failures"].add_metric(values, load.kv_transfer_failures_total)
                if len(load.kv_transfer_seconds_buckets) == len(KV_TRANSFER_BUCKETS):
                    buckets = [(str(b), n) for b, n in zip(KV_TRANSFER_BUCKETS, load.kv_transfer_seconds_buckets)]
                    fams["kv_seconds"].add_metric(values, [*buckets, ("+Inf", load.kv_transfers_total)],
                                                  load.kv_transfer_seconds_sum)
            if load.spec_accepted_per_position:  # speculative decoding is on
                fams["drafts"].add_metric(values, load.spec_num_drafts)
                fams["draft_tokens"].add_metric(values, load.spec_num_draft_tokens)
                fams["accepted"].add_metric(values, load.spec_num_accepted_tokens)
                for pos, n in enumerate(load.spec_accepted_per_position):
                    fams["accepted_pos"].add_metric([*values, str(pos)], n)
        yield from fams.values()
        decisions = CounterMetricFamily(
            "epserve:router_decisions", "Routing decisions by kind (cache_aware: cache_hit, least_load, "
            "imbalanced; other policies: their name)", labels=["model_name", "decision"])
        for decision, count in sorted(self.router.decisions.items()):
            decisions.add_metric([self.model_name, decision], count)
        yield decisions


class _Renamed:
    """Another metric's series under a second name (one of vLLM's older names that its dashboards still
    read); nothing is observed twice."""

    def __init__(self, metric: Histogram, name: str, documentation: str) -> None:
        self.metric, self.name, self.documentation = metric, name, documentation

    def collect(self) -> Iterator[Metric]:
        for fam in self.metric.collect():
            out = Metric(self.name, self.documentation, fam.type)
            for sample in fam.samples:
                out.add_sample(self.name + sample.name[len(fam.name):], sample.labels, sample.value)
            yield out


class RouterMetrics:
    """``max_model_len`` bounds the token-count histograms' buckets; by default the engines' (they are
    made once an engine has told it)."""

    def __init__(self, router: Router, model_name: str, max_model_len: int | None = None) -> None:
        disable_created_metrics()  # no `*_created` series next to every counter and histogram
        self.registry = CollectorRegistry()
        self.router = router
        self.model_name = model_name
        self._max_model_len = max_model_len
        self._by_length: dict[str, Histogram] | None = None
        reg = self.registry
        labels = ["model_name"]
        self.prompt_tokens = Counter("epserve:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("epserve:generation_tokens", "Generated tokens", labels,
                                         registry=reg).labels(model_name)
        self.cached_tokens = Counter("epserve:prompt_tokens_cached",
                                     "Prompt tokens of finished requests served from the prefix cache", labels,
                                     registry=reg).labels(model_name)
        self.request_success = Counter("epserve:request_success", "Finished requests by finish reason",
                                       ["model_name", "finished_reason"], registry=reg)
        self.request_errors = Counter("epserve:request_errors", "Requests answered with an error, by status",
                                      ["model_name", "status"], registry=reg)
        hist = self._histogram
        self.ttft = hist("epserve:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        itl = Histogram("epserve:inter_token_latency_seconds", "Time between output tokens", labels,
                        buckets=_ITL_BUCKETS, registry=reg)
        self.itl = itl.labels(model_name)
        reg.register(_Renamed(itl, "epserve:time_per_output_token_seconds",  # type: ignore[arg-type]
                              "Time between output tokens (vLLM's deprecated name)"))
        self.e2e = hist("epserve:e2e_request_latency_seconds", "Request latency from arrival to last token",
                        _REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("epserve:request_queue_time_seconds", "A request's time from arriving at the "
                               "engine to being first scheduled (WAITING)", _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("epserve:request_prefill_time_seconds", "A request's time from first scheduled "
                                 "to its first token (PREFILL)", _REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("epserve:request_decode_time_seconds", "A request's time from its first token "
                                "to its last (DECODE)", _REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("epserve:request_inference_time_seconds", "A request's prefill and decode "
                                   "time (RUNNING)", _REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = hist("epserve:request_time_per_output_token_seconds", "A request's decode "
                                          "time per output token after the first", _ITL_BUCKETS)
        self.params_n = hist("epserve:request_params_n", "The n request parameter (per prompt)", _N_BUCKETS)
        reg.register(_EngineCollector(router, model_name))  # type: ignore[arg-type]

    def _histogram(self, name: str, documentation: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, documentation, ["model_name"], buckets=buckets,
                         registry=self.registry).labels(self.model_name)

    def _lengths(self) -> dict[str, Histogram] | None:
        """vLLM's token-count histograms, in 1-2-5 buckets up to max_model_len (None until it is known)."""
        if self._by_length is None:
            info = self.router.info
            max_len = self._max_model_len or (info.max_model_len if info is not None else 0)
            if not max_len:
                return None
            buckets = build_1_2_5_buckets(max_len)
            self._by_length = {key: self._histogram(name, doc, buckets) for key, name, doc in (
                ("prompt", "epserve:request_prompt_tokens", "Prompt tokens of a finished request"),
                ("generation", "epserve:request_generation_tokens", "Tokens a finished request generated"),
                ("max_tokens", "epserve:request_params_max_tokens", "The max_tokens request parameter"),
                ("max_generation", "epserve:request_max_num_generation_tokens",
                 "The most tokens one choice of a prompt generated (per prompt)"),
            )}
        return self._by_length

    def finished(self, choice: Choice, e2e_s: float, last: GeneratedTokens | None = None,
                 prompt_choices: Sequence[Choice] | None = None) -> None:
        """``choice`` finished, for whatever reason, ``e2e_s`` after its request arrived. ``last``: the
        engine's message that finished it, with the engine's times (None when the router ended it: a
        stop string, the client gone, the instance lost; then only its queue and prefill times count, as
        the engine sent them with the first token);
        ``prompt_choices``: its prompt's choices, when it is the last of them to finish."""
        first, num_prompt, num_output = choice.first_of_prompt, len(choice.prompt_ids), choice.num_output
        self.request_success.labels(self.model_name, choice.finish_reason or "abort").inc()
        self.prompt_tokens.inc(num_prompt if first else 0)  # usage's count: a prompt once, whatever n
        self.cached_tokens.inc(choice.num_cached if first else 0)
        self.generation_tokens.inc(num_output)
        self.e2e.observe(e2e_s)
        if last is not None:
            times = last.times or RequestTimes(0.0, 0.0, 0.0)  # (an engine that sent none)
            prefill, decode = times.prefill_s, times.decode_s
            self.queue_time.observe(times.queued_s)
            self.prefill_time.observe(prefill)
            self.decode_time.observe(decode)
            self.inference_time.observe(prefill + decode)
            self.time_per_output_token.observe(decode / (num_output - 1) if num_output > 1 else 0.0)
        elif choice.engine_times is not None:  # ended by the router (a stop string): its first token's times
            self.queue_time.observe(choice.engine_times[0])
            self.prefill_time.observe(choice.engine_times[1])
        if prompt_choices is not None:
            self.params_n.observe(len(prompt_choices))
        lengths = self._lengths()
        if lengths is not None:  # (vLLM counts each choice: a prompt's tokens n times)
            lengths["prompt"].observe(num_prompt)
            lengths["generation"].observe(num_output)
            if choice.params.max_tokens:
                lengths["max_tokens"].observe(choice.params.max_tokens)
            if prompt_choices is not None:
                lengths["max_generation"].observe(max(c.num_output for c in prompt_choices))

    def error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        self._lengths()  # (they show as soon as an engine has told the context's length)
        return generate_latest(self.registry)
