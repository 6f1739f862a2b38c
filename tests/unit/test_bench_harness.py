"""The bench harness's summary: every request sent counts against the objective, every bubble with
work counts, each figure on its stated clock, and claims are never met by a run that is not valid."""

from __future__ import annotations

from typing import Any

import pytest

from bench import _harness
from shared.figures.bubblestats import capacity_requests_per_s, capacity_tokens_per_s
from shared.policies.spans import Span
from shared.wire import ControlSeen
from shared.wire.status import ControlEvent

K = 4.0  # the time scale: one device ms = 4 real ms


def timeline(prefill: bool) -> list[Span]:
    """Two workers, iterations 0-2 of 1 real second: 0.4 s of training, then a 0.4 s bubble whose
    input arrives at 0.4 s into it (then 0.2 s of training); with `prefill`, worker 0 fills the
    first 0.3 s of it (5 ms after it opens) and worker 1 stays empty."""
    out = []
    for it in range(3):
        for w in range(2):
            t = float(it)
            out.append(Span(w, 0, it, "fwd", t, t + 0.4))
            out.append(Span(w, 0, it, "wait", t + 0.4, t + 0.8, None, 400.0, t + 0.8))
            out.append(Span(w, 0, it, "bwd", t + 0.8, t + 1.0))
            if prefill and w == 0:
                out.append(Span(w, 0, it, "prefill", t + 0.405, t + 0.705))
    return out


def seen(spans: list[Span]) -> list[ControlSeen]:
    starts = [
        ControlSeen(
            run="r", worker=s.worker, event=ControlEvent.BUBBLE_START, at=s.start, seen=s.start + 0.002, with_work=True
        )
        for s in spans
        if s.kind == "wait"
    ]
    return [*starts, ControlSeen(run="r", worker="r0s0", event=ControlEvent.REPORT, at=1.0, seen=1.004)]


def pair(**kw: Any) -> _harness.Pair:
    on = timeline(prefill=True)
    args: dict[str, Any] = {
        "iteration_s_off": 1.0,
        "iteration_s_on": 1.005,
        "spans_off": timeline(prefill=False),
        "spans_on": on,
        "seen": seen(on),
        # 10 sent: 7 answered (TTFTs real ms; the objective 1000 device ms = 4000 real ms), a 429, a 504, a 503
        "load": {
            "completed": 7,
            "failed": 3,
            "ttfts_ms": [400.0, 800.0, 1200.0, 2000.0, 3000.0, 3900.0, 4100.0],
            "error_counts": {"429": 1, "504": 1, "503": 1},
        },
        "prefill_lag_ms": 0.0,
        "losses_equal": True,
        "capacity_tokens_per_s": 1000.0,
        "offered_rps": 5.0,
    }
    return _harness.Pair(**(args | kw))


def test_every_request_sent_counts_against_the_objective() -> None:
    s = _harness.summarise([pair()], time_scale=K, slo_device_ms=1000.0)
    assert s["requests_sent"] == 10 and s["requests_answered"] == 7
    assert s["slo_attainment"] == pytest.approx(0.6)  # 6 within 1000 device ms, of 10 sent
    assert s["ttft_p50_device_ms"] == pytest.approx(2000.0 / K)  # device ms: real over k
    assert s["errors"] == {"429": 1, "504": 1, "503": 1} and s["requests_lost"] == 0


def test_every_bubble_with_work_counts_and_the_fill_is_inside_the_bubble() -> None:
    s = _harness.summarise([pair()], time_scale=K, slo_device_ms=1000.0)
    assert (s["bubbles_total"], s["bubbles_with_work"], s["bubbles_filled"]) == (6, 6, 3)
    # three filled 5 ms in, three empty at their whole 400 real ms: 100 device ms at k = 4
    assert s["dispatch_p99_ms"] == pytest.approx(100.0, rel=0.01)
    assert s["dispatch_p99_real_ms"] == pytest.approx(400.0, rel=0.01)
    assert s["bubble_fill_ratio"] == pytest.approx(0.75 / 2, rel=1e-3)  # 0.3 of 0.4 s on one worker of two
    # 5 ms of host latency against a 100 device-ms mean bubble (400 real ms / 4): 5%
    assert s["control_share_p50"] == pytest.approx(0.05, rel=1e-6)
    assert s["train_slowdown_pct"] == pytest.approx(0.5) and s["time_scale_k"] == K
    assert s["iter_device_ms_off"] == pytest.approx(250.0)


def test_a_run_that_is_not_valid_meets_no_claim() -> None:
    goals = {"slowdown < 1%": lambda s: s["train_slowdown_pct"] < 1}
    good = _harness.summarise([pair()], time_scale=K, slo_device_ms=1000.0)
    assert good["valid"] and _harness.targets(good, goals)["targets_met"]
    bad = _harness.summarise([pair(losses_equal=False)], time_scale=K, slo_device_ms=1000.0)
    assert not bad["valid"] and "losses differ" in bad["why"]
    verdict = _harness.targets(bad, goals)
    assert verdict["targets"] == {"slowdown < 1%": True} and not verdict["targets_met"]
    lagging = _harness.summarise([pair(prefill_lag_ms=200.0)], time_scale=K, slo_device_ms=1000.0)
    assert not lagging["valid"] and "behind its profile" in lagging["why"]  # 200 ms of 900 ms of prefill


def test_capacity_is_the_off_runs_bubble_time_over_a_prompts_cost() -> None:
    # steady window: iterations 1-2, two workers each 40% in bubbles = 0.8 bubble-seconds per second;
    # a 96-token prompt costs 4 blocks of 2 ms: 96 / 0.008 tokens per bubble-second
    got = capacity_tokens_per_s(timeline(prefill=False), lambda tokens: 0.002, 4, 96)
    assert got == pytest.approx(0.8 * 96 / 0.008)
    # in requests: the simulator's default load and what an offer is a share of
    assert capacity_requests_per_s(timeline(prefill=False), lambda tokens: 0.002, 4, 96) == pytest.approx(0.8 / 0.008)
    assert capacity_requests_per_s(timeline(prefill=False), lambda tokens: 0.0, 4, 96) == 0.0  # free: no figure


def test_capacity_counts_each_bubble_for_what_the_fit_rule_can_fill_of_it() -> None:
    """Issue 63: with blocks of 0.15 s (0.225 s with the margin), a 0.4 s bubble takes blocks at 0
    and 0.15 s (at 0.3 s only 0.1 s is left): 0.3 s of it, so 0.6 bubble-seconds per second, not
    0.8; blocks of 2 ms fill it to within a block."""
    block = lambda tokens: 0.15  # noqa: E731
    got = capacity_requests_per_s(timeline(prefill=False), block, 4, 96, fit_block_s=0.15)
    assert got == pytest.approx(0.6 / 0.6)
    small = capacity_requests_per_s(timeline(prefill=False), lambda tokens: 0.002, 4, 96, fit_block_s=0.002)
    assert 0.8 / 0.008 * 0.99 < small < 0.8 / 0.008


def test_the_training_cost_is_the_steady_mean_a_median_cannot_see_a_slowed_minority() -> None:
    """Issue 62: 2 iterations in 10 slowed by half leave the median unmoved; the steady mean (wall time
    over iterations, the first left out: the targets') and the p90 ratio show them."""
    off = [2.0] + [1.0] * 10  # a slow first (warm-up), then 1 s each
    on = [2.0] + [1.0] * 8 + [1.5, 1.5]
    s = _harness.summarise(
        [pair(iteration_s_off=1.0, iteration_s_on=1.0, iterations_off=off, iterations_on=on)],
        time_scale=K,
        slo_device_ms=1000.0,
    )
    assert s["train_slowdown_pct"] == 0.0  # the medians: both 1 s
    assert s["train_slowdown_mean_pct"] == pytest.approx(10.0)  # 11 s over 10 against 10 s over 10
    assert s["train_p90_on_over_off"] == pytest.approx(1.5)
    assert _harness.summarise([pair()], time_scale=K, slo_device_ms=1000.0)["train_slowdown_mean_pct"] is None
