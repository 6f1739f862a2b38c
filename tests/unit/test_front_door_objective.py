"""The objective a front door gives the bubbles: the client's, counted from when the front door
received the request, less the front door's own hops (`FrontDoorHops`)."""

from __future__ import annotations

import time

import pytest
from aiohttp import web

from services.prefill_queue.answers import hops_seen
from services.prefill_queue.api import new_request
from services.prefill_queue.metrics import Metrics
from services.prefill_queue.state import DECODER_LOAD, HOPS, INSTANCE, METRICS, SETTINGS
from services.prefill_queue.validation import ParsedRequest
from shared.config.settings import load_settings
from shared.policies.prompt_placement import DecoderLoad, FrontDoorHops

PARSED = ParsedRequest("m", (1, 2, 3), 0.0, None, 0, "", timeout_s=60.0, objective_s=0.5)


def app_with_hops(*seconds: float) -> web.Application:
    app = web.Application()
    app[INSTANCE] = "fd-test"
    app[SETTINGS] = load_settings(None, env={"BUBBLETEA_RUN": "objective"})  # its run names the results stream
    app[METRICS] = Metrics()
    app[HOPS] = FrontDoorHops()
    for s in seconds:
        hops_seen(app, s)
    return app


def test_the_objective_counts_from_receipt_less_the_front_doors_hops() -> None:
    t0 = time.perf_counter()
    received = t0 - 0.1  # parsed and placed for 100 ms before it is queued
    req = new_request(app_with_hops(0.02), PARSED, "r1", may_move=False, received=received)
    late = time.perf_counter() - t0  # the scheduler's delay too counts from receipt (a loaded machine)
    assert req.objective is not None and req.deadline is not None
    # 0.5 s from 0.1 s ago, less the 20 ms kept for the hops: due 0.38 s after it was queued, less
    # whatever passed between receipt and queueing beyond those 100 ms (at most `late`)
    assert 0.38 - late - 0.002 <= req.objective - req.submitted <= 0.38 + 0.002
    assert req.deadline - req.submitted == pytest.approx(60.0, abs=0.01)  # the deadline: from now, as before


def test_the_hops_seen_and_kept_are_in_the_metrics() -> None:
    """`bubbletea:front_door_hops_seconds` (each answer's hops) and `..._kept_seconds` (what the
    last objective kept for them): what an operator reads to see where an objective goes."""
    app = app_with_hops(0.004, 0.008, 0.03)
    new_request(app, PARSED, "r0", may_move=False)
    reg = app[METRICS].registry
    assert reg.get_sample_value("bubbletea:front_door_hops_seconds_count") == 3
    assert reg.get_sample_value("bubbletea:front_door_hops_seconds_sum") == pytest.approx(0.042)
    assert reg.get_sample_value("bubbletea:front_door_hops_kept_seconds") == app[HOPS].kept_s(0.5) == 0.03


def test_no_hops_seen_yet_and_no_objective_keep_the_objective_as_given() -> None:
    req = new_request(app_with_hops(), PARSED, "r2", may_move=False)
    assert req.objective is not None and req.objective - req.submitted == pytest.approx(0.5, abs=0.005)
    none = ParsedRequest("m", (1,), 0.0, None, 0, "", timeout_s=60.0)
    assert new_request(app_with_hops(0.02), none, "r3", may_move=False).objective is None


def test_a_prompt_that_may_move_carries_what_the_decoder_took_lately() -> None:
    app = app_with_hops()
    assert new_request(app, PARSED, "r4", may_move=True).decoder_s == 0.0  # no decoder here
    app[DECODER_LOAD] = load = DecoderLoad()
    assert new_request(app, PARSED, "r5", may_move=True).decoder_s == 0.0  # none measured yet
    for seconds in (0.1, 0.2, 0.3):
        load.answered(seconds, time.time())
    assert new_request(app, PARSED, "r6", may_move=True).decoder_s == pytest.approx(0.3)
    assert new_request(app, PARSED, "r7", may_move=False).decoder_s == 0.0  # the bubbles only: nothing kept
