"""The bench harness: interleaved off/on pairs of one case, and their summary (pure, unit-tested).

A case runs as off, on, off, on, ... (`interleave`), so slow drift of a shared machine hits both
sides. `summarise` turns the pairs into one JSON object whose every figure names its clock and unit
in its key:

* ``_device_ms``: device time, real ms over the time scale k (what the profiled device would take);
* ``_ms`` alone: host time, real ms (the bus, the event loops: never stretched);
* ``_pct``, ``_ratio``, ``share``, ``attainment``: ratios, the same on either clock;
* counts are plain.

Validity checks (is the emulation honest, did the run measure what it claims) are reported apart
from the claims (`valid`, `why`): the prefill compute kept up with its profile, training computed
the same losses with BubbleTea on and off, every bubble the figures count had its dispatcher
record. A claim of a run that is not valid is never called met (`targets_met`).

A script in bench/ imports this as ``import _harness``; tests as ``from bench import _harness``.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shared.figures.bubblestats import (
    bubble_dispatch,
    control_shares,
    mean_bubble_ms,
    overruns_ms,
    prediction_errors_ms,
    recomputed_share,
    report_latencies_ms,
)
from shared.figures.requests import requests_lost, slo_attainment, ttft_ms
from shared.figures.runstats import percentile, prefill_lag_share, utilization
from shared.figures.training import slowdown_pct, steady_mean_s, steady_quantile_s
from shared.policies.spans import Span
from shared.wire import ControlSeen

T = TypeVar("T")

#: Prefill compute may run at most this far behind its profile (lag over prefill time) for the
#: emulation to be honest: the device it stands for would not have been late.
MAX_PREFILL_LAG_PCT = 5.0


async def interleave(
    pairs: int, off: Callable[[int], Awaitable[T]], on: Callable[[int, T], Awaitable[Any]]
) -> list[Any]:
    """`pairs` times: the case off, then on (given what the off run measured); the on results."""
    out = []
    for i in range(pairs):
        out.append(await on(i, await off(i)))
    return out


@dataclass
class Pair:
    """One off/on pair of a BubbleTea case, as measured."""

    iteration_s_off: float  # steady iteration (the median), real s
    iteration_s_on: float
    spans_off: list[Span]
    spans_on: list[Span]
    seen: list[ControlSeen]  # the dispatcher's records of the on run
    load: dict[str, Any]  # the load generator's summary: completed, failed, ttfts_ms, error_counts
    prefill_lag_ms: float  # real prefill compute behind its profile, real ms
    losses_equal: bool  # the same training losses on and off
    capacity_tokens_per_s: float  # what the off run's bubbles could hold, prompt tokens per real s
    offered_rps: float  # the on run's request rate, per real s
    cpu: dict[str, float] = field(default_factory=dict)
    #: every iteration's time, real s (the steady mean and the p90, `shared.figures.training`)
    iterations_off: list[float] = field(default_factory=list)
    iterations_on: list[float] = field(default_factory=list)


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def summarise(pairs: list[Pair], *, time_scale: float, slo_device_ms: float) -> dict[str, Any]:
    """The figures of one case over its pairs: medians of per-pair ratios, percentiles over every
    bubble and every request of all pairs."""
    k = time_scale
    u_off = [utilization(p.spans_off) for p in pairs]
    u_on = [utilization(p.spans_on) for p in pairs]
    slowdowns = [slowdown_pct(p.iteration_s_on, p.iteration_s_off) for p in pairs]  # of the medians
    timed = [p for p in pairs if p.iterations_on and p.iterations_off]
    mean_slowdowns = [slowdown_pct(steady_mean_s(p.iterations_on), steady_mean_s(p.iterations_off)) for p in timed]
    p90_ratios = [steady_quantile_s(p.iterations_on, 0.9) / steady_quantile_s(p.iterations_off, 0.9) for p in timed]
    dispatch = [bubble_dispatch(p.spans_on, p.seen, k) for p in pairs]
    latencies = [x for d in dispatch for x in d.latencies_ms]
    real = [x for d in dispatch for x in d.real_latencies_ms]
    shares_start = [
        x
        for p, d in zip(pairs, dispatch, strict=True)
        for x in control_shares(d.filled_latencies_ms, mean_bubble_ms(p.spans_on), k)
    ]
    shares_report = [
        x for p in pairs for x in control_shares(report_latencies_ms(p.seen), mean_bubble_ms(p.spans_on), k)
    ]
    ttft = [x for p in pairs for x in p.load["ttfts_ms"]]
    sent = sum(p.load["completed"] + p.load["failed"] for p in pairs)
    errors: dict[str, int] = {}
    for p in pairs:
        for code, n in p.load["error_counts"].items():
            errors[code] = errors.get(code, 0) + n
    lag_pct = _med([100 * prefill_lag_share(p.prefill_lag_ms, p.spans_on) for p in pairs]) or 0.0
    unrecorded = sum(1 for p in pairs if not p.seen)
    problems = []
    if lag_pct > MAX_PREFILL_LAG_PCT:
        problems.append(f"prefill ran {lag_pct:.1f}% behind its profile (at most {MAX_PREFILL_LAG_PCT:g}%)")
    if not all(p.losses_equal for p in pairs):
        problems.append("training losses differ with BubbleTea on")
    if unrecorded:
        problems.append(f"{unrecorded} run(s) without the dispatcher's records: bubbles with work unknown")
    share_p99 = [percentile(shares_start, 99), percentile(shares_report, 99)]
    return {
        "pairs": len(pairs),
        "time_scale_k": k,
        "offered_load_rps": _r(_med([p.offered_rps for p in pairs])),
        "capacity_tokens_per_device_s": _r(_med([p.capacity_tokens_per_s * k for p in pairs]), 1),
        "iter_device_ms_off": _r(_med([p.iteration_s_off * 1000 / k for p in pairs]), 2),
        "iter_device_ms_on": _r(_med([p.iteration_s_on * 1000 / k for p in pairs]), 2),
        # the training cost: the steady mean (wall time over iterations; what the targets use), its
        # p90 ratio, and the median's (a median cannot see a slowed minority of iterations)
        "train_slowdown_mean_pct": _r(_med(mean_slowdowns), 2),
        "train_slowdown_mean_pct_pairs": [round(x, 2) for x in mean_slowdowns],
        "train_p90_on_over_off": _r(_med(p90_ratios), 4),
        "train_slowdown_pct": _r(_med(slowdowns), 2),
        "train_slowdown_pct_pairs": [round(x, 2) for x in slowdowns],
        "bubble_fraction_off": _r(_med([u.bubble for u in u_off])),
        "utilization_off": _r(_med([u.busy for u in u_off])),
        "utilization_on": _r(_med([u.busy for u in u_on])),
        "bubble_fill_ratio": _r(_med([u.fill_ratio for u in u_on])),
        "overrun_device_ms_total": _r(_med([sum(overruns_ms(p.spans_on)) / k for p in pairs]), 1),
        "bubbles_total": sum(d.total for d in dispatch),
        "bubbles_with_work": sum(d.with_work for d in dispatch),
        "bubbles_filled": sum(d.filled for d in dispatch),
        "dispatch_p50_ms": _r(percentile(latencies, 50)),
        "dispatch_p99_ms": _r(percentile(latencies, 99)),
        "dispatch_p99_real_ms": _r(percentile(real, 99)),  # an empty bubble at its real length (k times its own)
        "control_share_p50": _r(
            max(
                (x for x in (percentile(shares_start, 50), percentile(shares_report, 50)) if x is not None),
                default=None,
            ),
            4,
        ),
        "control_share_p99": _r(max((x for x in share_p99 if x is not None), default=None), 4),
        # the control share's two parts, and what they are shares of
        "start_share_p99": _r(share_p99[0], 4),
        "report_share_p99": _r(share_p99[1], 4),
        "report_p50_ms": _r(percentile([x for p in pairs for x in report_latencies_ms(p.seen)], 50)),
        "report_p99_ms": _r(percentile([x for p in pairs for x in report_latencies_ms(p.seen)], 99)),
        "recomputed_share": _r(recomputed_share([c for p in pairs for c in p.seen]), 4),
        "mean_bubble_device_ms": _r(_med([mean_bubble_ms(p.spans_on) / k for p in pairs]), 2),
        "prediction_error_p50_device_ms": _r(
            _div(percentile([x for p in pairs for x in prediction_errors_ms(p.spans_on)], 50), k)
        ),
        "requests_sent": sent,
        "requests_answered": sum(p.load["completed"] for p in pairs),
        "slo_device_ms": slo_device_ms,
        "slo_attainment": _r(slo_attainment(ttft, sent, k, slo_device_ms), 4),
        "ttft_p50_device_ms": _r(ttft_ms(ttft, 50, k), 1),
        "ttft_p99_device_ms": _r(ttft_ms(ttft, 99, k), 1),
        "errors": errors,
        "requests_lost": requests_lost(errors),
        "prefill_lag_pct": _r(lag_pct, 2),
        "losses_equal": all(p.losses_equal for p in pairs),
        "valid": not problems,
        "why": "; ".join(problems) or "prefill kept its profile, training unchanged, every bubble recorded",
    }


def _div(v: float | None, k: float) -> float | None:
    return None if v is None else v / k


def targets(summary: dict[str, Any], goals: dict[str, Callable[[dict[str, Any]], bool]]) -> dict[str, Any]:
    """Each goal's verdict on `summary`, and `targets_met`: every one met *and* the run valid."""
    met = {name: bool(check(summary)) for name, check in goals.items()}
    return {"targets": met, "targets_met": summary["valid"] and all(met.values())}
