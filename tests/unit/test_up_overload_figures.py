"""bench/up_overload.py's figures: every request sent counted, the client's TTFT beside the front door's."""

from __future__ import annotations

from bench import up_overload


def test_every_request_counts_and_the_front_doors_own_time_is_set_beside_the_clients() -> None:
    # Four answered (one late for the client, though in time at the front door; one whose server
    # did not say), a 429 at once and a 504 at the objective: the load generator's lists, in seconds.
    result = {
        "errors": ["", "", "", "", "HTTP 429: overloaded", "HTTP 504: too late"],
        "ttfts": [0.5, 0.9, 1.02, 0.3, 0.0, 0.0],
        "server_ttfts": [0.49, 0.88, 0.99, None, None, None],
        "answered_after": [0.5, 0.9, 1.02, 0.3, 0.004, 1.0],
    }
    out = up_overload.figures(result, objective_ms=1000.0, rate=6.0, duration_s=1.0)
    assert (out["sent"], out["answered"], out["refused_429"], out["failed_other"]) == (6, 4, 1, 1)
    assert out["answered_within_objective_share"] == 0.75 and out["answered_late_by_max_ms"] == 20.0
    assert out["failed_other_kinds"] == {"HTTP 504": 1}
    assert out["front_door_within_objective_share"] == 1.0  # the late one was late outside the front door
    assert out["outside_front_door_p50_ms"] == 20.0 and out["outside_front_door_p99_ms"] > 29.0
    assert out["refusal_after_p50_ms"] == 4.0
