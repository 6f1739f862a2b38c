"""The one percentile rule every figure, bench and report uses, so their p50s and p99s compare.

The rule is linear interpolation between the closest ranks, numpy's default (`method="linear"`,
Hyndman and Fan's type 7): the p-th percentile of n sorted values sits at rank (n - 1) * p / 100,
between the two values around it. It is what the load generator reports (as `vllm bench serve`
does, through numpy), its 50th percentile is `statistics.median`, and it needs no rounding rule.
An infinite value (a fault never recovered from) stays infinite wherever it weighs in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], p: float) -> float | None:
    """The `p`-th percentile (0-100) of `values` by linear interpolation; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * p / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    low, high = ordered[lo], ordered[hi]
    if rank == lo or low == high:  # on a value, or between equal ones (inf - inf is not a number)
        return low
    return low + (high - low) * (rank - lo)
