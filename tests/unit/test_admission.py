"""Admission: past the bubbles' capacity a request is refused at once (429), not queued to expire."""

from __future__ import annotations

import pytest

from shared.policies.admission import Admission
from shared.policies.dispatch import BubbleOpened, DispatchState, Request
from shared.policies.prefill_cost import PrefillCostModel
from shared.status import FailureReason


def test_no_rate_until_a_quarter_window_of_bubbles_was_seen_then_over_what_was() -> None:
    a = Admission(window_s=2.0)
    assert a.refusal(queued_s=100.0, own_s=1.0, deadline=1.0, now=0.0) is None  # nothing seen: admit
    a.bubble(0.0, 0.1)
    assert a.rate(0.4) is None  # under a quarter of the window
    assert a.rate(0.5) == pytest.approx(0.2)  # 0.1 usable s over the 0.5 s seen
    a.bubble(1.0, 0.1)
    assert a.rate(2.0) == pytest.approx(0.1)  # 0.2 usable s over the last 2 s
    assert a.rate(2.5) == pytest.approx(0.05)  # the first left the window
    assert a.rate(10.0) is None  # none in the window: no rate (a pause is the readiness gate's call)


def test_a_request_that_would_finish_past_its_deadline_is_refused_saying_why() -> None:
    a = Admission(window_s=1.0)
    for i in range(11):
        a.bubble(i * 0.1, 0.05)  # half of every second is usable bubble
    now = 1.0
    assert a.rate(now) == pytest.approx(0.55)
    assert a.refusal(queued_s=0.2, own_s=0.01, deadline=now + 1.0, now=now) is None  # done in ~0.38 s
    why = a.refusal(queued_s=1.0, own_s=0.01, deadline=now + 1.0, now=now)
    assert why is not None and "overloaded" in why and "past its deadline" in why
    assert a.refusal(queued_s=1.0, own_s=0.01, deadline=None, now=now) is None  # no deadline: admitted


def test_past_capacity_the_dispatcher_refuses_the_excess_at_arrival() -> None:
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])  # 1 ms per token
    s = DispatchState(layers=4, guard_s=0.002, overhead_s=0.001, max_batch=8, cost=cost)
    refused_late = 0
    for i in range(800):  # a 20 ms bubble every 10 ms (17 ms usable: 1.7 s/s), with no memory to use
        now = i * 0.01
        s.bubble_start(BubbleOpened("w", "fill:w", 0.02, 0, started=now, tag=i), now)
        s.bubble_end("w", i, now=now)
        s.tick(now)
        # a 0.1 s request every 10 ms: 10 s of work a second, six times the capacity
        ds = s.add_request(Request(f"r{i}", 100, now, 1, deadline=now + 0.5, ticket=f"t{i}"), now)
        for f in ds.failed:
            assert f.reason is FailureReason.OVERLOADED and f.ticket == f"t{i}"
            refused_late += now > 2.5
        if now > 2.5:
            # admitted work stays within what the bubbles serve before a deadline: 0.5 s x 1.7 s/s
            assert sum(r.queued_s for r in s.requests.values()) <= 0.5 * 1.7 + 0.1
    # until a window of bubbles is seen all are admitted (and expire); after it, the excess is refused
    assert refused_late >= 0.8 * 550
    assert s.counts.overloaded >= refused_late


def test_at_saturation_the_rate_is_what_the_workers_served_not_the_usable_bubble_time() -> None:
    """Packing never fills every usable second: once requests have waited a whole window without a
    break, admission counts what was reported served (here 60% of the usable time), so it refuses
    what that rate cannot start in time instead of admitting it to expire."""
    a = Admission(window_s=1.0)
    for i in range(11):
        a.bubble(i * 0.1, 0.05)  # 0.55 usable s a second
        a.queue(True, i * 0.1)  # and requests waiting all along
        a.served(i * 0.1, 0.03)  # 0.33 s a second served
    assert a.rate(1.0) == pytest.approx(0.33)
    assert a.refusal(queued_s=0.4, own_s=0.01, deadline=2.0, now=1.0) is not None  # 0.41 / 0.33 > 1 s
    a.queue(False, 1.0)  # the queue emptied: not saturated, the usable time is the rate again
    assert a.rate(1.0) == pytest.approx(0.55)
    assert a.refusal(queued_s=0.4, own_s=0.01, deadline=2.0, now=1.0) is None


def test_an_expiry_in_the_window_means_saturation_even_if_the_queue_emptied() -> None:
    """Queued work staged onto idle workers empties the queue under overload too: a request that
    expired within the window is the proof that the usable time promised more than was served."""
    a = Admission(window_s=1.0)
    for i in range(11):
        a.bubble(i * 0.1, 0.05)
        a.served(i * 0.1, 0.02)
    a.queue(False, 1.0)
    assert a.rate(1.0) == pytest.approx(0.55)  # not saturated: the usable time
    a.expired(1.0)
    assert a.rate(1.0) == pytest.approx(0.22)  # what was served
    for i in range(11, 21):
        a.bubble(i * 0.1, 0.05)  # a window later, with nothing expired since: the usable time again
    assert a.rate(2.05) == pytest.approx(0.5)
