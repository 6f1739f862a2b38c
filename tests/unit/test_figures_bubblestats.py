"""The per-bubble figures: every bubble counted (filled or not), the fill ratio inside the bubble
only, overrun apart, and the control plane's latency as a share of a device-time bubble."""

from __future__ import annotations

import pytest

from shared.figures.bubblestats import (
    bubble_dispatch,
    control_shares,
    mean_bubble_ms,
    overruns_ms,
    prediction_errors_ms,
    recomputed_share,
    report_latencies_ms,
)
from shared.figures.runstats import utilization
from shared.policies.spans import Span
from shared.wire import ControlSeen
from shared.wire.status import ControlEvent


def wait(
    worker: int, start: float, end: float, *, predicted_ms: float = 40.0, input_at: float | None = None, it: int = 1
) -> Span:
    return Span(worker, 0, it, "wait", start, end, None, predicted_ms, end if input_at is None else input_at)


def prefill(worker: int, start: float, end: float, it: int = 1) -> Span:
    return Span(worker, 0, it, "prefill", start, end)


def opened(worker: int, at: float, with_work: bool) -> ControlSeen:
    return ControlSeen(
        run="r", worker=f"r{worker}s0", event=ControlEvent.BUBBLE_START, at=at, seen=at + 0.0005, with_work=with_work
    )


def test_every_bubble_with_work_counts_an_empty_one_at_its_whole_length() -> None:
    spans = [
        wait(0, 1.000, 1.050),  # with work, filled 2 ms in
        prefill(0, 1.002, 1.040),
        wait(0, 2.000, 2.030, input_at=2.020),  # with work, stayed empty: 20 ms (to its input's arrival)
        wait(0, 3.000, 3.010),  # nothing waiting: counted in the total only
        wait(1, 1.000, 1.050),  # no record of its start: counted as with work (unknown is no pass)
        prefill(1, 1.001, 1.010),
        wait(1, 2.000, 2.040),  # nothing waiting, but a staged batch ran: filled
        prefill(1, 2.000, 2.010),
    ]
    seen = [opened(0, 1.000, True), opened(0, 2.000, True), opened(0, 3.000, False), opened(1, 2.000, False)]
    d = bubble_dispatch(spans, seen)
    assert (d.total, d.with_work, d.filled) == (5, 3, 3)
    assert sorted(d.latencies_ms) == pytest.approx([1.0, 2.0, 20.0])
    assert sorted(d.filled_latencies_ms) == pytest.approx([1.0, 2.0])
    # at time scale 4 the empty bubble counts at its device length, 5 ms (what it is at k = 1); the
    # host's latencies as they are (they do not stretch with k)
    d4 = bubble_dispatch(spans, seen, 4.0)
    assert sorted(d4.latencies_ms) == pytest.approx([1.0, 2.0, 5.0])
    assert sorted(d4.real_latencies_ms) == pytest.approx([1.0, 2.0, 20.0])


def test_fill_counts_prefill_inside_the_bubble_only_and_overrun_apart() -> None:
    spans = [
        Span(0, 0, 1, "fwd", 0.900, 1.000),
        wait(0, 1.000, 1.100, input_at=1.080),  # the input came at 80 ms; prefill ran on to 100
        prefill(0, 1.000, 1.100),
        Span(0, 0, 1, "fwd", 1.100, 1.200),
    ]
    u = utilization(spans)
    assert u.fill_ratio == pytest.approx(1.0)  # 80 ms of bubble, all of it filled; the 20 past it not
    assert u.bubble == pytest.approx(0.08 / 0.3)
    assert u.prefill == pytest.approx(0.1 / 0.3)  # the prefill ran all the same (utilization)
    assert overruns_ms(spans) == pytest.approx([20.0])
    half = [*spans[:2], prefill(0, 1.040, 1.100), spans[3]]
    assert utilization(half).fill_ratio == pytest.approx(0.5)  # 40 of the bubble's 80 ms


def test_control_shares_are_of_the_mean_bubble_in_device_time() -> None:
    spans = [wait(0, 1.0, 1.060), wait(0, 2.0, 2.020, input_at=2.020)]  # 40 ms mean, real
    assert mean_bubble_ms(spans) == pytest.approx(40.0)
    # at k = 4 the device's bubble is 10 ms: a 0.5 ms host latency is 5% of it, not 1.25%
    assert control_shares([0.5, 1.0], mean_bubble_ms(spans), 4.0) == pytest.approx([0.05, 0.1])
    assert control_shares([0.5], 0.0, 4.0) == []
    report = ControlSeen(run="r", worker="r0s0", event=ControlEvent.REPORT, at=5.0, seen=5.002)
    assert report_latencies_ms([report, opened(0, 1.0, True)]) == pytest.approx([2.0])


def test_prediction_error_is_the_gap_between_announced_and_real_bubble_length() -> None:
    spans = [
        wait(0, 1.000, 1.050, input_at=1.049),  # 10 ms longer than announced
        wait(0, 2.000, 2.030, input_at=2.030),  # 10 ms shorter
        wait(0, 3.000, 3.020, predicted_ms=20.0, input_at=3.020, it=0),  # warm-up: left out
        Span(0, 0, 1, "fwd", 1.050, 1.060),
    ]
    assert prediction_errors_ms(spans) == pytest.approx([10.0, 10.0])


def test_overrun_is_input_arrival_to_training_resumed_in_filled_bubbles_only() -> None:
    spans = [
        wait(0, 1.000, 1.050, input_at=1.047),  # filled: resumed 3 ms late
        prefill(0, 1.001, 1.050),
        wait(0, 2.000, 2.030, input_at=2.030),  # filled, prefill stopped in time
        prefill(0, 2.001, 2.020),
        wait(1, 1.000, 1.050, input_at=1.040),  # not filled: no overrun counted
    ]
    assert overruns_ms(spans) == pytest.approx([3.0, 0.0])


def test_the_recomputed_share_counts_every_report_and_is_none_before_any() -> None:
    def report(run: int, again: int) -> ControlSeen:
        return ControlSeen(
            run="r", worker="w", event=ControlEvent.REPORT, at=1.0, seen=1.1, layers_run=run, layers_recomputed=again
        )

    start = ControlSeen(run="r", worker="w", event=ControlEvent.BUBBLE_START, at=1.0, seen=1.1, layers_run=99)
    assert recomputed_share([]) is None and recomputed_share([start]) is None
    assert recomputed_share([report(8, 0), report(4, 2), start]) == pytest.approx(2 / 12)
