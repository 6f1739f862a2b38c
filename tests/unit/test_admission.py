"""Admission: past the bubbles' capacity a request is refused at once (429), not queued to expire."""

from __future__ import annotations

import random

import pytest

from shared.policies.admission import BEST_HALF_LIFE_S, MARGIN, Admission
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened, Progress, Request
from shared.policies.prefill_cost import PrefillCostModel
from shared.wire.status import FailureReason


def test_no_rate_until_a_whole_window_of_bubbles_was_seen() -> None:
    a = Admission(window_s=2.0)
    assert a.refusal(ahead_s=100.0, own_s=1.0, deadline=1.0, now=0.0) is None  # nothing seen: admit
    a.bubble(0.0, 0.1)
    assert a.rate(1.9) is None
    a.bubble(1.0, 0.1)
    assert a.rate(2.0) == pytest.approx(0.1)  # 0.2 usable s over the last 2 s
    assert a.rate(2.5) == pytest.approx(0.05)  # the first left the window: half the best is still a rate
    a.bubble(2.6, 0.01)
    # 0.01 over the window: a pause, so the best window stands (decayed 1.5 s of its 60 s half-life)
    assert a.rate(3.5) == pytest.approx(0.1 * 0.5 ** (1.5 / BEST_HALF_LIFE_S))
    assert a.rate(10.0) is None  # none in the window: no rate (a pause is the readiness gate's call)


def test_the_best_rate_decays_so_a_lasting_drop_is_the_rate_within_minutes() -> None:
    """Issue 62: a datacenter lost for good was taken for a pause for ever, and requests admitted at
    the old capacity failed at their objective."""
    a = Admission(window_s=2.0, best_half_life_s=60.0)
    for t in range(21):  # 0.1 usable s a second
        a.bubble(float(t), 0.1)
    best = a.rate(20.0)
    assert best is not None and best > 0
    t, rates = 20.0, []
    while t < 400.0:  # from here 0.03 a second, for good: under half the best, a pause at first
        t += 1.0
        a.bubble(t, 0.03)
        rates.append((t, a.rate(t)))
    low = 0.3 * best  # the window's rate from then on
    assert rates[2][1] == pytest.approx(best * 0.5 ** (3.0 / 60.0))  # a pause, at first: the best stands
    first_low = next(t for t, r in rates if r == pytest.approx(low))
    # the decayed best falls under twice the low rate after log2(1 / 0.6) = 0.74 half-lives: 44 s
    assert 40.0 < first_low - 20.0 < 50.0
    assert all(r == pytest.approx(low) for t, r in rates if t >= first_low)


def test_before_a_whole_window_the_rate_is_the_first_rounds_of_every_worker() -> None:
    """Bubbles tagged (iteration, position): once each worker has come round to its first bubble's
    point in a later iteration, the rate is its bubble seconds over that span, summed over workers."""
    a = Admission(window_s=10.0)
    a.bubble(0.0, 0.1, "w1", (3, 2))  # w1 seen from mid-iteration 3, at its position 2
    a.bubble(0.3, 0.2, "w2", (3, 0))
    a.bubble(0.5, 0.1, "w1", (4, 0))  # iteration 4, before position 2: not round yet
    assert a.rate(0.6) is None
    a.bubble(1.0, 0.1, "w1", (4, 2))  # w1 round: 0.2 s over 1.0 s
    assert a.rate(1.1) is None  # w2 has not come round
    a.bubble(1.2, 0.2, "w2", (4, 1))  # w2 at a later iteration, past its position 0: 0.2 s over 0.9 s
    assert a.rate(1.3) == pytest.approx(0.2 + 0.2 / 0.9)
    a.bubble(1.4, 5.0, "w1", (5, 2))  # what comes after a round does not change it
    assert a.rate(1.5) == pytest.approx(0.2 + 0.2 / 0.9)
    assert a.rate(10.0) == pytest.approx((0.1 + 0.2 + 0.1 + 0.1 + 0.2 + 5.0) / 10.0)  # a whole window


def test_a_first_round_ends_two_iterations_on_if_its_position_does_not_come_again() -> None:
    a = Admission(window_s=10.0)
    a.bubble(0.0, 0.1, "w", (0, 5))
    a.bubble(1.0, 0.1, "w", (1, 0))  # iteration 1 had no bubble at position 5 or past it
    assert a.rate(1.5) is None
    a.bubble(2.0, 0.1, "w", (2, 0))
    assert a.rate(2.5) == pytest.approx(0.2 / 2.0)


def test_bubbles_without_iteration_tags_wait_for_a_whole_window() -> None:
    a = Admission(window_s=2.0)
    for i in range(10):
        a.bubble(i * 0.1, 0.05, "w", i)  # a tag that is not (iteration, position)
    assert a.rate(1.0) is None
    a.bubble(1.0, 0.05, "w2", (0, 0))
    a.bubble(1.1, 0.05, "w2", (1, 0))
    assert a.rate(1.2) is None  # one untagged worker is enough: its round cannot be told


def test_a_request_that_would_finish_past_its_deadline_is_refused_saying_why() -> None:
    a = Admission(window_s=1.0)
    for i in range(11):
        a.bubble(i * 0.1, 0.05)  # half of every second is usable bubble
    now = 1.0
    assert a.rate(now) == pytest.approx(0.55)
    assert a.refusal(ahead_s=0.2, own_s=0.01, deadline=now + 1.0, now=now) is None  # done in ~0.38 s
    why = a.refusal(ahead_s=1.0, own_s=0.01, deadline=now + 1.0, now=now)
    assert why is not None and "overloaded" in why and "too close to its deadline" in why
    # done in ~0.89 s of the 1 s left: within the deadline, but not with MARGIN to spare
    assert 1 - MARGIN < 0.89
    assert a.refusal(ahead_s=0.48, own_s=0.01, deadline=now + 1.0, now=now) is not None
    assert a.refusal(ahead_s=1.0, own_s=0.01, deadline=None, now=now) is None  # no deadline: admitted


def test_past_capacity_the_dispatcher_refuses_the_excess_at_arrival() -> None:
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])  # 1 ms per token
    s = DispatchState(layers=4, max_batch=8, cost=cost)
    refused_late = 0
    for i in range(800):  # a 17 ms bubble every 10 ms (1.7 s/s), with no memory to use
        now = i * 0.01
        s.bubble_start(BubbleOpened("w", "fill:w", 0.02, 0, started=now, tag=i), now)
        s.bubble_end(BubbleClosed("w", i, 0.017), now=now)
        s.tick(now)
        # a 0.1 s request every 10 ms: 10 s of work a second, six times the capacity
        ds = s.add_request(Request(f"r{i}", 100, now, 1, deadline=now + 0.5, ticket=f"t{i}", payload=None), now)
        for f in ds.failed:
            assert f.reason is FailureReason.OVERLOADED and f.ticket == f"t{i}"
            refused_late += now > 2.5
        if now > 2.5:
            # admitted work stays within what the bubbles serve before a deadline: 0.5 s x 1.7 s/s
            assert sum(r.queued_s for r in s.requests.values()) <= 0.5 * (1 - MARGIN) * 1.7 + 0.1
    # until a window of bubbles is seen all are admitted (and expire); after it, the excess is refused
    assert refused_late >= 0.8 * 550
    assert s.counts.overloaded >= refused_late


def test_a_dispatcher_refuses_past_capacity_once_its_pipeline_came_round_once() -> None:
    """Two workers, a bubble each per 0.1 s iteration: the excess is refused from the second
    iteration on, not only once the 2 s window has passed."""
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])  # 1 ms per token
    s = DispatchState(layers=4, max_batch=8, cost=cost)
    refused_at = []
    for i in range(20):
        now = i * 0.1
        for w in ("w0", "w1"):
            s.bubble_start(BubbleOpened(w, f"fill:{w}", 0.02, 0, started=now, tag=(i, 1)), now)
            s.bubble_end(BubbleClosed(w, (i, 1), 0.03), now=now)
        for j in range(10):  # ten 0.1 s requests every 0.1 s: 10 s of work a second, 0.6 s/s served
            ds = s.add_request(
                Request(f"r{i}.{j}", 100, now, 1, deadline=now + 1.0, ticket=f"t{i}.{j}", payload=None), now
            )
            refused_at += [now for f in ds.failed if f.reason is FailureReason.OVERLOADED]
    assert s._admission.rate(1.0) == pytest.approx(0.6)
    assert refused_at and min(refused_at) == pytest.approx(0.1)  # the first round closed at 0.1 s
    assert len(refused_at) >= 0.8 * 190


def test_waits_longer_than_predicted_lengthen_the_next_predictions() -> None:
    """Each request admitted with a predicted wait of at least a quarter of the time it was given
    says how long it really waited; the 90th percentile of the recent ratios, between 1 and 2,
    multiplies the next predictions (and so the refusals)."""
    a = Admission(window_s=1.0)
    for i in range(11):
        a.bubble(i * 0.1, 0.05)
    now = 1.0
    assert a.correction() == 1.0 and a.finish_in(0.44, 0.0, now) == pytest.approx(0.8)
    a.waited(predicted_s=0.1, real_s=5.0, given_s=1.0)  # a short queue's wait (for a bubble): not counted
    assert a.correction() == 1.0
    for _ in range(10):
        a.waited(predicted_s=0.5, real_s=0.6, given_s=1.0)  # 1.2 times as long as predicted
    assert a.correction() == pytest.approx(1.2) and a.finish_in(0.44, 0.0, now) == pytest.approx(0.96)
    assert a.refusal(ahead_s=0.44, own_s=0.0, deadline=now + 1.0, now=now) is not None  # admitted before
    assert "1.20x as long as predicted" in (a.refusal(ahead_s=0.44, own_s=0.0, deadline=now + 1.0, now=now) or "")
    for _ in range(64):
        a.waited(predicted_s=0.5, real_s=0.25, given_s=1.0)  # shorter than predicted: never below 1
    assert a.correction() == 1.0
    for _ in range(64):
        a.waited(predicted_s=0.5, real_s=5.0, given_s=1.0)
    assert a.correction() == 2.0  # at most twice


def test_the_dispatcher_learns_a_wait_from_when_the_worker_answered_not_from_its_report() -> None:
    """A request admitted behind a queue is answered by its worker 1.5 times later than predicted;
    the batch's report comes later still: the correction is the answer's, 1.5."""
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])  # 1 ms per token
    s = DispatchState(layers=4, max_batch=8, cost=cost)
    for i in range(300):  # a 10 ms bubble every 10 ms: 1 bubble second a second
        now = i * 0.01
        s.bubble_start(BubbleOpened("w", "fill:w", 0.02, 1 << 30, started=now, tag=i), now)
        s.bubble_end(BubbleClosed("w", i, 0.01), now=now)
    now = 3.0
    s.add_request(Request("ahead", 400, now, 1, deadline=now + 1.9, ticket="t0", payload=None), now)  # 0.4 s of work
    s.add_request(Request("r", 100, now, 1, deadline=now + 1.9, ticket="t1", payload=None), now)
    predicted = s.requests["r"].predicted_wait_s
    assert predicted is not None and predicted == pytest.approx(0.5, rel=0.05)
    answered = {"ahead": now + 0.4, "r": now + 1.5 * predicted}  # "ahead" waited too little to count
    later = now + 1.0  # reported after every answer
    for i in range(4):  # each report tops the worker up with what is left
        s.bubble_start(BubbleOpened("w", "fill:w", 0.02, 1 << 30, started=later, tag=1000 + i), later)
        for batch_id, b in list(s.in_flight.items()):
            s.report(batch_id, "w", [Progress(r, 4, 0.1, True, None, answered[r]) for r in b.ids], now=later)
    assert not s.requests
    assert s._admission.correction() == pytest.approx(1.5, rel=0.01)


def test_the_correction_holds_while_it_works() -> None:
    """The ratio is of the real wait over the uncorrected prediction: once the correction has made
    the predictions true (real waits 1.5 times the raw ones), it stays 1.5 rather than fall to 1."""
    a = Admission(window_s=1.0)
    for i in range(11):
        a.bubble(i * 0.1, 0.05)
    now = 1.0
    for _ in range(64):
        raw = a.raw_finish_in(0.3, 0.0, now)
        assert raw is not None
        a.waited(raw, 1.5 * raw, given_s=1.0)  # the model's error: 1.5 times, however corrected
    assert a.correction() == pytest.approx(1.5)
    assert a.finish_in(0.3, 0.0, now) == pytest.approx(1.5 * (a.raw_finish_in(0.3, 0.0, now) or 0))


def test_the_first_rounds_rate_kept_as_they_change_is_the_sum_over_every_worker() -> None:
    """`_first_round_rate` is kept as the rounds change (every arrival reads it); over a random
    sequence of tagged bubbles it is exactly the straightforward sum over every worker's round."""

    def summed(a: Admission) -> float | None:  # the straightforward computation, as it was
        rates = [r.rate() for r in a._rounds.values()] if a._rounds else [None]
        return None if None in rates else sum(r for r in rates if r is not None)

    rng, seen = random.Random(7), 0
    for _ in range(20):
        a = Admission(window_s=1e9)  # the first round's rate throughout
        t, at = 0.0, {"w0": (0, rng.randrange(8))}
        for _ in range(400):
            if rng.random() < 0.02:  # a worker joins now and then, often after the others came round
                at[f"w{len(at)}"] = (rng.randrange(3), rng.randrange(8))
            w = rng.choice(list(at))
            it, pos = at[w]
            at[w] = (it + rng.randrange(2), rng.randrange(8))  # on, or back to an earlier position
            t += rng.choice([0.0, rng.random()])  # bubbles at one instant too (a round of no span)
            a.bubble(t, rng.choice([0.0, rng.random()]), w, (it, pos))
            assert a._first_round_rate() == summed(a)
            seen += a._first_round_rate() is not None
        assert a.came_round(t) == (summed(a) is not None)
    assert seen > 0


def test_a_new_term_of_the_same_process_keeps_the_measured_rate() -> None:
    """A dispatcher whose lease lapsed in a Redis failover leads again in a new term: with the
    last term's admission carried over (`carry_admission`) the rate is known at once, where a fresh
    state knows nothing until every worker comes round again."""
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    before = DispatchState(layers=4, max_batch=8, cost=cost)
    for i in range(5):
        for w in ("w0", "w1"):
            before.bubble_start(BubbleOpened(w, f"fill:{w}", 0.02, 0, started=i * 0.1, tag=(i, 1)), i * 0.1)
            before.bubble_end(BubbleClosed(w, (i, 1), 0.03), now=i * 0.1)
    assert before.came_round(0.5)
    fresh = DispatchState(layers=4, max_batch=8, cost=cost)
    assert not fresh.came_round(0.5)
    fresh.carry_admission(before)
    assert fresh.came_round(0.5) and fresh._admission.rate(0.5) == pytest.approx(0.6)
