"""The load a run offers BubbleTea: a stated share of what its bubbles can hold.

The capacity is taken from a run of the same spec without BubbleTea (`bubblestats.capacity_tokens_per_s`:
its bubble seconds per second over every worker, over what a prompt costs). A prompt's cost is
the spec's prefill profile on the run's clock, or, without a profile, its real compute measured
here (`prefill_block_s`). `bubbletea demo` and `bench/bubble_fill.py` both offer 80% of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.config.spec import ClusterSpec
from shared.figures.bubblestats import capacity_tokens_per_s
from shared.policies.spans import Span

#: The share of the bubbles' capacity a run offers by default: below saturation, as a service
#: would run, so the objective holds for (nearly) every request.
DEFAULT_SHARE = 0.8


def prefill_block_s(spec: ClusterSpec, time_scale: float, tokens: int) -> Callable[[int], float]:
    """Real seconds one prefill block (one layer of one prompt) of T tokens takes in a run at
    `time_scale`: the unscaled `spec`'s profile times k; without a profile, the served model's real
    compute for a `tokens`-token prompt measured here, on the device the workers use (linear in T)."""
    dev = spec.device
    if dev.prefill_ms_per_layer is not None or dev.prefill_us_per_token is not None:
        fixed, per_token = (dev.prefill_ms_per_layer or 0.0) / 1000, (dev.prefill_us_per_token or 0.0) / 1e6
        return lambda t: (fixed + per_token * t) * time_scale
    from shared.model.devices import select_device, synchronize
    from shared.model.prefill import PrefillModel

    device = select_device(spec.device.kind, 0)  # where the first worker's prefill runs
    model = PrefillModel.from_spec(spec.prefill)
    model.module.to(device)
    prompt = [i % 200 + 1 for i in range(tokens)]
    model.prefill(prompt)  # warm-up
    synchronize(device)
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        model.prefill(prompt)
    synchronize(device)
    per_block = (time.perf_counter() - t0) / reps / model.layers
    return lambda t: per_block * t / tokens


@dataclass(frozen=True)
class Offer:
    capacity_tokens_per_s: float  # what the bubbles hold, prompt tokens per real second
    rate_per_s: float  # requests per real second at the share

    def line(self, share: float, time_scale: float) -> str:
        return (
            f"offering {share:.0%} of the bubbles' capacity ({self.capacity_tokens_per_s * time_scale:,.0f} prompt "
            f"tokens per device second): {self.rate_per_s * time_scale:.1f} requests per device second "
            f"({self.rate_per_s:.2f} per real second at time scale {time_scale:g})"
        )


def offer(
    spans_off: list[Span], block_s: Callable[[int], float], layers: int, tokens: int, share: float = DEFAULT_SHARE
) -> Offer:
    """The request rate that offers `share` of the capacity the off run's bubbles measured, for
    prompts of `tokens` tokens on average: their whole bubble time. Not what the fit rule can fill
    of it (as the simulator counts it): on a live host a block's time is measured under load, and
    a loaded suite measured blocks longer than every bubble, offered nothing and answered nothing
    (2026-12-06)."""
    capacity = capacity_tokens_per_s(spans_off, block_s, layers, tokens)
    return Offer(capacity, share * capacity / tokens)
