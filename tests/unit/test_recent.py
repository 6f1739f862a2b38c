"""The recent values a policy predicts from, and their quantile (shared/policies/recent.py)."""

from __future__ import annotations

from shared.policies.recent import Recent


def test_the_quantile_is_a_value_seen_among_the_last_window() -> None:
    r = Recent(window=10, q=0.9)
    assert r.quantile() is None
    for v in range(1, 21):  # 1..20: the last ten are 11..20
        r.add(float(v))
    assert r.quantile() == 20.0  # rank int(0.9 * 10) = 9 of 11..20
    assert Recent(window=10, q=0.5, _seen=r._seen).quantile() == 16.0


def test_values_older_than_the_horizon_are_dropped_when_asked_with_a_time() -> None:
    r = Recent(window=10, q=0.9, horizon_s=10.0)
    r.add(5.0, at=100.0)
    r.add(1.0, at=105.0)
    assert r.quantile(now=109.0) == 5.0
    assert r.quantile(now=112.0) == 1.0  # the first is 12 s old
    assert r.quantile(now=116.0) is None
