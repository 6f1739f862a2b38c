"""bench/faults.py's dispatcher-kill figures and verdict, and the arms it refuses on a Redis Cluster."""

from __future__ import annotations

from typing import Any

from bench.lib import fault_arms
from bench.lib import fault_figures as ff


def _arm(records: list[dict[str, Any]], **over: Any) -> dict[str, Any]:
    res: dict[str, Any] = {"arm": "dispatcher-kill", "expect": "kept", "records": records, "kept": len(records)}
    res |= {"requests_lost": 0, "answered_twice": 0, "scheduled_twice": 0, "iterations_trained_twice": 0}
    res |= ff.kill_figures(records)
    return res | over


def test_every_kill_counts_and_one_never_taken_over_is_infinite() -> None:
    records: list[dict[str, Any]] = [
        {"takeover_s": 0.4, "serving_s": 0.9, "by_standby": True},
        {"takeover_s": 2.6, "serving_s": 3.1, "by_standby": True},
        {"takeover_s": None, "serving_s": None, "by_standby": False},
    ]
    out = ff.kill_figures(records)
    assert out["taken_over"] == 2 and out["by_standby"] == 2
    assert out["takeover_s"] == [0.4, 2.6, "inf"] and out["serving_s"] == [0.9, 3.1, "inf"]
    # one percentile rule: the median of three is the middle one; the never-served kill is the max
    assert out["serving_p50_s"] == 3.1 and out["serving_max_s"] == "inf" and out["takeover_p99_s"] == "inf"


def test_the_kill_arm_is_met_only_if_every_kill_was_served_within_two_seconds_and_nothing_twice() -> None:
    quick: list[dict[str, Any]] = [{"takeover_s": 0.5, "serving_s": 1.2, "by_standby": True, "kept": True}] * 3
    assert ff.verdict(_arm(quick), 3) == {"met": True, "why": []}

    slow = [*quick[:2], {"takeover_s": 1.9, "serving_s": 2.0, "by_standby": True, "kept": True}]
    assert ff.verdict(_arm(slow), 3)["why"] == ["1 of 3 kills not served by a new leader within 2 s"]

    never = [*quick[:2], {"takeover_s": None, "serving_s": None, "kept": True}]
    assert not ff.verdict(_arm(never), 3)["met"]

    # one request in two batches is a defect here: the new leader adopts what the killed one sent
    twice = ff.verdict(_arm(quick, scheduled_twice=1, requests_lost=2), 3)
    assert twice["why"] == ["2 requests lost", "1 requests scheduled twice"]


def test_the_arms_that_restart_redis_or_reach_it_from_a_namespace_are_refused_on_a_cluster() -> None:
    assert fault_arms.refused_on_cluster(["calm", "dispatcher-kill", "dispatcher-stall", "stall-1s"]) is None
    refused = fault_arms.refused_on_cluster(["calm", "lost-host", "redis-then-kill"])
    assert refused is not None and "\n" not in refused
    assert refused.startswith("the lost-host arm ") and "; the redis-then-kill arm restarts" in refused
