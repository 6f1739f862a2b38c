"""A run's spans: one interval of one worker's time each (`Span`). A live run's workers send them
on the wire (`SpanRecord`, read back with `Span.from_record`) and a run folder's spans.jsonl holds
them; the analytic model (`pipeline_run`) produces the same, so the figures
(`shared.figures.runstats`) compute one way over both.

Tested by: tests/unit/test_sim_fit.py, tests/unit/test_figures_bubblestats.py, tests/unit/test_figures_runstats.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.wire import SpanRecord


@dataclass(frozen=True, slots=True)
class Span:
    """One interval of one worker's time, in wall-clock seconds (a line of spans.jsonl)."""

    replica: int
    stage: int
    iteration: int
    kind: str  # fwd, bwd, wait, allreduce, step, prefill; anything else is "other" work
    start: float
    end: float
    microbatch: int | None = None
    #: wait spans: the bubble's predicted length (ms) and when the awaited input arrived (wall clock)
    predicted_ms: float | None = None
    input_at: float | None = None

    @classmethod
    def from_record(cls, record: SpanRecord) -> Span:
        """The span a worker sent on the wire (where microbatch -1 means none)."""
        mb = record.microbatch if record.microbatch >= 0 else None
        predicted = record.predicted_ms if record.predicted_ms >= 0 else None
        arrived = record.input_at if record.input_at > 0 else None
        return cls(
            record.replica,
            record.stage,
            record.iteration,
            record.span,
            record.start,
            record.end,
            mb,
            predicted,
            arrived,
        )

    @property
    def worker(self) -> str:
        """The worker's display name, "r<replica>s<stage>", as used throughout the project."""
        return f"r{self.replica}s{self.stage}"

    @property
    def duration(self) -> float:
        return self.end - self.start
