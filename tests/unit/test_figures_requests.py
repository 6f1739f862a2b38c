"""The request figures: TTFT percentiles on the device clock, SLO attainment over every request
sent (a failure is a miss), and the requests lost (neither answered nor failed with a status)."""

from __future__ import annotations

import pytest

from shared.figures.requests import requests_lost, slo_attainment, ttft_ms


def test_ttft_percentiles_are_on_the_device_clock() -> None:
    real = [400.0, 800.0, 1200.0, 1600.0, 2000.0]  # real ms at time scale 4
    assert ttft_ms(real, 50, 4.0) == 300.0
    assert ttft_ms(real, 100, 4.0) == 500.0
    assert ttft_ms(real, 99) == pytest.approx(1984.0)  # linear between the two largest, real ms
    assert ttft_ms([], 50, 4.0) is None  # nothing answered


def test_slo_attainment_counts_every_request_sent() -> None:
    real = [400.0, 800.0, 1200.0, 4400.0]  # at k = 4: 100, 200, 300 and 1100 device ms
    assert slo_attainment(real, 4, 4.0, 1000.0) == 0.75
    assert slo_attainment(real, 8, 4.0, 1000.0) == 0.375  # four more sent and failed: misses
    assert slo_attainment(real, 4, 4.0, 300.0) == 0.75  # within means at most
    assert slo_attainment([], 0, 1.0, 1000.0) is None  # nothing sent


def test_requests_lost_are_failures_without_an_http_status() -> None:
    assert requests_lost({"429": 3, "504": 1, "ClientConnectionError": 2, "TimeoutError": 1}) == 3
    assert requests_lost({}) == 0
