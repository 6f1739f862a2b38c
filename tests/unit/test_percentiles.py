"""The one percentile rule (shared/figures/percentiles.py): numpy's linear interpolation, the
median at 50, None for no values, an infinite value kept infinite."""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest

from shared.figures.percentiles import percentile


def test_it_is_numpys_default_rule() -> None:
    rng = random.Random(7)
    for _ in range(200):
        values = [rng.uniform(0, 100) for _ in range(rng.randint(1, 40))]
        for p in (0, 1, 10, 50, 90, 99, 99.9, 100, rng.uniform(0, 100)):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)), rel=1e-12, abs=1e-12)


def test_the_50th_is_the_median_and_the_ends_are_the_extremes() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == statistics.median(values) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)  # between the ranks, not the nearest


def test_no_values_have_no_percentile() -> None:
    assert percentile([], 99) is None
    assert percentile([5.0], 99) == 5.0


def test_an_infinite_value_stays_infinite_where_it_weighs_in() -> None:
    """A fault never recovered from counts as infinite (bench/churn.py): a p99 that reaches it is
    infinite, never NaN, and a median below it is finite."""
    inf = math.inf
    assert percentile([1.0, 2.0, inf], 99) == inf
    assert percentile([1.0, inf, inf], 99) == inf
    assert percentile([1.0, 2.0, inf], 50) == 2.0
