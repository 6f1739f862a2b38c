import random

import pytest

from shared.policies.prefill_cost import PrefillCostModel


def test_learns_a_quadratic_cost_from_reports() -> None:
    truth = lambda t: 0.001 + 2e-5 * t + 1e-8 * t * t  # noqa: E731
    m = PrefillCostModel()
    rng = random.Random(0)
    for _ in range(300):
        t = rng.randint(8, 1024)
        m.observe(t, truth(t) * rng.uniform(0.97, 1.03))
    for t in (16, 256, 1000):
        assert m.predict(t) == pytest.approx(truth(t), rel=0.05)
    assert m.reports == 300


def test_adapts_when_the_device_changes() -> None:
    m = PrefillCostModel()
    for _ in range(100):
        m.observe(100, 0.010)
    for _ in range(200):
        m.observe(100, 0.020)  # the device got slower (e.g. contention)
    assert m.predict(100) == pytest.approx(0.020, rel=0.05)


def test_prior_gives_sane_predictions_and_bad_reports_are_ignored() -> None:
    m = PrefillCostModel()
    assert 0 < m.predict(16) < m.predict(512)
    before = m.predict(100)
    m.observe(0, 1.0)
    m.observe(100, float("nan"))
    m.observe(100, -1.0)
    assert m.predict(100) == before and m.reports == 0
