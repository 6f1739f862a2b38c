"""Prometheus metrics of the front door, in a per-app registry (no global state).

Names follow vLLM's (`vllm:time_to_first_token_seconds` ...) with our own prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.http_requests = Counter(
            "bubbletea_http_requests",
            "HTTP requests by route, method and status code.",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_latency = Histogram(
            "bubbletea_http_request_duration_seconds",
            "Time to answer an HTTP request.",
            ["route"],
            buckets=(0.0005, *_LATENCY_BUCKETS),
            registry=r,
        )
        self.redis_up = Gauge("bubbletea_redis_up", "1 if the last Redis check succeeded, else 0.", registry=r)
        self.requests = Counter(
            "bubbletea:request",
            "Prefill requests by outcome (success, failed, rejected, timeout).",
            ["outcome"],
            registry=r,
        )
        self.waiting = Gauge(
            "bubbletea:num_requests_waiting",
            "Prefill requests accepted and not yet answered (all instances).",
            registry=r,
        )
        self.ttft = Histogram(
            "bubbletea:time_to_first_token_seconds", "Submission to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "bubbletea:request_queue_time_seconds",
            "Time a request waited for a bubble.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "bubbletea:request_prefill_time_seconds",
            "Time spent computing the prefill.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
