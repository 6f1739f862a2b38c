"""The one definition of each run figure, from a run's spans; and reading / writing those spans.

The demo's table (summary.json), `bubbletea up`'s summary, the report's utilization picture, the
simulator (`sim/`) and the benchmarks (`bench/`) all take their numbers from here, so they cannot
disagree about one run.

* **steady window**: the spans of iterations 1 and later (iteration 0 is start-up: the first
  tensors, allocator warm-up), from the first one's start to the last one's end; all spans if
  iteration 0 is all there is. Iteration-0 spans are left out, not clipped into the window.
* **per-worker usage** (`worker_usage`): seconds of the window spent training (fwd, bwd,
  all-reduce, step), on prefill, on other work, idle, and waiting for a peer (the bubbles).
* **utilization**: (training + prefill) / window per worker, the mean over workers.
* **bubble**: a `wait` span from its start to the arrival of the training input it awaited
  (`input_at`); the rest of the span, where prefill ran on past that arrival, is **overrun**: it
  delayed training, and it is neither bubble nor fill.
* **bubble fraction**: bubble time / window per worker, the mean over workers.
* **fill ratio**: prefill time inside the bubbles / bubble time (mean filled share / mean bubble
  share): how much of the bubbles BubbleTea used. Prefill during overrun does not count.
* **overrun** (`overrun_ms_total`): per bubble with prefill in it, training input arrived to
  training resumed, summed.
* the per-bubble dispatch figures (every bubble that opened with work, filled or not) are in
  `shared/figures/bubblestats.py`.

Each time is the length of a union of intervals, so nothing is counted twice; training, prefill and
other work are resolved by priority (training > prefill > other; the rest is idle). A worker does
one training operation at a time and runs prefill only inside a wait, so on a live run's spans
(no two spans of one class overlap on a worker, and prefill never overlaps training) every figure
equals the plain sum of span durations over the window (tests/unit/test_figures_runstats.py pins this).

Spans are `Span` values (`shared.policies.spans`): a run folder's spans.jsonl holds them, and the
wire's `SpanRecord`s are turned into them as they are read (`run_spans`, `Span.from_record`).

Over 300 lines on purpose: the one definition of every run figure lives in one module, so no
figure can be computed two ways.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from shared.policies.spans import Span
from shared.wire import SpanRecord, decode, keys

if TYPE_CHECKING:
    from redis.asyncio import Redis

#: The span kinds that are training work; `wait` and `prefill` are the bubbles and their filling.
TRAINING_KINDS = frozenset({"fwd", "bwd", "allreduce", "step"})

Window = tuple[float, float]


# --- the window ------------------------------------------------------------------------------


def steady(spans: Iterable[Span]) -> list[Span]:
    """The spans of iterations after the first, if the run had more than one iteration."""
    spans = list(spans)
    return [s for s in spans if s.iteration >= 1] if any(s.iteration >= 1 for s in spans) else spans


def full_window(spans: Sequence[Span]) -> Window:
    """First start to last end over all workers: the time the spans cover."""
    if not spans:
        raise ValueError("no spans: the window is undefined")
    return min(s.start for s in spans), max(s.end for s in spans)


def steady_window(spans: Sequence[Span]) -> Window:
    """The window of the figures: the hull of the `steady` spans."""
    return full_window(steady(spans))


# --- per-worker usage ------------------------------------------------------------------------


UsagePart = Literal["training", "prefill", "other", "idle"]
#: The parts of a worker's time that add up to the window, in the order the picture stacks them.
USAGE_PARTS: tuple[UsagePart, ...] = ("training", "prefill", "other", "idle")


class Usage(TypedDict):
    """How one worker spent a window, in seconds. training + prefill + other + idle == total;
    wait (the bubbles, filled or not, up to their input's arrival) overlaps prefill and idle and is
    not one of the parts; filled is the prefill inside them."""

    training: float
    prefill: float
    other: float
    idle: float
    wait: float
    filled: float
    total: float


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


def worker_order(spans: Iterable[Span]) -> list[str]:
    """Workers sorted by stage, then replica: the order of the rows in pipeline diagrams."""
    workers = {(s.stage, s.replica) for s in spans}
    return [f"r{replica}s{stage}" for stage, replica in sorted(workers)]


def worker_usage(spans: Sequence[Span], window: Window | None = None) -> dict[str, Usage]:
    """Per worker, the seconds of `window` (default: `full_window`) spent training, prefilling,
    on other work, idle, and waiting; spans are clipped to the window.

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
        end = bubble_end(span) if span.kind == "wait" else span.end
        start, end = max(span.start, lo), min(end, hi)
        if end > start:
            by_class[span.worker][_usage_class(span.kind)].append((start, end))
    return {worker: _usage(by_class[worker], hi - lo) for worker in worker_order(spans)}


def bubble_end(wait: Span) -> float:
    """Where a wait span's bubble ends: when the training input it awaited arrived (the span's end
    when that is not known, or came later: a span never grows)."""
    return min(wait.end, wait.input_at) if wait.input_at is not None else wait.end


def _usage_class(kind: str) -> str:
    if kind in TRAINING_KINDS:
        return "training"
    return kind if kind in ("prefill", "wait") else "other"


def _usage(intervals: dict[str, list[tuple[float, float]]], total: float) -> Usage:
    training = union_length(intervals["training"])
    wait, prefill = union_length(intervals["wait"]), union_length(intervals["prefill"])
    with_prefill = union_length(intervals["training"] + intervals["prefill"])
    busy = union_length(intervals["training"] + intervals["prefill"] + intervals["other"])
    return Usage(
        training=training,
        prefill=max(0.0, with_prefill - training),
        other=max(0.0, busy - with_prefill),
        idle=max(0.0, total - busy),
        wait=wait,
        filled=max(0.0, wait + prefill - union_length(intervals["wait"] + intervals["prefill"])),
        total=total,
    )


def steady_usage(spans: Sequence[Span]) -> dict[str, Usage]:
    """`worker_usage` of the steady spans over the steady window: what the figures are made of
    (the utilization picture draws exactly this)."""
    kept = steady(spans)
    return worker_usage(kept, full_window(kept)) if kept else {}


def share(usage: Usage, part: Literal["training", "prefill", "other", "idle", "wait", "filled"]) -> float:
    """A part of one worker's usage as a share of its window (0 for an empty window)."""
    return usage[part] / usage["total"] if usage["total"] > 0 else 0.0


# --- the headline figures --------------------------------------------------------------------


@dataclass(frozen=True)
class Utilization:
    training: float  # mean over workers of training time / window
    prefill: float  # mean over workers of prefill time / window
    bubble: float  # mean over workers of bubble time / window: the bubble fraction
    fill_ratio: float  # prefill time inside bubbles / bubble time (0 when there were no bubbles)
    window_s: float
    workers: int

    @property
    def busy(self) -> float:
        """Utilization: training + prefill time over the window, mean over workers."""
        return self.training + self.prefill


def utilization(spans: Iterable[Span]) -> Utilization:
    """The headline figures of a run, from `steady_usage`."""
    usage = list(steady_usage(list(spans)).values())
    if not usage:
        return Utilization(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    n = len(usage)
    training = sum(share(u, "training") for u in usage) / n
    prefill = sum(share(u, "prefill") for u in usage) / n
    wait = sum(share(u, "wait") for u in usage) / n
    filled = sum(share(u, "filled") for u in usage) / n
    fill = (filled / wait) if wait > 0 else 0.0
    return Utilization(training, prefill, wait, fill, usage[0]["total"], n)


def prefill_lag_share(prefill_lag_ms: float, spans: Iterable[Span]) -> float:
    """The prefill lag behind the device profile over the run's prefill time (both real): the
    share of prefill time that was real compute running late. 0 without prefill."""
    prefill_ms = sum(s.duration for s in spans if s.kind == "prefill") * 1000
    return prefill_lag_ms / prefill_ms if prefill_ms > 0 else 0.0


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# --- reading and writing spans ---------------------------------------------------------------


async def read_stream(r: Redis, stream: str) -> list[Any]:
    """Every message on a stream, oldest first (telemetry streams are bounded; this reads in pages)."""
    out: list[Any] = []
    cursor = "-"
    while True:
        rows: Any = await r.xrange(stream, min=cursor, count=10_000)
        if cursor != "-" and rows:
            rows = rows[1:]  # the page starts at the last entry already read
        if not rows:
            return out
        out += [decode(f[b"m"]) for _, f in rows]
        cursor = rows[-1][0].decode()


async def run_spans(r: Redis, run: str) -> list[Span]:
    """Every span of a run, from its spans stream."""
    return [Span.from_record(m) for m in await read_stream(r, keys.spans_stream(run)) if isinstance(m, SpanRecord)]


def span_dict(s: Span, *, full: bool = False) -> dict[str, Any]:
    """A span as one line of a run folder's spans.jsonl (docs/report.md); `full`: with a wait
    span's predicted length and its input's arrival too."""
    out = {
        "replica": s.replica,
        "stage": s.stage,
        "iteration": s.iteration,
        "span": s.kind,
        "start": s.start,
        "end": s.end,
        "microbatch": s.microbatch,
    }
    return out | {"predicted_ms": s.predicted_ms, "input_at": s.input_at} if full else out


def write_spans(path: Path, spans: Iterable[Span], *, full: bool = False) -> None:
    """A run folder's spans.jsonl: one `span_dict` per line."""
    with path.open("w") as f:
        for s in spans:
            f.write(json.dumps(span_dict(s, full=full)) + "\n")
