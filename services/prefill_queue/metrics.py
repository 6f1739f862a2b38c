"""Prometheus metrics of the front door, in a per-app registry (no global state).

Names follow vLLM's (`vllm:time_to_first_token_seconds` ...) with our own prefix, and the request
metrics carry vLLM's `model_name` label, so a vLLM dashboard needs only the prefix changed.

Tested by: tests/integration/test_prefill_api.py, tests/integration/test_prefill_queue_skeleton.py,
tests/unit/test_front_door_objective.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

from shared.wire.status import PromptPlacement

_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, model_name: str = "bubbletea-gpt") -> None:
        self.model_name = model_name
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
            "Prefill requests by outcome (success, failed, rejected, timeout; moved: to the decoder).",
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
        # vLLM's request metrics, by model
        self.running = Gauge(
            "bubbletea:num_requests_running",
            "Requests this instance accepted and is answering now (waiting for their first token).",
            ["model_name"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "bubbletea:prompt_tokens", "Prompt tokens of answered requests.", ["model_name"], registry=r
        )
        self.request_prompt_tokens = Histogram(
            "bubbletea:request_prompt_tokens",
            "Prompt length of answered requests.",
            ["model_name"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "bubbletea:e2e_request_latency_seconds",
            "HTTP request received to its completion answered (POST /v1/completions).",
            ["model_name"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # where each prompt was computed (`prompt_placement`): bubbles or the decoder's own prefill
        self.placed = Counter(
            "bubbletea:placement_requests",
            "Answered prompts by where they were computed (bubbles: a training bubble; decoder: vLLM's own "
            "prefill, the bubbles not meeting the TTFT objective).",
            ["placement"],
            registry=r,
        )
        self.placed_tokens = Counter(
            "bubbletea:placement_prompt_tokens",
            "Prompt tokens of answered prompts, by where computed.",
            ["placement"],
            registry=r,
        )
        self.placed_ttft = Histogram(
            "bubbletea:placement_time_to_first_token_seconds",
            "Submission to first token, by where the prompt was computed.",
            ["placement"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # the front door's own hops (`FrontDoorHops`): the share of an objective kept from the bubbles
        self.hops = Histogram(
            "bubbletea:front_door_hops_seconds",
            "The front door's own share of a time to first token: receipt to queued, the answer's way back "
            "through Redis, and its write.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.hops_kept = Gauge(
            "bubbletea:front_door_hops_kept_seconds",
            "Of the last TTFT objective, the seconds kept for the front door's hops (the dispatcher and the "
            "workers are given the rest).",
            registry=r,
        )
        for where in PromptPlacement:  # every series exists from the start, at 0
            self.placed.labels(where.value)
            self.placed_tokens.labels(where.value)
        self.success = Counter(
            "bubbletea:request_success",
            "Completed choices by finish reason (length: the one token; stop: a stop sequence).",
            ["finished_reason", "model_name"],
            registry=r,
        )

    def placed_prompt(self, where: PromptPlacement, tokens: int, ttft_s: float) -> None:
        """A prompt answered: where it was computed, its length, submission to its first token."""
        self.placed.labels(where.value).inc()
        self.placed_tokens.labels(where.value).inc(tokens)
        self.placed_ttft.labels(where.value).observe(max(0.0, ttft_s))
