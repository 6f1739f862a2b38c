"""When requests are sent: inter-arrival times drawn from a gamma distribution (pure).

The model is the one `vllm bench serve` uses, so results compare: intervals are
Gamma(shape=burstiness, scale=1/(rate*burstiness)). The mean interval is always 1/rate, whatever
the burstiness; only the spread changes. The coefficient of variation (std/mean) of a gamma with
shape k is 1/sqrt(k), so:

* burstiness 1 is a Poisson process (exponential intervals, CV 1),
* burstiness < 1 is burstier (clumps of requests separated by long gaps, CV > 1),
* burstiness > 1 is smoother, tending to a fixed interval as it grows (CV -> 0).

An infinite rate means "send everything at once": every interval is zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

#: Intervals are drawn this many at a time: one numpy call per block instead of one per request,
#: while the stream stays lazy (a --duration run does not know how many it will need).
BLOCK = 1024


def validate(rate: float, burstiness: float) -> None:
    """Refuse parameters that have no meaningful arrival process (a zero rate never sends)."""
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"the request rate must be > 0 (or inf), got {rate}")
    if not math.isfinite(burstiness) or burstiness <= 0:
        raise ValueError(f"the burstiness must be a finite number > 0, got {burstiness}")


def interval_array(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """`n` inter-arrival times in seconds (float64)."""
    validate(rate, burstiness)
    if math.isinf(rate):
        return np.zeros(n)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def intervals(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """An endless stream of inter-arrival times in seconds."""
    validate(rate, burstiness)
    while True:
        yield from interval_array(BLOCK, rate, burstiness, rng).tolist()


def arrival_offsets(rate: float, burstiness: float, rng: np.random.Generator) -> Iterator[float]:
    """An endless stream of send times in seconds after the start: the first request goes at 0,
    each next one an interval after the previous (as vLLM does: it sleeps after each send)."""
    t = 0.0
    gaps = intervals(rate, burstiness, rng)
    while True:
        yield t
        t += next(gaps)
