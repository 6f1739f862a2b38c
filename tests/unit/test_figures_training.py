"""The training figures: one definition of the steady iteration, the slowdown, a speedup and the
lag share, used alike by `bubbletea train`, the demo, the simulator and the benchmarks."""

from __future__ import annotations

import pytest

from bubbletea.launcher.train import TrainResult
from shared.figures.training import lag_share, slowdown_pct, speedup, steady_iteration_s


def test_the_steady_iteration_leaves_out_the_warm_up_when_there_are_more_than_two() -> None:
    assert steady_iteration_s([9.0, 1.0, 3.0, 2.0]) == 2.0  # the median of 1, 3, 2
    assert steady_iteration_s([9.0, 1.0]) == 5.0  # two: both count
    assert steady_iteration_s([4.0]) == 4.0
    with pytest.raises(ValueError):  # statistics.StatisticsError: no iteration, no figure
        steady_iteration_s([])


def test_bubbletea_train_reports_the_same_steady_iteration() -> None:
    times = [0.9, 0.5, 0.7, 0.6]
    assert TrainResult(run="r", iterations=4, iteration_s=times).steady_iteration_s() == steady_iteration_s(times)


def test_slowdown_is_the_on_run_over_the_off_run_in_percent() -> None:
    assert slowdown_pct(1.01, 1.0) == pytest.approx(1.0)
    assert slowdown_pct(0.5, 1.0) == -50.0  # faster: negative
    assert slowdown_pct(2.0, 2.0) == 0.0


def test_speedup_is_before_over_after() -> None:
    assert speedup(3.0, 1.5) == 2.0


def test_lag_share_is_the_lag_over_every_workers_time() -> None:
    # 4 workers over 2 iterations of 1 s and 1.5 s: 10 worker-seconds; 500 ms behind
    assert lag_share(500.0, 4, [1.0, 1.5]) == pytest.approx(0.05)
    assert lag_share(0.0, 4, []) == 0.0  # no time: no share, not a division by zero
