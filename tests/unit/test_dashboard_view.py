"""The run page's view (shared/figures/dashboard.py): segments, figures and faults from messages."""

from __future__ import annotations

import pytest

from shared.figures.dashboard import DashboardView, slot_worker, view_of_spans
from shared.figures.runstats import utilization
from shared.policies.spans import Span
from shared.wire import IterationDone, SpanRecord, WorkerFailed, WorkerJoined

T0 = 1_000.0


def record(kind: str, start: float, end: float, *, stage: int = 0, input_at: float = 0.0) -> SpanRecord:
    return SpanRecord(run="r", replica=1, stage=stage, iteration=1, span=kind, start=start, end=end, input_at=input_at)


def test_segments_are_device_ms_and_a_bubble_ends_at_its_inputs_arrival() -> None:
    v = DashboardView("r", time_scale=2.0, origin=T0)
    v.add(record("fwd", T0, T0 + 0.010), T0)
    v.add(record("wait", T0 + 0.010, T0 + 0.050, input_at=T0 + 0.040), T0)
    v.add(record("prefill", T0 + 0.012, T0 + 0.030), T0)
    segs = v.segments()
    assert [s[1:5] for s in segs] == [
        ["0.1", "compute", 0.0, 5.0],
        ["0.1", "bubble", 5.0, 20.0],  # real ms / k; the overrun past the input's arrival is not bubble
        ["0.1", "prefill", 6.0, 15.0],
    ]
    assert v.segments(after=2) == segs[2:]  # an update carries the newer ones


def test_figures_are_the_runstats_ones_and_totals_give_rates() -> None:
    v = DashboardView("r", origin=T0, ttft_objective_ms=100.0)
    records = [
        record("fwd", T0, T0 + 0.01),
        record("wait", T0 + 0.01, T0 + 0.03),
        record("prefill", T0 + 0.01, T0 + 0.02),
    ]
    for r in records:
        v.add(r, T0)
    v.totals(T0, {"answered": 0, "moved": 0, "refused": 0, "failed": 0})
    v.totals(T0 + 2, {"answered": 4, "moved": 0, "refused": 2, "failed": 0})
    for ttft in (50.0, 60.0, 70.0, 500.0):
        v.answer(T0 + 1, ttft)
    v.add(IterationDone(run="r", replica=0, stage=1, iteration=3, started=T0, ended=T0 + 0.2, loss=1.5), T0 + 2)
    fig = {f["name"]: f["value"] for f in v.figures(T0 + 2)}
    u = utilization(Span.from_record(r) for r in records)
    assert fig["fill-ratio"] == u.fill_ratio and fig["utilization"] == u.busy
    assert fig["answered-total"] == 4 and fig["answered-per-s"] == 2.0 and fig["refused-per-s"] == 1.0
    assert fig["slo-attainment"] == 3 / 6  # a refusal is a miss
    assert fig["iteration-ms"] == pytest.approx(200.0) and fig["loss"] == 1.5


def test_a_lost_worker_then_its_successor_are_two_faults() -> None:
    v = DashboardView("r", origin=T0)
    v.add(WorkerFailed(run="r", slot="r0s1", reason="killed"), T0 + 1)
    v.add(
        WorkerJoined(run="r", worker="h3", replica=0, stage=1, typical_bubble_ms=1, free_memory_bytes=0, at=T0 + 2),
        T0 + 2,
    )
    faults = v.view(T0 + 2)["faults"]
    assert [(f["kind"], f["worker"]) for f in faults] == [("worker-lost", "1.0"), ("takeover", "1.0")]
    assert "h3" in faults[1]["text"]
    assert slot_worker("r0s1") == "1.0" and slot_worker("other") == "other"


def test_a_finished_runs_view_holds_every_span() -> None:
    spans = [Span.from_record(record("fwd", T0 + i, T0 + i + 0.5)) for i in range(100)]
    view = view_of_spans("done", spans, 1.0, [10.0])
    assert len(view["segments"]) == 100 and view["segments"][0][3] == 0.0
