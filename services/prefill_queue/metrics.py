"""Prometheus metrics of the front door, in a per-app registry (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.http_requests = Counter(
            "bubbletea_http_requests",
            "HTTP requests by route, method and status code.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.http_latency = Histogram(
            "bubbletea_http_request_duration_seconds",
            "Time to answer an HTTP request.",
            ["route"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.redis_up = Gauge(
            "bubbletea_redis_up", "1 if the last Redis check succeeded, else 0.", registry=self.registry
        )
