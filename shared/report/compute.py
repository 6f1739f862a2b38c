"""Pure computations over spans and the summary: no files, no matplotlib, exact and unit-tested.

The pictures only draw what these functions return, so the numbers a reader sees in a picture are
the numbers the tests check.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal, TypedDict

from shared.report.data import KNOWN_KINDS, METRIC_COLUMNS, TRAINING_KINDS, MetricColumn, Span, Summary

Window = tuple[float, float]
NULL_CELL = "\N{EN DASH}"  # a dash: "not measured" (e.g. TTFT when BubbleTea is off), not zero


UsagePart = Literal["training", "prefill", "other", "idle"]
USAGE_PARTS: tuple[UsagePart, ...] = ("training", "prefill", "other", "idle")


class Usage(TypedDict):
    """How one worker spent a window, in seconds. training + prefill + other + idle == total."""

    training: float
    prefill: float
    other: float
    idle: float
    total: float


# --- intervals -------------------------------------------------------------------------------


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals, so nothing is counted twice
    (two wait spans for two peers, or a fwd span reported overlapping an allreduce)."""
    total = 0.0
    current: tuple[float, float] | None = None
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        total += current[1] - current[0]
    return total


def full_window(spans: Sequence[Span]) -> Window:
    """First start to last end over all workers: the time the run was observed."""
    if not spans:
        raise ValueError("no spans: the window is undefined")
    return min(s.start for s in spans), max(s.end for s in spans)


def steady_window(spans: Sequence[Span]) -> Window:
    """The window without the warm-up iteration 0 (start-up, first compilation, connection setup),
    which would otherwise dominate the idle share of a short run. Falls back to the full window
    when iteration 0 is all there is."""
    later = [s for s in spans if s.iteration >= 1]
    if not later:
        return full_window(spans)
    return min(iteration_starts(later).values()), max(s.end for s in spans)


def _clip(span: Span, window: Window) -> tuple[float, float] | None:
    start, end = max(span.start, window[0]), min(span.end, window[1])
    return (start, end) if end > start else None


def worker_order(spans: Iterable[Span]) -> list[str]:
    """Workers sorted by stage, then replica: the order of the rows in pipeline diagrams."""
    keys = {(s.stage, s.replica) for s in spans}
    return [f"r{replica}s{stage}" for stage, replica in sorted(keys)]


def utilization(spans: Sequence[Span], window: Window | None = None) -> dict[str, Usage]:
    """Per worker, the seconds of `window` spent training, prefilling, on other work, and idle.

    Overlaps are resolved by priority training > prefill > other > idle, each measured as a union:
    prefill runs while a worker waits, so a prefill span over a wait span is prefill (the bubble
    was filled), and a wait span on its own is idle. Workers are ordered as in `worker_order`.
    """
    if not spans:
        return {}
    lo, hi = window if window is not None else full_window(spans)
    if hi < lo:
        raise ValueError(f"window ends before it starts: {lo} .. {hi}")
    by_class: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for span in spans:
        clipped = _clip(span, (lo, hi))
        if clipped is not None and span.kind != "wait":
            by_class[span.worker][_usage_class(span.kind)].append(clipped)
    return {worker: _usage(by_class[worker], hi - lo) for worker in worker_order(spans)}


def _usage_class(kind: str) -> str:
    if kind in TRAINING_KINDS:
        return "training"
    return kind if kind == "prefill" else "other"


def _usage(intervals: dict[str, list[tuple[float, float]]], total: float) -> Usage:
    training = union_length(intervals["training"])
    with_prefill = union_length(intervals["training"] + intervals["prefill"])
    busy = union_length(intervals["training"] + intervals["prefill"] + intervals["other"])
    return Usage(
        training=training,
        prefill=max(0.0, with_prefill - training),
        other=max(0.0, busy - with_prefill),
        idle=max(0.0, total - busy),
        total=total,
    )


# --- iterations ------------------------------------------------------------------------------


def select_iterations(spans: Sequence[Span], first: int, count: int) -> list[Span]:
    """The spans of the first `count` iterations numbered `first` or later (gaps are skipped).

    A timeline is readable for a few iterations only. If no iteration is numbered `first` or later
    (a run that only did its warm-up), the first `count` iterations are taken instead, so something
    is still drawn.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    present = sorted({s.iteration for s in spans})
    chosen = [i for i in present if i >= first][:count] or present[:count]
    keep = set(chosen)
    return [s for s in spans if s.iteration in keep]


def iteration_starts(spans: Sequence[Span]) -> dict[int, float]:
    """When each iteration began: its first compute span (waits for it can start earlier, while the
    previous iteration drains), or its first span of any kind when it has no compute."""
    first_any: dict[int, float] = {}
    first_compute: dict[int, float] = {}
    for span in spans:
        first_any[span.iteration] = min(first_any.get(span.iteration, math.inf), span.start)
        if span.kind in TRAINING_KINDS:
            first_compute[span.iteration] = min(first_compute.get(span.iteration, math.inf), span.start)
    return {it: first_compute.get(it, first_any[it]) for it in sorted(first_any)}


def kind_of(span: Span) -> str:
    """The drawing / legend class of a span: its kind if known, else "other"."""
    return span.kind if span.kind in KNOWN_KINDS else "other"


# --- the comparison table --------------------------------------------------------------------


def format_metric(column: MetricColumn, value: float | None) -> str:
    """One table cell: null (or NaN) is a dash, fractions are percentages, counts are integers."""
    if value is None or math.isnan(value):
        return NULL_CELL
    if column.unit == "fraction":
        return f"{value * 100:.1f}%"
    if column.unit == "count":
        return str(round(value))
    return f"{value:.1f}"


def markdown_table(summary: Summary) -> str:
    """The runs side by side, one row per run, the known metrics in a fixed column order."""
    header = ["Run", *(c.header for c in METRIC_COLUMNS)]
    lines = [
        _row(header),
        _row(["---", *("---:" for _ in METRIC_COLUMNS)]),
    ]
    for run in summary.runs:
        cells = [format_metric(c, run.metrics.get(c.key)) for c in METRIC_COLUMNS]
        lines.append(_row([_escape(run.label), *cells]))
    return "\n".join(lines) + "\n"


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _escape(text: str) -> str:
    """A label must not break the table: pipes are escaped and line breaks flattened."""
    return " ".join(text.split()).replace("|", "\\|")
