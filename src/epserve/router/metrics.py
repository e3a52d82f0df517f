"""Prometheus metrics of the router, vLLM-style names with the ``epserve:`` prefix.

Request metrics (tokens, latencies, finished requests) are counted by the router as responses go
out. Engine metrics (running/waiting requests, KV-cache usage, prefix-cache queries and hits,
expert-load imbalance, health, in-flight load) come from each instance's ``GetLoad``, refreshed
just before a scrape is rendered, labelled ``engine="<index>"`` and ``role`` (``both``, or ``prefill`` /
``decode`` behind a disaggregated router): per-role request counts are ``epserve:router_requests_total``
by role. KV transfers between prefill and decode instances: bytes by direction, the decode side's
transfer times (``epserve:kv_transfer_seconds``), failures.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from epserve.router.instances import Router
from epserve.rpc.convert import KV_TRANSFER_BUCKETS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


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
            load = inst.load
            if load is None:
                continue
            fams["running"].add_metric(values, load.num_running)
            fams["waiting"].add_metric(values, load.num_waiting)
            fams["kv"].add_metric(values, load.kv_blocks_used / max(load.kv_blocks_total, 1))
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


class RouterMetrics:
    def __init__(self, router: Router, model_name: str) -> None:
        disable_created_metrics()  # no `*_created` series next to every counter and histogram
        self.registry = CollectorRegistry()
        self.model_name = model_name
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
        self.ttft = Histogram("epserve:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("epserve:inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("epserve:e2e_request_latency_seconds", "Request latency from arrival to last token",
                             labels, buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        reg.register(_EngineCollector(router, model_name))  # type: ignore[arg-type]

    def finished(self, reason: str, num_prompt: int, num_cached: int, num_output: int, e2e_s: float) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.cached_tokens.inc(num_cached)
        self.generation_tokens.inc(num_output)
        self.e2e.observe(e2e_s)

    def error(self, status: int) -> None:
        self.request_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
