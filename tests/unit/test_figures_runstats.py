"""The run figures: one definition, used by the summary table and the utilization picture alike."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from bubbletea.report.data import load_run_folder
from bubbletea.report.write import usage_by_run
from shared.figures.runstats import (
    TRAINING_KINDS,
    share,
    span_dict,
    steady,
    steady_usage,
    steady_window,
    utilization,
    write_spans,
)
from shared.policies.spans import Span
from shared.wire import SpanRecord

# (stage, kind, start, end) of one 1-second iteration of a 2-stage pipeline; times are multiples of
# 1/16 so every sum is exact. Spans of one class never overlap on a worker and prefill lies inside
# waits: the shape a live worker reports.
ITERATION = [
    (0, "fwd", 0.0, 0.125),
    (0, "wait", 0.125, 0.625),
    (0, "prefill", 0.1875, 0.5),
    (0, "bwd", 0.625, 0.875),
    (0, "allreduce", 0.875, 0.9375),
    (0, "step", 0.9375, 1.0),
    (1, "wait", 0.0, 0.125),
    (1, "fwd", 0.125, 0.25),
    (1, "bwd", 0.25, 0.5),
    (1, "wait", 0.5, 0.75),
    (1, "prefill", 0.5625, 0.6875),
    (1, "checkpoint", 0.75, 0.8125),
    (1, "step", 0.8125, 0.875),
]


def records(iterations: int = 3, replicas: int = 2) -> list[SpanRecord]:
    """What the workers send: every replica runs the same iterations, replica 1 a little later."""
    return [
        SpanRecord(
            run="t",
            replica=r,
            stage=stage,
            iteration=it,
            span=kind,
            start=1000.0 + it + r / 16 + a,
            end=1000.0 + it + r / 16 + b,
            microbatch=0 if kind in ("fwd", "bwd") else -1,
        )
        for it in range(iterations)
        for r in range(replicas)
        for stage, kind, a, b in ITERATION
    ]


def spans() -> list[Span]:
    return [Span.from_record(r) for r in records()]


def summed(spans: list[Span]) -> dict[str, float]:
    """The figures by summing span durations over the steady window (the published definition)."""
    kept = steady(spans)
    lo, hi = min(s.start for s in kept), max(s.end for s in kept)
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for s in kept:
        per[s.worker]["training" if s.kind in TRAINING_KINDS else s.kind] += s.duration
    n, window = len(per), hi - lo
    out = {k: sum(v[k] for v in per.values()) / n / window for k in ("training", "prefill", "wait")}
    return {**out, "fill_ratio": out["prefill"] / out["wait"], "window": window}


def test_union_figures_equal_summed_durations_when_spans_do_not_overlap() -> None:
    u, want = utilization(spans()), summed(spans())
    assert u.workers == 4
    assert u.window_s == want["window"] == pytest.approx(2 + 1 / 16)
    assert u.training == pytest.approx(want["training"], rel=1e-12)
    assert u.prefill == pytest.approx(want["prefill"], rel=1e-12)
    assert u.bubble == pytest.approx(want["wait"], rel=1e-12)
    assert u.fill_ratio == pytest.approx(want["fill_ratio"], rel=1e-12)
    assert u.busy == pytest.approx(want["training"] + want["prefill"], rel=1e-12)


def test_steady_window_leaves_iteration_zero_out() -> None:
    s = spans()
    assert steady_window(s) == (1001.0, 1003.0 + 1 / 16)
    # an iteration-0 span inside the steady window is left out, not clipped in
    late = Span(0, 0, 0, "fwd", 1001.5, 1001.5625)
    assert steady_usage([*s, late]) == steady_usage(s)
    only_warmup = [x for x in s if x.iteration == 0]
    assert steady_window(only_warmup) == (1000.0, 1001.0 + 1 / 16)
    assert utilization(only_warmup).workers == 4


def test_no_spans() -> None:
    assert steady_usage([]) == {}
    u = utilization([])
    assert (u.busy, u.bubble, u.fill_ratio, u.workers) == (0.0, 0.0, 0.0, 0)


def test_picture_and_summary_agree(tmp_path: Path) -> None:
    """The demo writes spans.jsonl and summary.json from the spans it read off the bus; the report
    draws utilization.png from the folder. The picture's mean of training + prefill over workers is
    the summary's utilization, and its wait is the bubble fraction."""
    s = spans()
    (tmp_path / "run").mkdir()
    write_spans(tmp_path / "run" / "spans.jsonl", s)
    u = utilization(s)
    summary = {"runs": [{"name": "run", "label": "Run", "metrics": {"utilization": u.busy}}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    folder = load_run_folder(tmp_path)
    assert folder.spans["run"] == s  # spans.jsonl round-trips the wire's spans exactly
    [(label, usage)] = usage_by_run(folder)
    assert label == "Run" and usage == steady_usage(s)
    n = len(usage)
    drawn_busy = sum(share(w, "training") + share(w, "prefill") for w in usage.values()) / n
    assert drawn_busy == pytest.approx(folder.summary.runs[0].metrics["utilization"], rel=1e-12)
    assert sum(share(w, "wait") for w in usage.values()) / n == pytest.approx(u.bubble, rel=1e-12)
    for w in usage.values():  # the bars fill the window exactly
        assert sum(share(w, p) for p in ("training", "prefill", "other", "idle")) == pytest.approx(1.0)


def test_span_from_record_and_back() -> None:
    rec = records(iterations=1, replicas=1)
    fwd, wait = Span.from_record(rec[0]), Span.from_record(rec[1])
    assert (fwd.worker, fwd.kind, fwd.microbatch) == ("r0s0", "fwd", 0)
    assert wait.microbatch is None  # -1 on the wire
    assert span_dict(wait) == {
        "replica": 0,
        "stage": 0,
        "iteration": 0,
        "span": "wait",
        "start": 1000.125,
        "end": 1000.625,
        "microbatch": None,
    }
