"""Prometheus metrics of one stage worker (one pipeline slot), in its own registry.

Every metric carries the run (`run`) and the slot (`worker`, e.g. ``r0s1``); the prefill ones also
the served model (`model_name`). The runner, the fill executor and its reporter each record a value
in one line where they already have it; the stream gauges are read at scrape time (`refresh`).

Tested by: tests/integration/test_service_metrics.py, tests/integration/test_guest_failure.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector
from redis.asyncio import Redis

from shared.service.telemetry import FAST_BUCKETS, SLOW_BUCKETS, StreamMetrics
from shared.wire import PrefillProgress
from shared.wire.status import ItemOutcome


class WorkerMetrics:
    def __init__(self, run: str, worker: str, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r, who, model = self.registry, ["run", "worker"], ["run", "worker", "model_name"]
        self.streams = StreamMetrics(r)
        self._iteration_s = Histogram(
            "bubbletea:iteration_seconds",
            "Wall time of one training iteration on this worker: its first action's start to its "
            "optimizer step's end (IterationDone.ended - started).",
            who,
            buckets=SLOW_BUCKETS,
            registry=r,
        ).labels(run, worker)
        self._iterations = Counter(
            "bubbletea:iterations", "Training iterations this worker finished.", who, registry=r
        ).labels(run, worker)
        self._loss = Gauge(
            "bubbletea:training_loss",
            "Training loss of the last iteration (mean over its microbatches); only on the last "
            "pipeline stage, which computes it.",
            who,
            registry=r,
        )
        self._training_lag = Counter(
            "bubbletea:training_lag_seconds",
            "Seconds the real training compute (forward, backward, step) took beyond the device "
            "profile's times: how far this machine fell behind the emulated accelerator.",
            who,
            registry=r,
        ).labels(run, worker)
        self._prefill_lag = Counter(
            "bubbletea:prefill_lag_seconds",
            "Seconds prefill batches ran past their device profile's schedule (real work slower than the profile).",
            who,
            registry=r,
        ).labels(run, worker)
        self._bubble_s = Counter(
            "bubbletea:bubble_seconds",
            "Seconds this worker waited for pipeline input (an activation or a gradient that had not "
            "arrived): its bubbles, the time prefill may use.",
            who,
            registry=r,
        ).labels(run, worker)
        self._prefill_s = Counter(
            "bubbletea:prefill_seconds",
            "Seconds this worker ran prefill batches inside its bubbles (first block's start to last "
            "block's end of each batch that ran).",
            model,
            registry=r,
        ).labels(run, worker, model_name)
        self._fill_ratio = Gauge(
            "bubbletea:bubble_fill_ratio",
            "Prefill seconds / bubble seconds of the last finished iteration on this worker (0 when "
            "it had no bubble): the share of its bubbles BubbleTea used.",
            who,
            registry=r,
        ).labels(run, worker)
        self._prediction_error = Histogram(
            "bubbletea:bubble_prediction_error_seconds",
            "Per bubble: |actual length - predicted length|, seconds (the prediction it announced in "
            "BubbleStart against the wait it had).",
            who,
            buckets=FAST_BUCKETS,
            registry=r,
        ).labels(run, worker)
        self._requests = Counter(
            "bubbletea:prefill_requests",
            "Prefill requests this worker reported on, per batch item, by outcome: done (answered), "
            "failed (answered with an error), partial (preempted or handed back; resumes later).",
            [*model, "outcome"],
            registry=r,
        )
        self._tokens = Counter(
            "bubbletea:prefill_tokens",
            "Prompt tokens of the prefill requests this worker finished successfully.",
            model,
            registry=r,
        ).labels(run, worker, model_name)
        self._guest_failures = Counter(
            "bubbletea:prefill_batch_failures",
            "Prefill batches whose prefill model raised on this worker (each fails the request it ran; "
            "training goes on).",
            model,
            registry=r,
        ).labels(run, worker, model_name)
        self._taking = Gauge(
            "bubbletea:prefill_taking",
            "1 while this worker takes prefill; 0 once it stopped, after its prefill model failed batch "
            "after batch (training goes on).",
            model,
            registry=r,
        ).labels(run, worker, model_name)
        self._taking.set(1)
        self.run, self.worker, self.model_name = run, worker, model_name
        for outcome in ItemOutcome:  # every series exists from the start, at 0
            self._requests.labels(run, worker, model_name, outcome.value)
        self._bubble_in_iteration = self._prefill_in_iteration = 0.0

    # --- recording (one call where the worker has the value) -------------------------------

    def bubble(self, actual_s: float, predicted_s: float) -> None:
        """A bubble ended: it lasted `actual_s`; `predicted_s` was announced."""
        self._bubble_s.inc(actual_s)
        self._bubble_in_iteration += actual_s
        self._prediction_error.observe(abs(actual_s - predicted_s))

    def prefill(self, seconds: float) -> None:
        """A prefill batch ran for `seconds` inside a bubble."""
        self._prefill_s.inc(max(0.0, seconds))
        self._prefill_in_iteration += max(0.0, seconds)

    def iteration(self, started: float, ended: float, loss: float | None, lag_s: float, prefill_lag_s: float) -> None:
        """A training iteration finished (the values of its IterationDone, lags in seconds)."""
        self._iteration_s.observe(ended - started)
        self._iterations.inc()
        if loss is not None:
            self._loss.labels(self.run, self.worker).set(loss)
        self._training_lag.inc(lag_s)
        self._prefill_lag.inc(prefill_lag_s)
        bubble, prefill = self._bubble_in_iteration, self._prefill_in_iteration
        self._fill_ratio.set(prefill / bubble if bubble > 0 else 0.0)
        self._bubble_in_iteration = self._prefill_in_iteration = 0.0

    def prefill_failed(self, *, taking: bool) -> None:
        """A prefill batch failed; `taking`: whether this worker still takes prefill."""
        self._guest_failures.inc()
        self._taking.set(1 if taking else 0)

    def reported(self, progress: Iterable[PrefillProgress], prompt_tokens: Mapping[str, int]) -> None:
        """A batch's report went out: one count per item by outcome; the prompt tokens of the
        items done (`prompt_tokens`: by request id) count as prefilled."""
        for p in progress:
            self._requests.labels(self.run, self.worker, self.model_name, p.outcome.value).inc()
            if p.outcome is ItemOutcome.DONE:
                self._tokens.inc(prompt_tokens.get(p.id, 0))

    async def refresh(self, redis: Redis) -> None:
        await self.streams.refresh(redis)
