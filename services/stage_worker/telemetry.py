"""A stage worker's record of its time: spans, sent once an iteration, and the prefill-lag warning.

Every span (forward, backward, wait, all-reduce, step, prefill) goes out with its iteration's
others in one round trip (`flush`); a resumed generation drops what a cut-short iteration
recorded (`drop`). The prefill-lag warning is never hidden, but is logged at most once a
`LAG_WARN_EVERY_S`.

Tested by: tests/e2e/test_training_correctness.py, tests/e2e/test_serving.py,
tests/integration/test_fill_executor.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.stage_worker.port.outbox import Outbox
from shared.runtime.logs import get_logger
from shared.wire import SpanRecord, keys

#: The prefill-lag warning is logged at most this often (with the sum since the last one).
LAG_WARN_EVERY_S = 60.0

log = get_logger(__name__)


@dataclass
class StageTelemetry:
    outbox: Outbox
    run: str
    replica: int
    stage: int
    slot_name: str
    _spans: list[SpanRecord] = field(default_factory=list)
    _lag_warned_at: float = -LAG_WARN_EVERY_S  # monotonic; the first lag is warned at once
    _lag_unreported_ms: float = 0.0
    _lag_iterations: int = 0

    def span(
        self,
        kind: str,
        it: int,
        start: float,
        end: float,
        mb: int = -1,
        *,
        predicted_ms: float = -1.0,
        input_at: float = 0.0,
    ) -> None:
        self._spans.append(
            SpanRecord(
                run=self.run,
                replica=self.replica,
                stage=self.stage,
                iteration=it,
                span=kind,
                start=start,
                end=end,
                microbatch=mb,
                predicted_ms=predicted_ms,
                input_at=input_at,
            )
        )

    def flush(self) -> None:
        """An iteration's spans go out together, in one round trip."""
        spans, self._spans = self._spans, []
        if spans:
            self.outbox.send_many(keys.spans_stream(self.run), spans, maxlen=keys.SPANS_MAXLEN)

    def drop(self) -> None:
        """What a cut-short iteration recorded (the run resumes in a new generation)."""
        self._spans = []

    def warn_prefill_lag(self, it: int, lag_ms: float) -> None:
        """Never hidden (the prefill profile claims a faster device than this one keeps up with),
        but a service that trains for days must not warn every iteration: at most one line per
        `LAG_WARN_EVERY_S`, summing what it covers (the metric prefill_lag_seconds_total has it all)."""
        if lag_ms <= 0:
            return
        self._lag_unreported_ms += lag_ms
        self._lag_iterations += 1
        now = time.monotonic()
        if now < self._lag_warned_at + LAG_WARN_EVERY_S:
            return
        log.warning(
            "prefill fell behind its device profile",
            slot=self.slot_name,
            iteration=it,
            iterations_behind=self._lag_iterations,
            lag_ms=self._lag_unreported_ms,
            next_warning_in_s=LAG_WARN_EVERY_S,
        )
        self._lag_warned_at, self._lag_unreported_ms, self._lag_iterations = now, 0.0, 0
