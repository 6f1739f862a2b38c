"""The figures of a load's requests: TTFT percentiles on the device clock, the share of requests
sent that met the TTFT objective, and the requests lost.

The demo's table, the simulator and the benchmarks take them from here. TTFTs are real ms as
the load generator measured them; a run at device time scale k is on the device clock at real / k.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from shared.figures.percentiles import percentile


def ttft_ms(ttfts_ms: list[float], p: float, time_scale: float = 1.0) -> float | None:
    """The p-th percentile (0-100) of the TTFTs in device ms (real ms / `time_scale`); None for no
    request answered."""
    value = percentile(ttfts_ms, p)
    return None if value is None else value / time_scale


def slo_attainment(ttfts_ms: Iterable[float], sent: int, time_scale: float, slo_device_ms: float) -> float | None:
    """The share of the requests *sent* answered within the TTFT objective (device ms): a refusal
    (429), an expiry (504) or any other failure is a miss. None when none was sent."""
    met = sum(1 for t in ttfts_ms if t / time_scale <= slo_device_ms)
    return met / sent if sent else None


def requests_lost(error_counts: Mapping[str, int]) -> int:
    """Requests accepted but neither answered nor failed with an HTTP status (an explicit answer):
    the client lost its connection or gave up waiting. `error_counts` is the load generator's, by
    HTTP status or error name."""
    return sum(n for code, n in error_counts.items() if not code.isdigit())
