"""Prompt placement: the bubbles when they finish a prompt by its objective with the decoder's reserve
kept, the decoder otherwise; a prompt whose bubble has not come by then moves; with no decoder the
excess is refused at once and nothing waits past its objective."""

from __future__ import annotations

import random

import pytest

from shared.policies import prompt_placement as placement
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import BubbleClosed, BubbleOpened, Request, WorkerReady
from shared.policies.fill import moved_on_worker
from shared.policies.prefill_cost import PrefillCostModel
from shared.policies.prompt_placement import (
    DECODER_TIMES_HORIZON_S,
    HOPS_MAX_SHARE,
    MARGIN,
    RESERVE,
    DecoderLoad,
    FrontDoorHops,
    Where,
)
from shared.wire.status import FailureReason


@pytest.mark.parametrize("seed", range(5))
def test_drawn_cases_go_to_the_bubbles_exactly_when_they_finish_before_the_kept_share(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(200):
        now = rng.uniform(0, 100)
        objective_s = rng.uniform(0.05, 2.0)
        due = now + objective_s
        finish_in = rng.uniform(0, 2 * objective_s)
        may_move = rng.random() < 0.5
        v = placement.on_arrival(finish_in, due, objective_s, may_move, now)
        kept = (RESERVE if may_move else MARGIN) * objective_s
        if finish_in <= objective_s - kept:
            assert v.where is Where.BUBBLES, v
        else:
            assert v.where is (Where.DECODER if may_move else None), v
            assert f"{finish_in:.3f}s" in v.why
    # no prediction yet, or no objective: the bubbles (the move is the safety net)
    assert placement.on_arrival(None, 1.0, 1.0, True, 0.0).where is Where.BUBBLES
    assert placement.on_arrival(5.0, None, None, False, 0.0).where is Where.BUBBLES


def test_a_prompt_moves_when_its_bubble_has_not_come_by_the_latest_start() -> None:
    # due at 1.0 s, a 0.5 s objective, 0.1 s of its own: the reserve is 0.15 s, so it moves at 0.75 s
    assert placement.moves_at(1.0, 0.5, 0.1) == pytest.approx(1.0 - RESERVE * 0.5 - 0.1)


def test_the_decoder_refuses_what_its_recent_prompts_say_it_cannot_finish_by_the_objective() -> None:
    d = DecoderLoad()
    assert d.verdict(0.5, now=0.0).where is Where.DECODER  # nothing measured yet: sent
    for seconds in [0.02] * 9 + [0.3]:  # nine quick first tokens, one slow
        d.sent()
        d.answered(seconds, now=1.0)
    assert d.predicted_s(1.0) == pytest.approx(0.3)  # the 90th percentile of ten: the slow one
    assert d.verdict(0.5, now=1.0).where is Where.DECODER
    refused = d.verdict(0.1, now=1.0)
    assert refused.where is None and "overloaded" in refused.why and "0.300s" in refused.why
    for _ in range(32):  # the window moves on: quick again
        d.answered(0.02, now=2.0)
    assert d.predicted_s(2.0) == pytest.approx(0.02) and d.verdict(0.1, now=2.0).where is Where.DECODER
    d.sent()
    d.answered(None, now=2.0)  # failed: no time learned from it
    assert d.in_flight == 0 and d.predicted_s(2.0) == pytest.approx(0.02)
    assert d.verdict(None, now=2.0).where is Where.DECODER  # no objective: never refused


def test_a_decoder_judged_slow_is_tried_again_once_its_times_are_old() -> None:
    """Refused prompts teach nothing: after `DECODER_TIMES_HORIZON_S` with no newer time the decoder
    is assumed to meet the objective again, and the next prompt measures it."""
    d = DecoderLoad()
    for _ in range(10):
        d.answered(2.0, now=100.0)  # a slow minute
    assert d.verdict(0.5, now=100.0 + DECODER_TIMES_HORIZON_S - 0.1).where is None
    assert d.verdict(0.5, now=100.0 + DECODER_TIMES_HORIZON_S + 0.1).where is Where.DECODER


def saturated_state() -> tuple[DispatchState, float]:
    """A dispatcher that has seen a whole window of bubbles: 17 ms of every 100 ms (0.17 s/s)."""
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])  # 1 ms per token
    s = DispatchState(layers=4, max_batch=8, cost=cost)
    now = 0.0
    for i in range(120):
        now = i * 0.1
        s.bubble_start(BubbleOpened("w", "fill:w", 0.02, 0, started=now, tag=i), now)
        s.bubble_end(BubbleClosed("w", i, 0.017), now=now)
    return s, now + 0.05


def started(s: DispatchState) -> DispatchState:
    """`s` once training has started: a bubble seen, long enough ago that it gives no rate and its
    worker no credit now."""
    s.bubble_start(BubbleOpened("old", "fill:old", 0.02, 0, started=-10.0, tag=0), -10.0)
    s.bubble_end(BubbleClosed("old", 0, 0.017), now=-10.0)
    return s


def test_before_the_first_bubble_a_request_with_an_objective_moves_or_is_refused_at_once() -> None:
    """Nothing says when the first bubbles come (the workers set up, then the first iteration
    starts when the last one has): a request with an objective goes to the decoder at once, or is
    refused (a 429 and Retry-After), rather than wait for them past its objective. One with a
    deadline only waits, as before. Nor, after the first bubble, does anything say how fast they
    serve until the pipeline has come round once: the same again. Then the bubbles take it."""
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    s = DispatchState(layers=4, max_batch=8, cost=cost)
    s.worker_joined(WorkerReady("w", "fill:w", 0.05, 10**9, at=0.0), 0.0)  # joined, not yet training
    ds = s.add_request(Request("moves", 50, 0.0, 1, deadline=60.0, objective=0.5, may_move=True, payload=None), 0.0)
    ds += s.add_request(Request("refused", 50, 0.0, 1, deadline=60.0, objective=0.5, payload=None), 0.0)
    ds += s.add_request(Request("waits", 50, 0.0, 1, deadline=60.0, payload=None), 0.0)
    assert [m.id for m in ds.moved] == ["moves"]  # a move of its own, not a failure
    assert [(f.id, f.reason) for f in ds.failed] == [("refused", FailureReason.OVERLOADED)]
    assert all("no bubble yet" in why for why in [m.why for m in ds.moved] + [f.detail for f in ds.failed])
    assert "waits" in s.requests
    s.bubble_start(BubbleOpened("w", "fill:w", 0.05, 0, started=0.1, tag=(0, 3)), 0.1)
    s.bubble_end(BubbleClosed("w", (0, 3), 0.05), now=0.15)
    ds = s.add_request(Request("early", 50, 0.15, 1, deadline=60.0, objective=0.6, payload=None), 0.15)
    assert [(f.id, f.reason) for f in ds.failed] == [("early", FailureReason.OVERLOADED)]
    assert "has not come round once" in ds.failed[0].detail
    s.bubble_start(BubbleOpened("w", "fill:w", 0.05, 0, started=0.2, tag=(1, 3)), 0.2)  # round: 0.5 s/s
    s.bubble_end(BubbleClosed("w", (1, 3), 0.05), now=0.25)
    ds = s.add_request(Request("taken", 50, 0.25, 1, deadline=60.0, objective=0.6, payload=None), 0.25)
    assert not ds.failed and "taken" in s.requests
    assert placement.on_arrival(None, 1.0, 1.0, False, 0.0, started=False).where is None
    assert placement.on_arrival(None, None, None, False, 0.0, started=False).where is Where.BUBBLES


def test_the_dispatcher_moves_what_the_bubbles_cannot_finish_by_its_objective() -> None:
    s, now = saturated_state()
    # 20 ms of prompt: ~0.12 s in the bubbles, within 0.5 s less the reserve
    ds = s.add_request(
        Request("fits", 20, now, 1, deadline=now + 60, objective=now + 0.5, may_move=True, payload=None), now
    )
    assert not ds.failed and "fits" in s.requests
    # 200 ms of prompt: ~1.3 s in the bubbles, past its objective: moved at once, saying why
    ds = s.add_request(
        Request("big", 200, now, 1, deadline=now + 60, objective=now + 0.5, may_move=True, payload=None), now
    )
    assert not ds.failed and [m.id for m in ds.moved] == ["big"]
    assert "bubbles would finish it" in ds.moved[0].why and s.counts.moved == 1
    # without a decoder the same request is refused (a 429), not moved
    ds = s.add_request(Request("big2", 200, now, 1, deadline=now + 60, objective=now + 0.5, payload=None), now)
    assert [(f.id, f.reason) for f in ds.failed] == [("big2", FailureReason.OVERLOADED)]
    assert ds.failed[0].detail.startswith("overloaded")


def test_a_waiting_request_moves_to_the_decoder_when_its_margin_runs_out() -> None:
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    s = started(DispatchState(layers=4, max_batch=8, cost=cost))  # no rate yet: admitted
    s.add_request(Request("r", 50, 0.0, 1, deadline=60.0, objective=0.5, may_move=True, ticket="t", payload=None), 0.0)
    s.add_request(Request("stays", 50, 0.0, 1, deadline=60.0, objective=0.5, ticket="u", payload=None), 0.0)
    move_at = placement.moves_at(0.5, 0.5, 0.05)  # 0.3 s; moved at the last tick before it
    assert not s.tick(move_at - s.tick_s - 0.01).moved  # its margin has not run out
    ds = s.tick(move_at - s.tick_s + 0.01)
    assert not ds.failed and [(m.id, m.ticket) for m in ds.moved] == [("r", "t")]
    assert "r" not in s.requests and s.counts.moved == 1
    # one with no decoder waits until its objective, and is failed there: never queued past it
    assert not s.tick(0.49).failed
    ds = s.tick(0.51)
    assert [(f.id, f.reason) for f in ds.failed] == [("stays", FailureReason.DEADLINE)]
    assert "objective passed" in ds.failed[0].detail


def test_a_batch_item_says_by_when_its_prompt_has_moved_and_a_worker_leaves_it_unrun_in_a_later_bubble() -> None:
    """Sent to a worker between its bubbles, a request that may move carries `moves_from`: by when
    the dispatcher has moved it if it waited there (its move's earliest tick, plus one tick). A
    worker leaves it unrun in a bubble that opened after that (`fill.moved_on_worker`), and runs it
    in one that opened before (the dispatcher does not move what runs). One that may not move
    carries none."""
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    s = started(DispatchState(layers=4, max_batch=8, cost=cost))
    s.worker_joined(WorkerReady("w", "fill:w", 0.2, 10**9, at=0.0), 0.0)
    ds = s.add_request(
        Request("r", 50, 0.0, 1, deadline=60.0, objective=0.5, may_move=True, ticket="t", payload=None), 0.0
    )
    ds += s.add_request(Request("stays", 50, 0.0, 1, deadline=60.0, objective=0.5, ticket="u", payload=None), 0.0)
    items = {i.id: i for b in ds.batches for i in b.items}
    assert set(items) == {"r", "stays"} and items["stays"].moves_from is None
    moved_by = items["r"].moves_from
    assert moved_by == pytest.approx(placement.moves_at(0.5, 0.5, 0.05))
    earliest = moved_by - s.tick_s
    assert not s.tick(earliest - 0.001).moved
    ds = s.tick(earliest)  # any tick from its earliest moves it: one comes by `moved_by`
    assert not ds.failed and [m.id for m in ds.moved] == ["r"]
    assert moved_on_worker(moved_by, moved_by) and not moved_on_worker(moved_by, moved_by - 0.001)
    assert not moved_on_worker(None, 1e9)


def test_the_share_kept_is_of_the_time_to_when_it_is_due_its_deadline_if_that_comes_first() -> None:
    """A 600 s objective and a 120 s deadline: it is due in 120 s, and its reserve is 30% of those
    (a reserve of 30% of 600 s once moved every such request at its first tick)."""
    s = started(
        DispatchState(layers=4, max_batch=8, cost=PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)]))
    )
    s.add_request(Request("r", 50, 0.0, 1, deadline=120.0, objective=600.0, may_move=True, payload=None), 0.0)
    assert not s.tick(1.0).moved and "r" in s.requests
    ds = s.tick(placement.moves_at(120.0, 120.0, 0.05) - s.tick_s + 0.01)
    assert not ds.failed and [m.id for m in ds.moved] == ["r"]


def test_the_front_door_keeps_its_own_hops_of_an_objective_up_to_a_share() -> None:
    """None seen: nothing kept. Then the 90th percentile of the recent hops (their largest, kept,
    left the workers too little of a compose deployment's objective, 2026-11-29), at most a quarter
    of the objective (a front door slowed to a crawl must not leave the bubbles nothing)."""
    hops = FrontDoorHops(window=100)
    assert hops.kept_s(0.5) == 0.0
    for ms in range(1, 101):  # 1..100 ms: the 90th percentile is 91 ms, the 99th 100 ms
        hops.observed(ms / 1000)
    assert hops.kept_s(0.5) == pytest.approx(0.091)
    assert hops.kept_s(0.1) == pytest.approx(HOPS_MAX_SHARE * 0.1)
    for _ in range(100):  # only the last `window` count
        hops.observed(0.002)
    assert hops.kept_s(0.5) == pytest.approx(0.002)


def test_the_decoders_recent_time_is_kept_for_it_where_longer_than_its_reserve() -> None:
    """A decoder whose recent prompts took 0.3 s to a first token is kept 0.3 s of a 0.5 s objective,
    not the 0.15 s reserve: a prompt then moves to it while it can still finish in time (with less
    left it was refused there, late), and the bubbles take only what they finish before."""
    assert placement.kept_s(0.5, True) == pytest.approx(RESERVE * 0.5)
    assert placement.kept_s(0.5, True, decoder_s=0.3) == pytest.approx(0.3)
    assert placement.kept_s(0.5, True, decoder_s=0.05) == pytest.approx(RESERVE * 0.5)  # the reserve at least
    assert placement.kept_s(0.5, False, decoder_s=0.3) == pytest.approx(MARGIN * 0.5)  # no decoder to keep for
    # a decoder as slow as the objective could not take it anyway: the bubbles keep all but the reserve
    assert placement.kept_s(0.5, True, decoder_s=0.6) == pytest.approx(RESERVE * 0.5)
    assert placement.moves_at(1.0, 0.5, 0.1, decoder_s=0.3) == pytest.approx(1.0 - 0.3 - 0.1)
    # finishing in 0.3 s of a 0.5 s objective: the bubbles' with the reserve, the decoder's with 0.3 s kept
    assert placement.on_arrival(0.3, 0.5, 0.5, True, 0.0).where is Where.BUBBLES
    assert placement.on_arrival(0.3, 0.5, 0.5, True, 0.0, decoder_s=0.3).where is Where.DECODER
