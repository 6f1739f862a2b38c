"""What a run's telemetry says: utilization, bubbles, fill ratio, dispatch latency (pure + one reader).

Shared by `bench/bubbletea.py` and `bubbletea demo`, so both report the same figures the same way.
Spans come from the run's spans stream (`SpanRecord`), reports from its prefill report stream.

* **utilization**: per worker, the share of the window spent on training operations (fwd, bwd,
  all-reduce, step), and on prefill; the mean over workers is quoted.
* **bubble fraction**: the share of the window a worker spent waiting for a peer (`wait` spans).
* **fill ratio**: prefill time / bubble time: how much of the idle time BubbleTea used.
* **dispatch latency**: bubble start on the worker to the first prefill of that bubble running.

The window leaves out iteration 0 (start-up: the first tensors, allocator warm-up) when there are more.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from shared import keys
from shared.wire import SpanRecord, decode

TRAINING_SPANS = frozenset({"fwd", "bwd", "allreduce", "step"})


@dataclass(frozen=True)
class Utilization:
    training: float  # mean over workers of training time / window
    prefill: float
    bubble: float  # wait time / window
    fill_ratio: float  # prefill time / wait time (0 when there were no bubbles)
    window_s: float
    workers: int

    @property
    def busy(self) -> float:
        return self.training + self.prefill


def steady(spans: Iterable[SpanRecord]) -> list[SpanRecord]:
    """The spans of iterations after the first, if the run had more than one iteration."""
    spans = list(spans)
    return [s for s in spans if s.iteration >= 1] if any(s.iteration >= 1 for s in spans) else spans


def utilization(spans: Iterable[SpanRecord]) -> Utilization:
    """Shares of the steady window, per worker, averaged. Spans of one kind do not overlap on a
    worker (a worker does one training operation at a time, and prefill only inside a wait)."""
    spans = steady(spans)
    if not spans:
        return Utilization(0.0, 0.0, 0.0, 0.0, 0.0, 0)
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    window = max(end - start, 1e-9)
    per: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in spans:
        kind = "training" if s.span in TRAINING_SPANS else s.span
        per[(s.replica, s.stage)][kind] += s.end - s.start
    n = len(per)
    training = sum(v["training"] for v in per.values()) / n / window
    prefill = sum(v["prefill"] for v in per.values()) / n / window
    wait = sum(v["wait"] for v in per.values()) / n / window
    fill = (prefill / wait) if wait > 0 else 0.0
    return Utilization(training, prefill, wait, fill, window, n)


def dispatch_latencies_ms(spans: Iterable[SpanRecord]) -> list[float]:
    """Per filled bubble: its start (a `wait` span's start) to the first prefill running in it, ms.
    (Read from spans, not reports: the report stream is a work queue, trimmed once consumed.)"""
    by_worker: dict[tuple[int, int], list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.span in ("wait", "prefill"):
            by_worker[(s.replica, s.stage)].append(s)
    out = []
    for seq in by_worker.values():
        seq.sort(key=lambda s: (s.start, s.span != "wait"))  # a wait before a prefill starting with it
        wait: SpanRecord | None = None
        for s in seq:
            if s.span == "wait":
                wait = s
            elif wait is not None and wait.start <= s.start <= wait.end:
                out.append((s.start - wait.start) * 1000)
                wait = None  # only the bubble's first prefill
    return out


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


async def run_spans(r: Redis, run: str) -> list[SpanRecord]:
    return [m for m in await read_stream(r, keys.spans_stream(run)) if isinstance(m, SpanRecord)]


def span_dict(s: SpanRecord) -> dict[str, Any]:
    """A span as one line of a run folder's spans.jsonl (docs/report.md)."""
    return {
        "replica": s.replica,
        "stage": s.stage,
        "iteration": s.iteration,
        "span": s.span,
        "start": s.start,
        "end": s.end,
        "microbatch": s.microbatch,
    }


def write_spans(path: Path, spans: Iterable[SpanRecord]) -> None:
    """A run folder's spans.jsonl: one `span_dict` per line."""
    with path.open("w") as f:
        for s in spans:
            f.write(json.dumps(span_dict(s)) + "\n")
