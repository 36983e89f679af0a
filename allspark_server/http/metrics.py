"""Prometheus metrics of the HTTP server (prometheus-client, text format at GET /metrics).

Owns one CollectorRegistry per app: HTTP requests by endpoint and status, finished requests by reason, TTFT /
TPOT / end-to-end histograms and token counters measured here at the HTTP layer, the admission gauges, and the
engine's own numbers (running / waiting requests, KV spans, prefix cache, memory-bandwidth utilisation, speculative
decoding) read from get_as_engine_stat just before each scrape. Knows nothing of routes.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/load_lora_adapter",
             "/v1/unload_lora_adapter", "/health", "/metrics", "/tokenize", "/detokenize", "/v1/messages",
             "/v1/messages/count_tokens")


class EngineCollector:
    """The engine's AsEngineStat as metrics (nothing until the first successful read)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stat = None
        self.up = 0

    def describe(self):
        return []

    def collect(self):
        labels = ["model_name"]
        up = GaugeMetricFamily("allspark_engine_up", "1 when the last read of the engine's stats succeeded",
                               labels=labels)
        up.add_metric([self.model_name], self.up)
        yield up
        s = self.stat
        if s is None:
            return

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self.model_name], value)
            return c

        yield gauge("allspark_num_requests_running", "requests the engine is running", s.running_request)
        yield gauge("allspark_num_requests_waiting", "requests waiting in the engine", s.pendding_request)
        yield gauge("allspark_kv_cache_spans_used", "KV spans in use", s.used_span)
        yield gauge("allspark_kv_cache_spans_total", "KV spans in the cache", s.total_span)
        yield gauge("allspark_kv_cache_usage_ratio", "used / total KV spans",
                    s.used_span / s.total_span if s.total_span else 0.0)
        yield gauge("allspark_prefix_cache_hit_rate", "prompt tokens served from the prefix cache / all prompt "
                    "tokens, since start", s.prefix_cache_hit_rate)
        yield counter("allspark_prefix_cache_hit_tokens", "prompt tokens whose KV came from the prefix cache",
                      s.prefix_cache_hit_token)
        yield counter("allspark_prefix_cache_miss_tokens", "prompt tokens computed", s.prefix_cache_miss_token)
        yield counter("allspark_num_preemptions", "requests preempted (recomputed later)", s.num_preempted)
        yield gauge("allspark_engine_generate_tokens_per_second", "the engine's generated tokens/s (10 s window)",
                    s.generate_token_persec)
        yield gauge("allspark_memory_bandwidth_utilization", "bytes the decode-only steps of the last 10 s read on "
                    "all ranks / their time / all ranks' measured copy bandwidth (MBU)", s.memory_bandwidth_utilization)
        yield gauge("allspark_memory_bandwidth_gbs", "copy bandwidth of the memory the model decodes from, all ranks "
                    "(GB/s, measured once)", s.memory_bandwidth_gbs)
        yield from speculative_metrics(s, labels, [self.model_name], counter, gauge)
        for name, doc, values in (
                ("allspark_rank_memory_bandwidth_utilization", "one rank's MBU: the bytes it read in the decode-only "
                 "steps of the last 10 s / their time / its measured copy bandwidth",
                 s.rank_memory_bandwidth_utilization),
                ("allspark_rank_memory_bandwidth_gbs", "one rank's copy bandwidth, measured by all ranks at once "
                 "(GB/s)", s.rank_memory_bandwidth_gbs)):
            g = GaugeMetricFamily(name, doc, labels=[*labels, "rank"])
            for rank, value in enumerate(values):
                g.add_metric([self.model_name, str(rank)], value)
            yield g


def speculative_metrics(s, labels, values, counter, gauge):
    """The AsEngineStat spec_* fields (docs/speculative.md; zeros while the model has no speculative decoding)."""
    yield counter("allspark_spec_draft_tokens", "proposed tokens a verify step checked", s.spec_draft_tokens)
    yield counter("allspark_spec_accepted_tokens", "proposed tokens accepted", s.spec_accepted_tokens)
    yield counter("allspark_spec_emitted_tokens", "tokens the verify steps produced (the accepted ones and one "
                  "of the model's own each)", s.spec_emitted_tokens)
    yield counter("allspark_spec_verify_steps", "request-steps that checked a proposal", s.spec_verify_steps)
    yield gauge("allspark_spec_acceptance_rate", "accepted / proposed tokens, since the model was installed",
                s.spec_acceptance_rate)
    skipped = CounterMetricFamily("allspark_spec_skipped_requests", "requests that ran without speculative "
                                  "decoding, by reason (turned_off, response_format)", labels=[*labels, "reason"])
    for part in filter(None, (p.strip() for p in s.spec_skipped.split(","))):
        reason, _, count = part.partition("=")
        if count.isdigit():
            skipped.add_metric([*values, reason], int(count))
    yield skipped


class Metrics:
    def __init__(self, model_name: str, admission=None):
        disable_created_metrics()    # no *_created series: they double the output and nobody reads them
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("allspark_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.finished = Counter("allspark_request_finished", "generation requests by how they ended (stop, length, "
                                "abort: the client left, error)", ["finished_reason"], registry=r)
        self.ttft = Histogram("allspark_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("allspark_time_per_output_token_seconds", "a request's mean time per output token "
                              "after the first", buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("allspark_e2e_request_latency_seconds", "request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("allspark_prompt_tokens", "prompt tokens of started requests", registry=r)
        self.generation_tokens = Counter("allspark_generation_tokens", "tokens generated", registry=r)
        if admission is not None:
            Gauge("allspark_server_requests_admitted", "requests holding an admission slot (started or starting)",
                  registry=r).set_function(lambda: admission.running)
            Gauge("allspark_server_requests_queued", "requests waiting for an admission slot",
                  registry=r).set_function(lambda: admission.waiting)
        self.engine = EngineCollector(model_name)
        r.register(self.engine)

    def endpoint_label(self, path: str) -> str:
        return path if path in ENDPOINTS else "other"

    def request_done(self, reason: str, prompt_tokens: int, completion_tokens: int, arrival: float,
                     first_token: Optional[float], last_token: Optional[float]) -> None:
        """Record one generation request (times from time.perf_counter())."""
        self.finished.labels(reason).inc()
        self.generation_tokens.inc(completion_tokens)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            self.e2e.observe(last_token - arrival)
            if completion_tokens > 1:
                self.tpot.observe((last_token - first_token) / (completion_tokens - 1))

    def render(self, stat) -> bytes:
        """The text format, with the engine's numbers from `stat` (None: the read failed)."""
        self.engine.up = int(stat is not None)
        if stat is not None:
            self.engine.stat = stat
        return generate_latest(self.registry)
