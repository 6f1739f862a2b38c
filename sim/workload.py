"""Request arrivals for the simulator, from the load generator's own processes (no copy of them).

* `generated`: `loadgen.arrivals.arrival_offsets` (gamma intervals: Poisson at burstiness 1, as
  `vllm bench serve`) with prompt lengths uniform in `loadgen.datasets.length_range`, as the
  load generator's random dataset draws them.
* `replayed`: an Azure LLM inference trace (`loadgen.datasets.read_trace` / `plan_trace`):
  its arrival times (divided by a time scale) and its prompt lengths, clamped to what the front
  door accepts (`SimSetup.max_prompt_tokens`: `prefill.max_prompt_tokens`, capped by the served
  model's length).

Each yields `(arrival time in seconds from the start, prompt tokens)`, lazily and in time order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loadgen.arrivals import arrival_offsets, validate
from loadgen.datasets import TraceError, length_range, plan_trace, read_trace
from sim.setup import SimError

Arrivals = Iterator[tuple[float, int]]


def generated(
    rate: float, *, input_len: int, range_ratio: float, max_tokens: int, burstiness: float = 1.0, seed: int = 0
) -> Arrivals:
    """Checked now (a bad option fails before anything runs); drawn lazily."""
    try:
        validate(rate, burstiness)
        lo, hi = length_range(input_len, range_ratio)
    except ValueError as exc:
        raise SimError(f"the load cannot be generated: {exc}") from None
    if math.isinf(rate):
        raise SimError("--request-rate must be finite in a simulation (inf would send every request at 0)")
    hi = min(hi, max_tokens)
    return _draw(rate, burstiness, min(lo, hi), hi, seed)


#: Prompt lengths are drawn this many at a time: the same numbers as one at a time (a test pins
#: it), without numpy's cost per call on each of an 8,192-GPU simulation's ~6,000 requests a second.
_LENGTHS_AT_ONCE = 1024


def _draw(rate: float, burstiness: float, lo: int, hi: int, seed: int) -> Arrivals:
    times, lengths = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    yield from zip(arrival_offsets(rate, burstiness, times), _lengths(lengths, lo, hi), strict=False)  # both endless


def _lengths(rng: np.random.Generator, lo: int, hi: int) -> Iterator[int]:
    """Prompt lengths uniform in [lo, hi], endlessly."""
    while True:
        yield from rng.integers(lo, hi + 1, size=_LENGTHS_AT_ONCE).tolist()


def replayed(path: str | Path, *, max_tokens: int, time_scale: float = 1.0) -> Arrivals:
    try:
        plan = plan_trace(read_trace(path), time_scale=time_scale, max_input_len=max_tokens)
    except TraceError as exc:
        raise SimError(f"the trace cannot be replayed: {exc}") from None
    except ValueError as exc:
        raise SimError(f"the trace cannot be replayed: {exc}") from None
    return iter(zip(plan.offsets_s, plan.lengths, strict=True))
