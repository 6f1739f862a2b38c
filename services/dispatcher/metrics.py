"""Prometheus metrics of the dispatcher, in its own registry.

Every metric carries the run (`run`); those about the served model also `model_name`. The
dispatcher records each value in one call where it has it (a bubble's end, a batch sent, a request
failed or finished); the gauges read from its state and from Redis are set at scrape time (`refresh`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector
from redis.asyncio import Redis

from shared.control.status import FailureReason, ServingState
from shared.policies.decisions import Batch
from shared.policies.dispatch import Bubble, DispatchState
from shared.runtime.telemetry import FAST_BUCKETS, StreamMetrics

#: prefill_batches_total's outcomes
SENT, LOST = "sent", "lost"


class DispatcherMetrics:
    def __init__(self, run: str, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.run, self.model_name = run, model_name
        self.streams = StreamMetrics(r)
        self._dispatch_latency = Histogram(
            "bubbletea:dispatch_latency_seconds",
            "Per bubble that got work while open: its start on the worker (BubbleStart.at, wall clock) to "
            "the dispatcher publishing the first batch packed for it (trigger bubble_start, request or "
            "report). Batches staged ahead for a worker's next bubble (hold) are not counted: they are on "
            "the worker before that bubble starts.",
            ["run"],
            buckets=FAST_BUCKETS,
            registry=r,
        ).labels(run)
        self._bubbles = Counter(
            "bubbletea:bubbles", "Bubbles the workers announced as ended (BubbleEnd received).", ["run"], registry=r
        ).labels(run)
        self._bubble_s = Counter(
            "bubbletea:bubble_seconds",
            "Sum of the actual lengths of the ended bubbles of every worker (BubbleEnd.actual_ms), seconds.",
            ["run"],
            registry=r,
        ).labels(run)
        self._prediction_error = Histogram(
            "bubbletea:bubble_prediction_error_seconds",
            "Per ended bubble of any worker: |actual length - predicted length| as its BubbleEnd reports "
            "them, seconds.",
            ["run"],
            buckets=FAST_BUCKETS,
            registry=r,
        ).labels(run)
        self._waiting = Gauge(
            "bubbletea:num_requests_waiting",
            "Prefill requests this dispatcher holds and has not seen answered: queued for a bubble, or "
            "sent in a batch not reported finished yet. Set at scrape time.",
            ["run", "model_name"],
            registry=r,
        ).labels(run, model_name)
        self._batches = Counter(
            "bubbletea:prefill_batches",
            "Prefill batches by outcome: sent (published to a worker's fill stream, staged ones "
            "included), lost (no report came back in time: its requests were queued again).",
            ["run", "outcome"],
            registry=r,
        )
        self._failures = Counter(
            "bubbletea:request_failures",
            "Prefill requests the dispatcher failed explicitly, by reason (deadline: it passed while "
            "queued; unavailable: nothing could serve it).",
            ["run", "reason"],
            registry=r,
        )
        self._finished = Counter(
            "bubbletea:request_finished",
            "Prefill requests a worker reported finished (answered, ok or failed, by the worker); "
            "their held entries are acked.",
            ["run"],
            registry=r,
        ).labels(run)
        self._serving = Gauge(
            "bubbletea:serving",
            "1 while the readiness gate says prefill can be served (training runs, bubbles come), else 0.",
            ["run"],
            registry=r,
        ).labels(run)
        self._state = Gauge(
            "bubbletea:serving_state",
            "The readiness gate's verdict: 1 for the current state (serving, joining, starting, stalled, "
            "finished, stopped, recovering, lost, disabled), 0 for the others.",
            ["run", "state"],
            registry=r,
        )
        for outcome in (SENT, LOST):  # every series exists from the start, at 0
            self._batches.labels(run, outcome)
        for reason in FailureReason:
            self._failures.labels(run, reason.value)
        #: per worker: the tag of the last bubble whose dispatch latency was observed
        self._observed: dict[str, object] = {}

    # --- recording (one call where the dispatcher has the value) ---------------------------

    def bubble_ended(self, actual_ms: float, predicted_ms: float) -> None:
        self._bubbles.inc()
        self._bubble_s.inc(max(0.0, actual_ms) / 1000)
        self._prediction_error.observe(abs(actual_ms - predicted_ms) / 1000)

    def batch_sent(self, batch: Batch, bubble: Bubble | None, now: float) -> None:
        """`batch` was published at `now`; `bubble`: its worker's open bubble, if any."""
        self._batches.labels(self.run, SENT).inc()
        tag = batch.why.bubble
        if batch.hold or tag is None or bubble is None or bubble.tag != tag:
            return  # staged for a future bubble, or its bubble already closed
        if self._observed.get(batch.worker, _NONE) == tag:
            return  # not the bubble's first batch
        self._observed[batch.worker] = tag
        self._dispatch_latency.observe(max(0.0, now - bubble.started))

    def serving_state(self, state: ServingState) -> None:
        self._serving.set(1 if state.ready else 0)
        for s in ServingState:
            self._state.labels(self.run, s.value).set(1 if s is state else 0)

    def batch_lost(self) -> None:
        self._batches.labels(self.run, LOST).inc()

    def request_failed(self, reason: FailureReason) -> None:
        self._failures.labels(self.run, reason.value).inc()

    def request_finished(self) -> None:
        self._finished.inc()

    async def refresh(self, redis: Redis, state: DispatchState) -> None:
        await self.streams.refresh(redis)
        self._waiting.set(len(state.requests))  # after the awaits: as close to the scrape as can be


_NONE = object()
