"""Prometheus metrics of the dispatcher, in its own registry.

Every metric carries the run (`run`); those about the served model also `model_name`. The
dispatcher records each value in one call where it has it (a bubble's end, a batch sent, a request
failed or finished); the gauges read from its state and from Redis are set at scrape time (`refresh`).

Tested by: tests/integration/test_service_metrics.py, tests/unit/test_monitoring_assets.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector
from redis.asyncio import Redis

from shared.policies.dispatch import DispatchState
from shared.service.telemetry import FAST_BUCKETS, StreamMetrics
from shared.wire import PrefillRequest
from shared.wire.status import FailureReason, ServingState

#: prefill_batches_total's outcomes
SENT, LOST = "sent", "lost"


class DispatcherMetrics:
    def __init__(self, run: str, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.run, self.model_name = run, model_name
        self.streams = StreamMetrics(r)
        self._queued_at_start = Histogram(
            "bubbletea:bubble_start_queued_seconds",
            "Per bubble start: the prefill work its worker held as it opened (BubbleStart.queued_ms, by "
            "the worker's count of the dispatcher's predictions), seconds. Work is queued on a worker "
            "before its bubbles (its credit): 0 means the bubble opened with nothing to run.",
            ["run"],
            buckets=FAST_BUCKETS,
            registry=r,
        ).labels(run)
        self._empty_starts = Counter(
            "bubbletea:bubbles_opened_empty",
            "Bubbles that opened with nothing queued on their worker while requests waited here: the "
            "control plane did not keep that worker's credit filled in time.",
            ["run"],
            registry=r,
        ).labels(run)
        self._held = Gauge(
            "bubbletea:credit_held_seconds",
            "Predicted prefill work held on the workers (sent, not yet known used), summed: what the "
            "dispatcher believes is queued there. Set at scrape time.",
            ["run"],
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
            "held on a worker in a batch not reported finished yet. Set at scrape time.",
            ["run", "model_name"],
            registry=r,
        ).labels(run, model_name)
        self._batches = Counter(
            "bubbletea:prefill_batches",
            "Prefill batches by outcome: sent (published to a worker's fill stream, for its queue), "
            "lost (no report came back in time: its requests were queued again).",
            ["run", "outcome"],
            registry=r,
        )
        self._failures = Counter(
            "bubbletea:request_failures",
            "Prefill requests the dispatcher failed explicitly, by reason (deadline: it passed while "
            "queued; unavailable: nothing could serve it; to_decoder is not a failure: the bubbles could not "
            "compute it by its TTFT objective and the front door had the decoder compute it).",
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
        self._no_prefill = Gauge(
            "bubbletea:workers_without_prefill",
            "Workers that stopped taking prefill after their prefill model failed batch after batch "
            "(PrefillOff): they train on, and are sent no prefill. Set at scrape time.",
            ["run"],
            registry=r,
        ).labels(run)
        self._state = Gauge(
            "bubbletea:serving_state",
            "The readiness gate's verdict: 1 for the current state (serving, joining, starting, stalled, "
            "finished, stopped, recovering, lost, disabled, prefill_failed), 0 for the others.",
            ["run", "state"],
            registry=r,
        )
        for outcome in (SENT, LOST):  # every series exists from the start, at 0
            self._batches.labels(run, outcome)
        for reason in FailureReason:
            self._failures.labels(run, reason.value)

    # --- recording (one call where the dispatcher has the value) ---------------------------

    def bubble_ended(self, actual_ms: float, predicted_ms: float) -> None:
        self._bubbles.inc()
        self._bubble_s.inc(max(0.0, actual_ms) / 1000)
        self._prediction_error.observe(abs(actual_ms - predicted_ms) / 1000)

    def bubble_started(self, queued_s: float, requests_waiting: bool) -> None:
        self._queued_at_start.observe(max(0.0, queued_s))
        if queued_s <= 0 and requests_waiting:
            self._empty_starts.inc()

    def batches_sent(self, n: int) -> None:
        self._batches.labels(self.run, SENT).inc(n)

    def serving_state(self, state: ServingState) -> None:
        self._serving.set(1 if state.ready else 0)
        for s in ServingState:
            self._state.labels(self.run, s.value).set(1 if s is state else 0)

    def batch_lost(self) -> None:
        self._batches.labels(self.run, LOST).inc()

    def request_failed(self, reason: FailureReason) -> None:
        self._failures.labels(self.run, reason.value).inc()

    def request_moved(self) -> None:
        """A request moved to the decoder: counted under `to_decoder` (not a failure, as the
        counter's help says), so one counter shows where every unanswered prompt went."""
        self._failures.labels(self.run, FailureReason.TO_DECODER.value).inc()

    def request_finished(self) -> None:
        self._finished.inc()

    async def refresh(self, redis: Redis, state: DispatchState[PrefillRequest] | None) -> None:
        """The gauges at scrape time; a standby (no `state`) holds nothing."""
        await self.streams.refresh(redis)
        workers = state.workers.values() if state is not None else ()
        self._waiting.set(len(state.requests) if state is not None else 0)  # after the awaits: near the scrape
        self._held.set(sum(c.held_s for c in workers))
        self._no_prefill.set(sum(c.off is not None for c in workers))
