"""Pure computations for the pictures and the table: no files, no matplotlib, exact and unit-tested.

The pictures only draw what these functions (and `shared.figures.runstats`, where every run figure is
defined) return, so the numbers a reader sees in a picture are the numbers the tests check.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bubbletea.report.data import KNOWN_KINDS, METRIC_COLUMNS, MetricColumn, Summary
from shared.figures.runstats import TRAINING_KINDS
from shared.policies.spans import Span

NULL_CELL = "\N{EN DASH}"  # a dash: "not measured" (e.g. TTFT when BubbleTea is off), not zero


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
