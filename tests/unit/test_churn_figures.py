"""bench/churn.py's figures: the fault schedule, useful iterations, kill to training again, SLO."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lib import churn_figures as figs
from shared.figures.percentiles import percentile
from shared.wire import IterationDone


def _done(it: int, replica: int, stage: int, ended: float, generation: int = 1) -> IterationDone:
    return IterationDone(
        run="r", replica=replica, stage=stage, iteration=it, started=ended - 1, ended=ended, generation=generation
    )


def test_the_schedule_is_the_seeds_and_leaves_the_last_tenth_quiet() -> None:
    a = figs.schedule(600, mtbf_s=30, every_s=None, control_mtbf_s=120, seed=4)
    assert a == figs.schedule(600, mtbf_s=30, every_s=None, control_mtbf_s=120, seed=4)  # every arm the same
    assert a != figs.schedule(600, mtbf_s=30, every_s=None, control_mtbf_s=120, seed=5)
    assert all(0 < f.at_s < 540 for f in a) and [f.at_s for f in a] == sorted(f.at_s for f in a)
    workers = [f for f in a if f.kind == "worker"]
    assert 8 <= len(workers) <= 40  # about 18 at one every 30 s
    control = [f.kind for f in a if f.kind != "worker"]
    assert control == list(figs.CONTROL * 10)[: len(control)]  # in turn
    fixed = figs.schedule(100, mtbf_s=30, every_s=20, control_mtbf_s=0, seed=0)
    assert [f.at_s for f in fixed] == [20, 40, 60, 80]


def test_an_iteration_is_useful_once_every_slot_did_it_and_trained_twice_is_counted_apart() -> None:
    done = [_done(0, d, k, 10) for d in range(2) for k in range(2)]
    done += [_done(1, d, k, 12) for d in range(2) for k in range(2)]
    done += [_done(1, 0, 0, 20, generation=2)]  # iteration 1 trained again after a rewind
    done += [_done(2, 0, 0, 14), _done(2, 0, 1, 15)]  # replica 0 stepped it (replica 1's step never came)
    done += [_done(3, 1, 0, 16)]  # no replica stepped it on every stage: not complete
    done += [_done(4, d, k, 99) for d in range(2) for k in range(2)]  # after the window
    got = figs.training(done, stages=2, start=5, end=50)
    assert got["useful_iterations"] == 3 and got["completed_at"] == [10, 12, 15]
    assert got["redone_iterations"] == [1]


def test_kill_to_training_again_is_the_last_join_of_the_next_generation_every_slot_joined(tmp_path: Path) -> None:
    log = tmp_path / "stage_worker-0.log"
    lines = [
        'ts=2026-11-28T10:00:05.000Z level=info svc=stage_worker logger=m msg="joined the run" slot=r0s0 generation=5',
        'ts=2026-11-28T10:00:07.500Z level=info svc=stage_worker logger=m msg="joined the run" slot=r0s1 generation=6',
        'ts=2026-11-28T10:00:06.000Z level=info svc=stage_worker logger=m msg="joined the run" slot=r0s0 generation=6',
        'ts=2026-11-28T10:00:06.100Z level=info svc=stage_worker logger=m msg="training" generation=6',
    ]
    log.write_text("\n".join(lines) + "\n")
    joined = figs.joins([log])
    assert sorted(joined) == [5, 6] and len(joined[6]) == 2
    t0 = joined[5][0]  # 10:00:05
    assert figs.back_after(t0 - 1.0, 5, joined, slots=2) == pytest.approx(3.5)  # 10:00:07.5, one second before it
    assert figs.back_after(t0, 6, joined, slots=2) is None  # no later generation yet
    # generation 5 had one join only: the run trained again in 6
    assert figs.back_after(t0, 4, joined, slots=2) == pytest.approx(2.5)
    assert figs.back_after(t0, 4, joined, slots=1) == 0.0  # one slot: 5 was whole, at the fault itself


def test_slo_attainment_counts_every_request_sent() -> None:
    load = {"ttfts": [0.1, 2.0, 0.0, 0.3], "errors": ["", "", "HTTP 503: recovering", ""], "send_times": [1, 2, 3, 4]}
    load["error_counts"] = {"503": 1}
    got = figs.serving(load, slo_ms=500)
    assert got["requests_sent"] == 4 and got["requests_answered"] == 3 and got["slo_attainment"] == 0.5
    assert figs.windows(got["send_times"], got["good"], start=0.5, end=4.5, width=2) == [(1.0, 0.5), (3.0, 0.5)]


def test_a_fault_that_never_recovered_counts_as_infinite_in_the_percentiles() -> None:
    """Issue 62: dropping it left a run that lost a fault with a calm run's p99."""
    backs = [figs.recovered_in(b) for b in (1.0, 1.2, None, 0.9)]
    assert figs.rounded(percentile(backs, 99)) == "inf"
    assert figs.rounded(figs.median(backs)) == 1.1
    assert figs.rounded(percentile([figs.recovered_in(b) for b in (1.0, 1.2)], 99)) == 1.2
