"""Routing across datacenters (`shared.policies.dc_routing`): every rule, pinned on plain snapshots."""

from __future__ import annotations

import pytest

from shared.control.verdicts import READINESS_EVERY_S
from shared.policies import dc_routing
from shared.policies.admission import Admission, predicted_finish_s
from shared.policies.dc_routing import DcSnapshot, Router, RouteWhy, route
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import TICK_S
from shared.policies.prompt_placement import MARGIN, RESERVE


def snap(dc: str, ahead_s: float = 0.0, rate: float | None = 1.0, at: float = 0.0, **kw: object) -> DcSnapshot:
    return DcSnapshot(dc=dc, ready=True, ahead_s=ahead_s, rate=rate, at=at, **kw)  # type: ignore[arg-type]


def test_snapshots_are_published_every_tick_and_stale_after_three_readiness_intervals() -> None:
    assert dc_routing.PUBLISH_EVERY_S == TICK_S
    assert dc_routing.STALE_AFTER_S == 3 * READINESS_EVERY_S
    assert dc_routing.publish_every_s(1.0, READINESS_EVERY_S) == TICK_S  # a real device: every tick
    assert dc_routing.publish_every_s(10.0, READINESS_EVERY_S) == READINESS_EVERY_S  # a slowed host


def test_the_prediction_is_admissions_own_arithmetic() -> None:
    s = snap("a", ahead_s=0.3, rate=0.5, correction=1.5)
    assert s.finish_in(0.1) == predicted_finish_s(0.3, 0.1, 0.5, 1.5) == pytest.approx(1.2)
    a = Admission(window_s=1.0)
    for t in (0.0, 0.5, 1.0, 1.5):
        a.bubble(t, 0.25)
    assert a.finish_in(0.3, 0.1, 1.5) == predicted_finish_s(0.3, 0.1, a.rate(1.5), a.correction())
    assert snap("a", rate=None).finish_in(0.1) is None


def test_the_dc_predicted_to_finish_soonest_is_chosen() -> None:
    # b has more queued but serves it three times as fast: 0.3/3 < 0.2/1
    r = route([snap("a", ahead_s=0.2, rate=1.0), snap("b", ahead_s=0.3, rate=3.0)], 0.0, None, 0.0)
    assert (r.dc, r.why, r.finish_in_s) == ("b", RouteWhy.SOONEST, pytest.approx(0.1))
    # the request's own work counts at each DC's rate, and so does the correction of recent waits
    r = route([snap("a", ahead_s=0.1, rate=1.0), snap("b", ahead_s=0.0, rate=1.0, correction=2.0)], 0.2, None, 0.0)
    assert r.dc == "a"  # 0.3 against (0 + 0.2) x 2 = 0.4


def test_ties_go_to_the_least_queued_then_by_name() -> None:
    # the same finish: 0.2/1 = 0.4/2; b has less queued
    assert route([snap("a", ahead_s=0.4, rate=2.0), snap("b", ahead_s=0.2, rate=1.0)], 0.0, None, 0.0).dc == "b"
    same = [snap("c", ahead_s=0.1), snap("a", ahead_s=0.1), snap("b", ahead_s=0.1)]
    assert route(same, 0.0, None, 0.0).dc == "a"
    assert route(list(reversed(same)), 0.0, None, 0.0).dc == "a"


def test_a_stale_snapshot_is_not_used() -> None:
    old = snap("a", ahead_s=0.0, at=0.0)
    busy = snap("b", ahead_s=1.0, at=1.0)
    assert route([old, busy], 0.0, None, dc_routing.STALE_AFTER_S).dc == "a"  # just fresh
    r = route([old, busy], 0.0, None, dc_routing.STALE_AFTER_S + 0.001)
    assert r.dc == "b"
    r = route([old], 0.0, None, 10.0)
    assert (r.dc, r.why) == (None, RouteWhy.NONE_FRESH)


def test_a_dc_that_cannot_serve_is_not_used() -> None:
    down = DcSnapshot("a", ready=False, ahead_s=0.0, rate=5.0, at=0.0)
    assert route([down, snap("b", ahead_s=1.0)], 0.0, None, 0.0).dc == "b"
    assert route([down], 0.0, None, 0.0).why is RouteWhy.NONE_FRESH


def test_with_an_objective_a_dc_before_its_first_round_is_not_used() -> None:
    early = snap("a", ahead_s=0.0, came_round=False)
    idle = snap("b", ahead_s=0.0, started=False)
    later = snap("c", ahead_s=0.1)
    assert route([early, idle, later], 0.0, 1.0, 0.0).dc == "c"
    r = route([early, idle], 0.0, 1.0, 0.0)
    assert (r.dc, r.why) == (None, RouteWhy.NOT_ROUND)
    # with no objective only a deadline counts: such a DC takes it (as admission admits it)
    r = route([early], 0.0, None, 0.0)
    assert (r.dc, r.why) == ("a", RouteWhy.SOONEST)


def test_a_dc_with_no_rate_is_predicted_at_the_slowest_measured_rate() -> None:
    unmeasured = snap("a", ahead_s=0.3, rate=None)
    slow, fast = snap("b", ahead_s=0.5, rate=1.0), snap("c", ahead_s=0.8, rate=2.0)
    r = route([unmeasured, slow, fast], 0.0, None, 0.0)  # 0.3 at b's rate 1 is the soonest
    assert (r.dc, r.why, r.finish_in_s) == ("a", RouteWhy.ASSUMED, pytest.approx(0.3))
    r = route([snap("a", ahead_s=0.45, rate=None), slow, fast], 0.0, None, 0.0)  # c: 0.4
    assert (r.dc, r.why) == ("c", RouteWhy.SOONEST)
    # with an objective, one that came round but saw no bubble in its window (paused) likewise
    assert route([unmeasured, slow], 0.0, 1.0, 0.0).dc == "a"
    # none has a rate: the least queued, assumed to meet it (placement's rule)
    r = route([unmeasured, snap("d", ahead_s=0.2, rate=None)], 0.0, 1.0, 0.0)
    assert (r.dc, r.why, r.finish_in_s) == ("d", RouteWhy.UNPREDICTED, None)


def test_when_none_meets_the_objective_the_route_says_so() -> None:
    # 1 s objective, bubbles only: admission's margin is kept, so 0.85 s is allowed
    room = 1.0 * (1 - MARGIN)
    fits = route([snap("a", ahead_s=room - 0.1), snap("b", ahead_s=2.0)], 0.1, 1.0, 0.0)
    assert (fits.dc, fits.why) == ("a", RouteWhy.SOONEST)
    r = route([snap("a", ahead_s=room), snap("b", ahead_s=2.0)], 0.1, 1.0, 0.0)
    assert (r.dc, r.why, r.finish_in_s) == (None, RouteWhy.NONE_MEETS, pytest.approx(room + 0.1))
    assert "the soonest, a, would finish it" in r.detail
    # where the decoder may take it, its reserve is kept instead (placement's `kept_s`)
    r = route([snap("a", ahead_s=(1 - RESERVE) - 0.05)], 0.1, 1.0, 0.0, may_move=True)
    assert r.why is RouteWhy.NONE_MEETS


def test_the_view_ages_the_snapshot_at_its_rate() -> None:
    s = snap("a", ahead_s=0.5, rate=2.0, at=1.0, correction=2.0)
    assert s.aged(1.0) is s
    assert s.aged(1.2).ahead_s == pytest.approx(0.3)  # 0.2 s at 2/2 s a second
    assert s.aged(5.0).ahead_s == 0.0
    assert s.aged(1.2, [(1.0, 0.4)]).ahead_s == pytest.approx(0.7)
    # what was sent drains from when it was sent, not from the publish: sent to an idle DC just now,
    # it is all still queued (drained as one sum with the rest, it was gone before it was sent)
    assert s.aged(5.0, [(5.0, 0.4)]).ahead_s == pytest.approx(0.4)
    assert s.aged(5.0, [(4.9, 0.4), (4.95, 0.1)]).ahead_s == pytest.approx(0.4)  # 0.4-0.05, +0.1, -0.05
    assert snap("a", ahead_s=0.5, rate=None).aged(9.0).ahead_s == 0.5


def test_a_burst_between_two_snapshots_is_spread_by_counting_it_locally() -> None:
    router = Router()
    router.published(snap("a", ahead_s=0.0, rate=1.0, at=0.0))
    router.published(snap("b", ahead_s=0.05, rate=1.0, at=0.0))
    got = [router.route(0.02, None, 0.0).dc for _ in range(6)]
    # a (0) takes 0.02, 0.04, then b (0.05) and a alternate as each grows
    assert got == ["a", "a", "a", "b", "a", "b"]
    assert {s.dc: s.ahead_s for s in router.view(0.0)} == pytest.approx({"a": 0.08, "b": 0.09})


def test_the_next_snapshot_replaces_what_was_counted_before_it_but_not_after() -> None:
    router = Router()
    router.published(snap("a", ahead_s=0.0, rate=None, at=0.0))
    router.route(0.1, None, 0.1)  # before the next publish: in it
    router.route(0.2, None, 0.3)  # after it: not yet
    router.published(snap("a", ahead_s=0.1, rate=None, at=0.2))
    assert router.view(0.3)[0].ahead_s == pytest.approx(0.3)
    router.published(snap("a", ahead_s=0.0, rate=None, at=0.1))  # older than the view's: ignored
    assert router.view(0.3)[0].ahead_s == pytest.approx(0.3)
    router.published(snap("a", ahead_s=0.25, rate=None, at=0.4))
    assert router.view(0.4)[0].ahead_s == pytest.approx(0.25)


def test_a_request_not_routed_is_not_counted() -> None:
    router = Router()
    router.published(snap("a", ahead_s=2.0, rate=1.0, at=0.0))
    assert router.route(0.1, 1.0, 0.0).why is RouteWhy.NONE_MEETS
    assert router.view(0.0)[0].ahead_s == 2.0


def test_a_dispatcher_publishes_what_its_admission_judges_on() -> None:
    state: DispatchState[None] = DispatchState(layers=4)
    s = state.snapshot("dc-a", True, 0.0)
    assert (s.dc, s.ready, s.ahead_s, s.rate, s.at, s.correction) == ("dc-a", True, 0.0, None, 0.0, 1.0)
    assert not s.started and not s.came_round
