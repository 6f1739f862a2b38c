"""The training figures: the steady iteration time, one run against another (the training slowdown
with BubbleTea on, a speedup), and how far training compute ran behind its device profile.

`bubbletea train` and the demo (`TrainResult`), the simulator (`sim.run.RunResult`) and the
benchmarks take them from here. Iteration times are in seconds (or ms: the ratios do not care),
both sides of a comparison on one clock.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from shared.figures.percentiles import percentile


def steady_iteration_s(iteration_s: Sequence[float]) -> float:
    """The steady iteration time: the median of the iterations, leaving out the first (warm-up)
    when there are more than two."""
    times = iteration_s[1:] if len(iteration_s) > 2 else iteration_s
    return statistics.median(times)


def steady_mean_s(iteration_s: Sequence[float]) -> float:
    """The steady mean iteration time: the wall time of the iterations over their number, leaving
    out the first (warm-up) when there are more than two. What the training-cost targets use
    (issue 62): a median, the other figure, cannot be moved by the minority of iterations that
    BubbleTea slows, however much it slows them."""
    times = iteration_s[1:] if len(iteration_s) > 2 else iteration_s
    return sum(times) / len(times)


def steady_quantile_s(iteration_s: Sequence[float], q: float) -> float:
    """The `q` quantile of the steady iterations (`percentiles.percentile`'s rule; the first left
    out, as above)."""
    times = iteration_s[1:] if len(iteration_s) > 2 else iteration_s
    value = percentile(times, q * 100)
    assert value is not None, "no iteration"
    return value


def slowdown_pct(iteration_on: float, iteration_off: float) -> float:
    """The training slowdown, in percent: how much longer a steady iteration took with BubbleTea on
    than with it off (negative: it was faster)."""
    return (iteration_on / iteration_off - 1) * 100


def speedup(iteration_before: float, iteration_after: float) -> float:
    """How many times faster an iteration became: `iteration_before` / `iteration_after`."""
    return iteration_before / iteration_after


def lag_share(lag_ms: float, workers: int, iteration_s: Sequence[float]) -> float:
    """The share of the workers' time that training compute ran behind its device profile: the
    run's lag (ms, summed over workers) over `workers` x the run's iterations."""
    return lag_ms / 1000 / max(1e-9, workers * sum(iteration_s))
