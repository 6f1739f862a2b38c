"""The dispatcher's pure state machine: each worker's credit (work queued on it ahead of its
bubbles), the queue, reports, expiry, lost batches, and the why of every decision. A fake clock
(plain numbers) drives it; nothing sleeps and nothing needs Redis."""

import random
from collections.abc import Iterator

import pytest

from shared.config.spec import BubbleTea
from shared.policies.decisions import Batch, Decisions, Trigger
from shared.policies.dispatch import DispatchState
from shared.policies.dispatch_inputs import (
    BATCH_GRACE_S,
    RESUME_WAIT_S,
    STAGE_WINDOW_S,
    STALE_BUBBLE_S,
    BubbleClosed,
    BubbleOpened,
    Progress,
    Request,
    WorkerReady,
)
from shared.policies.fill import HOLD_STAGED_S, FillQueue
from shared.policies.handout import Handout
from shared.policies.packing import Candidate, order_key
from shared.policies.prefill_cost import PrefillCostModel
from shared.policies.waiting_room import WaitingRoom
from shared.wire.status import FailureReason

LAYERS = 4


def state(**kw: object) -> DispatchState:
    # a cost model that has learned 1 ms per token (whole prompt)
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    args = {"layers": LAYERS, "max_batch": 8, "cost": cost}
    args.update(kw)
    return DispatchState(**args)  # type: ignore[arg-type]


def join(s: DispatchState, worker: str, typical_s: float, *, now: float, free: int = 10**9, dc: str = "") -> Decisions:
    return s.worker_joined(WorkerReady(worker, f"fill:{worker}", typical_s, free, at=now, dc=dc), now)


def start(
    s: DispatchState,
    worker: str,
    predicted_s: float,
    *,
    now: float,
    free: int = 10**9,
    tag: object = None,
    dc: str = "",
) -> Decisions:
    return s.bubble_start(BubbleOpened(worker, f"fill:{worker}", predicted_s, free, started=now, tag=tag, dc=dc), now)


def end(s: DispatchState, worker: str, actual_s: float | None = None, *, now: float, done: tuple[str, ...] = ()):
    return s.bubble_end(BubbleClosed(worker, None, actual_s, done), now)


def one(ds: Decisions) -> Batch:
    """The one batch of a decision."""
    assert len(ds.batches) == 1, ds
    return ds.batches[0]


def ids(b: Batch) -> list[str]:
    return [i.id for i in b.items]


def finished(ds: Decisions) -> list[str]:
    return [f.id for f in ds.finished]


def req(i: int, tokens: int = 10, *, deadline: float | None = None, kv: int = 100, at: float | None = None) -> Request:
    arrival = float(i) if at is None else at
    return Request(
        id=f"r{i}", tokens=tokens, arrival=arrival, kv_bytes=kv, deadline=deadline, ticket=f"t{i}", payload=None
    )


def test_a_worker_holds_a_bubble_and_a_half_of_work_before_any_bubble_opens() -> None:
    s = state()
    for i in range(8):
        s.add_request(req(i, 10), now=0.0)  # 10 ms each; no worker yet: they wait
    assert s.room.waiting == 8
    ds = join(s, "w1", 0.040, now=0.0)  # credit 1.5 x 40 = 60 ms, at most half of it a batch
    b1, b2 = ds.batches
    assert ids(b1) == ["r0", "r1", "r2"] and ids(b2) == ["r3", "r4", "r5"]
    assert b1.address == "fill:w1" and b1.predicted_s == pytest.approx(0.030)
    assert s.workers["w1"].held_s == pytest.approx(0.060) and s.room.waiting == 2
    assert all(s.requests[f"r{i}"].on_worker == "w1" for i in range(6))
    assert not s.add_request(req(9, 10), now=0.0).batches  # its credit is in use


def test_the_last_request_of_a_batch_may_go_past_the_room_and_is_never_cut() -> None:
    s = state()
    s.add_request(req(0, 100), now=0.0)  # 100 ms: more than the 10 ms of room
    b = one(join(s, "w1", 0.020 / 1.5, now=0.0))
    assert [(i.id, i.from_layer, i.to_layer) for i in b.items] == [("r0", 0, LAYERS)]


def test_every_batch_says_why() -> None:
    s = state()
    join(s, "w1", 0.040, now=0.0)
    d = one(s.add_request(req(0), now=0.5))
    w = d.why
    assert w.trigger is Trigger.REQUEST and w.bubble is None and w.queued == 1
    assert w.window_s == pytest.approx(0.060) and w.held_s == 0.0 and w.predicted_s == pytest.approx(0.010)
    assert set(w.fields()) == {"trigger", "bubble", "window_ms", "held_ms", "predicted_ms", "queued"}
    s.add_request(req(1, 60), now=0.5)  # into the rest of its room: 50 ms
    d2 = one(s.add_request(req(2, 10), now=1.0) + start(s, "w1", 0.030, now=1.0, tag=(3, 7)))
    assert d2.why.trigger is Trigger.BUBBLE_START and d2.why.bubble == (3, 7)
    assert d2.why.window_s == pytest.approx(0.090) and d2.why.held_s == pytest.approx(0.070)


def test_an_open_bubble_adds_its_predicted_length_to_the_window_until_it_ends() -> None:
    s = state()
    join(s, "w1", 0.020, now=0.0)  # 30 ms of credit
    for i in range(10):
        s.add_request(req(i, 10), now=0.0)
    assert s.workers["w1"].held_s == pytest.approx(0.030)
    ds = start(s, "w1", 0.050, now=0.1)  # 50 ms more while it is open
    assert sum(b.predicted_s for b in ds.batches) == pytest.approx(0.050)
    assert s.book.room_s(s.workers["w1"]) <= 0
    end(s, "w1", 0.050, now=0.15)
    assert s.book.room_s(s.workers["w1"]) < 0  # back to its typical bubbles: nothing more until work is used


def test_the_roomiest_worker_takes_a_request_first_and_ties_go_by_name() -> None:
    s = state()
    join(s, "w2", 0.020, now=0.0)
    join(s, "w1", 0.020, now=0.0)
    join(s, "w3", 0.040, now=0.0)
    assert one(s.add_request(req(0), now=0.0)).worker == "w3"  # 60 ms of room
    assert one(s.add_request(req(1), now=0.0)).worker == "w3"  # still 50
    assert [one(s.add_request(req(i), now=0.0)).worker for i in (2, 3, 4)] == ["w3", "w1", "w2"]


def test_a_bubble_end_gives_back_the_credit_of_what_finished_in_it_and_the_report_counts_it_once() -> None:
    s = state()
    join(s, "w1", 0.020, now=0.0)  # 30 ms of credit, batches of at most 15
    b1, b2 = s.add_requests([req(i, 5) for i in range(8)], now=0.0).batches  # 5 ms each, read together
    assert ids(b1) == ["r0", "r1", "r2"] and ids(b2) == ["r3", "r4", "r5"] and s.room.waiting == 2
    start(s, "w1", 0.004, now=0.1)  # 4 ms more while it is open: r6
    top_up = end(s, "w1", 0.020, now=0.12, done=(b1.batch_id,))  # the bubble used b1: its credit is back at once
    assert ids(one(top_up)) == ["r7"] and b1.batch_id not in s.workers["w1"].held
    ds = s.report(b1.batch_id, "w1", [Progress(f"r{i}", LAYERS, 0.005, True) for i in range(3)], now=0.13)
    assert finished(ds) == ["r0", "r1", "r2"]
    assert s.workers["w1"].held_s == pytest.approx(sum(v[0] for v in s.workers["w1"].held.values()))


def test_reports_complete_or_requeue_at_the_resume_point_and_spend_saved_states() -> None:
    s = state()
    s.add_request(req(0, 100), now=0.0)
    b1 = one(join(s, "w1", 0.100, now=0.0))
    # handed back after 2 of 4 layers (its state saved there): queued again at layer 2, and taken
    # back at once by the worker whose credit the report freed (it holds the state)
    ds = s.report(b1.batch_id, "w1", [Progress("r0", reached_layer=2, seconds=0.050)], now=0.1)
    assert finished(ds) == [] and not ds.spent and s.requests["r0"].next_layer == 2
    b2 = one(ds)
    assert b2.worker == "w1" and [(i.from_layer, i.to_layer) for i in b2.items] == [(2, LAYERS)]
    ds = s.report(b2.batch_id, "w1", [Progress("r0", reached_layer=4, seconds=0.050, finished=True)], now=0.2)
    assert [(f.id, f.ticket) for f in ds.finished] == [("r0", "t0")] and s.requests == {}
    assert [(x.id, x.layer) for x in ds.spent] == [("r0", 2)]


def test_a_resumed_request_waits_for_its_states_datacenter_then_is_computed_again_elsewhere() -> None:
    s = state()
    join(s, "a1", 0.100, now=0.0, dc="a")
    s.add_request(req(0, 100, deadline=10.0), now=0.0)
    (b,) = list(s.in_flight)
    t = STAGE_WINDOW_S + 0.5  # a1 has been silent since: it takes nothing now
    assert not s.report(b, "a1", [Progress("r0", 2, 0.05)], now=t).batches  # saved at layer 2, in DC "a"
    assert s.requests["r0"].state_dc == "a"
    assert not join(s, "b1", 0.100, now=t, dc="b").batches  # DC "b" would compute it again: it waits
    assert not start(s, "b1", 0.05, now=t + RESUME_WAIT_S - 0.001, dc="b").batches
    late = one(start(s, "b1", 0.05, now=t + RESUME_WAIT_S, dc="b"))  # then it goes where there is room
    assert late.worker == "b1" and late.items[0].from_layer == 2
    # b1 had no state: it started from layer 0, running two layers again
    s.report(late.batch_id, "b1", [Progress("r0", 4, 0.1, True, started_layer=0)], now=t + 0.5)
    assert (s.counts.layers_run, s.counts.layers_recomputed) == (2 + 4, 2)
    assert s.recomputed_share == pytest.approx(2 / 6)


def test_a_request_the_worker_failed_is_finished_whatever_layer_it_reached() -> None:
    s = state()
    s.add_request(req(0, 100), now=0.0)
    b = one(join(s, "w1", 0.1, now=0.0))
    ds = s.report(b.batch_id, "w1", [Progress("r0", reached_layer=0, seconds=0.0, finished=True)], now=0.1)
    assert finished(ds) == ["r0"] and s.requests == {} and s.counts.done == 1


def test_stale_and_duplicate_reports_change_nothing() -> None:
    s = state()
    s.add_request(req(0), now=0.0)
    b = one(join(s, "w1", 0.1, now=0.0))
    assert not s.report("nope", "w1", [Progress("r0", 4, 0.01)], now=0.1).finished  # not in flight
    assert finished(s.report(b.batch_id, "w1", [Progress("r0", 4, 0.01, True)], now=0.1)) == ["r0"]
    again = s.report(b.batch_id, "w1", [Progress("r0", 4, 0.01, True)], now=0.2)  # duplicate
    assert not again.finished and again.ignored[0].why == "not in flight"


def test_a_request_is_never_on_two_workers() -> None:
    s = state()
    s.add_request(req(0, 100), now=0.0)
    join(s, "w1", 0.1, now=0.0)
    assert not join(s, "w2", 1.0, now=0.0).batches
    assert s.add_request(req(0, 100), now=0.0).ignored  # redelivered: already known


def test_expired_requests_fail_waiting_or_between_bubbles_but_running_ones_finish() -> None:
    s = state()
    join(s, "w1", 0.010 / 1.5, now=0.0)  # 10 ms of credit each: one request
    join(s, "w2", 0.010 / 1.5, now=0.0)
    s.add_requests([req(i, 10, deadline=1.0, at=0.0) for i in range(3)], now=0.0)  # r0 on w1, r1 on w2, r2 waits
    assert [s.requests[f"r{i}"].on_worker for i in range(3)] == ["w1", "w2", None]
    start(s, "w1", 0.4, now=1.2)  # r0 runs in w1's open bubble (r2, past its deadline, is not sent)
    ds = s.tick(now=1.5)
    assert sorted((f.id, f.reason) for f in ds.failed) == [
        ("r1", FailureReason.DEADLINE),
        ("r2", FailureReason.DEADLINE),
    ]
    why = {f.id: f.detail for f in ds.failed}
    assert why["r1"] == "deadline passed after 1.5s, queued on worker w2: its bubbles did not reach it in time"
    assert why["r2"] == "deadline passed after 1.5s in the queue: no worker had credit to spare for it"
    assert s.counts.expired == 2
    assert s.workers["w2"].held  # r1's batch is still on w2: its credit comes back with its report
    (b2,) = [b for b, f in s.in_flight.items() if f.worker == "w2"]
    assert s.report(b2, "w2", [Progress("r1", 4, 0.01, True)], now=1.6).finished == ()
    assert not s.workers["w2"].held


def test_a_batch_that_never_reports_back_is_requeued_and_its_worker_gets_no_credit() -> None:
    s = state()
    s.add_request(req(0, 10), now=0.0)
    b = one(join(s, "w1", 0.1, now=0.0))
    due = HOLD_STAGED_S + b.predicted_s + BATCH_GRACE_S
    assert not s.tick(now=due - 0.001).lost  # the worker may still hold it, then run it
    (lost,) = s.tick(now=due + 0.5).lost
    assert (lost.batch_id, lost.worker, lost.requests) == (b.batch_id, "w1", 1)
    assert lost.overdue_s == pytest.approx(0.5)
    assert s.requests["r0"].on_worker is None and s.counts.requeued == 1 and not s.workers["w1"].held
    assert s.book.room_s(s.workers["w1"]) <= 0  # until it is heard of again
    # a late report from the presumed-dead worker changes nothing; another worker takes r0
    assert s.report(b.batch_id, "w1", [Progress("r0", 4, 0.01)], now=due + 1).ignored
    assert ids(one(join(s, "w2", 0.1, now=due + 1))) == ["r0"]


def test_a_batch_behind_others_on_its_worker_is_waited_for_as_long_as_they_take() -> None:
    """Issue 62: the report's due time ignored the work queued ahead on the same worker, and a live
    worker with a long queue was written off (its work run twice elsewhere)."""
    s = state()
    join(s, "w1", 0.040, now=0.0)
    s.add_requests([req(i, 10) for i in range(6)], now=0.0)
    (b1, first), (_, second) = sorted((k, v.report_by) for k, v in s.in_flight.items())
    assert second - first == pytest.approx(s.workers["w1"].held[b1][0])  # behind b1's 30 ms


def test_a_late_batch_of_a_worker_still_heard_from_is_waited_for_once_more_not_written_off() -> None:
    s = state()
    s.add_request(req(0, 10), now=0.0)
    b = one(join(s, "w1", 0.1, now=0.0))
    due = s.in_flight[b.batch_id].report_by
    start(s, "w1", 0.05, now=due - 0.5)  # alive: a bubble opens (its work runs late, a long WAN wait)
    end(s, "w1", 0.05, now=due - 0.4)
    ds = s.tick(now=due + 0.1)
    assert not ds.lost and s.requests["r0"].on_worker == "w1"
    assert any(i.what == f"batch {b.batch_id}" and "heard" in i.why for i in ds.ignored), ds.ignored
    later = s.in_flight[b.batch_id].report_by
    assert later > due and s.tick(now=later + 0.1).lost  # silent since: lost after all


def test_a_bubble_open_far_past_its_prediction_is_taken_as_closed_and_its_requests_expire() -> None:
    """A worker that died in its bubble: its requests count as running until the bubble's end, which
    never comes. Past three times the prediction the bubble is taken as closed, so a request past
    its deadline fails now (issue 62: it waited for the batch's report, seconds later)."""
    s = state()
    join(s, "w1", 0.010 / 1.5, now=0.0)
    s.add_request(req(0, 10, deadline=0.5, at=0.0), now=0.0)
    assert s.requests["r0"].on_worker == "w1"
    start(s, "w1", 0.1, now=0.1)  # r0 runs in it; then the worker dies: no end
    assert not s.tick(now=0.35).ignored  # 0.25 s open: under three times 0.1
    ds = s.tick(now=0.6)  # open 0.5 s, and r0 past its deadline
    assert s.workers["w1"].bubble is None
    assert any(i.what == "bubble of w1" and "taken as closed" in i.why for i in ds.ignored), ds.ignored
    assert [(f.id, f.reason) for f in ds.failed] == [("r0", FailureReason.DEADLINE)]


def test_a_lost_worker_loses_all_its_batches_at_once() -> None:
    s = state()
    join(s, "w1", 0.040, now=0.0)
    s.add_requests([req(i, 10) for i in range(6)], now=0.0)
    assert len(s.in_flight) == 2
    ds = s.tick(now=HOLD_STAGED_S + BATCH_GRACE_S + 1.0)
    assert len(ds.lost) == 2 and s.in_flight == {} and s.book.held_s == 0.0
    assert all(r.on_worker is None for r in s.requests.values())


def test_the_hold_a_batch_may_wait_on_its_worker_is_the_specs() -> None:
    assert BubbleTea().hold_ms == HOLD_STAGED_S * 1000 == FillQueue().hold_s * 1000
    s = state(hold_s=5.0)
    s.add_request(req(0, 10), now=0.0)
    b = one(join(s, "w1", 0.1, now=0.0))
    assert not s.tick(now=b.predicted_s + BATCH_GRACE_S + 4.9).lost


def test_only_workers_heard_of_recently_get_credit() -> None:
    s = state()
    join(s, "w1", 0.040, now=0.0)
    assert not s.add_request(req(0), now=STAGE_WINDOW_S + 0.1).batches  # w1 said nothing since
    assert ids(one(end(s, "w1", 0.040, now=STAGE_WINDOW_S + 0.2))) == ["r0"]  # alive after all


def test_bubbles_are_ignored_when_stale_or_disabled() -> None:
    s = state()
    s.add_request(req(0), now=0.0)
    old = BubbleOpened("w1", "fill:w1", 1.0, 10**9, started=0.0)
    (ign,) = s.bubble_start(old, now=STALE_BUBBLE_S + 1).ignored
    assert "history" in ign.why and s.workers == {}
    off = state(enabled=False)
    off.add_request(req(0), now=0.0)
    assert "disabled" in off.bubble_start(old, now=0.0).ignored[0].why
    assert "disabled" in join(off, "w1", 1.0, now=0.0).ignored[0].why


def test_memory_and_batch_limits_hold_across_batches() -> None:
    s = state(max_batch=2)
    s.add_requests([req(i, tokens=1, kv=400) for i in range(5)], now=0.0)
    (d1,) = join(s, "w1", 1.0, now=0.0, free=1000).batches  # two of 400 bytes: no room for a third
    assert ids(d1) == ["r0", "r1"] and s.workers["w1"].held_bytes == 800
    d2 = one(s.add_request(req(9, tokens=1, kv=150), now=0.0))  # 200 bytes left: only the small one fits
    assert ids(d2) == ["r9"]


def test_a_joining_worker_with_bubbles_on_record_keeps_them() -> None:
    s = state()
    join(s, "w1", 0.010, now=0.0)
    start(s, "w1", 0.05, now=0.1)
    end(s, "w1", 0.100, now=0.2)
    join(s, "w1", 0.001, now=0.3)  # rejoins after a recovery: its record stands
    assert list(s.workers["w1"].lengths) == [0.010, 0.100] and s.workers["w1"].bubble is None


def test_reports_teach_the_cost_model_from_finished_and_preempted_runs() -> None:
    s = state()
    join(s, "w1", 10.0, now=0.0)
    for i in range(50):
        (b,) = s.add_request(req(i, tokens=100), now=0.0).batches
        # finished, as a worker reports a request it answered: really 3x slower than predicted
        s.report(b.batch_id, "w1", [Progress(f"r{i}", 4, 0.3, finished=True)], now=0.0)
    assert s.cost.predict(100) == pytest.approx(0.3, rel=0.1)
    for i in range(50, 120):
        (b,) = s.add_request(req(i, tokens=100), now=0.0).batches
        # one layer of four in 25 ms, then handed back, taken again and finished: 0.1 s a prompt
        (again,) = s.report(b.batch_id, "w1", [Progress(f"r{i}", 1, 0.025)], now=0.0).batches
        s.report(again.batch_id, "w1", [Progress(f"r{i}", 4, 0.075, finished=True)], now=0.0)
    assert s.cost.predict(100) == pytest.approx(0.1, rel=0.1)


def test_admission_counts_the_work_held_on_workers_ahead() -> None:
    s = state()
    join(s, "w1", 0.2, now=0.0)
    t = 0.0
    while t < 2.5:  # bubbles of 0.2 s every second: 0.2 s of prefill per second
        start(s, "w1", 0.2, now=t)
        end(s, "w1", 0.2, now=t + 0.2)
        t += 1.0
    for i in range(30):  # 30 ms each: 0.3 s held on w1 (its credit) and the rest waiting
        s.add_request(req(i, 30, deadline=t + 10.0), now=t)
    assert s.book.held_s == pytest.approx(0.3 + 0.0, abs=0.031)
    ahead = s.room.queued_s + s.book.held_s
    assert ahead == pytest.approx(0.9, abs=0.001)
    (f,) = s.add_request(req(99, 30, deadline=t + 0.9 / 0.2), now=t).failed  # behind 0.9 s at 0.2/s: 4.65 s
    assert f.reason is FailureReason.OVERLOADED and "0.90s of prefill queued ahead" in f.detail


def random_steps(rnd: random.Random, n: int, workers: list[str]) -> Iterator[tuple[str, tuple[object, ...], float]]:
    """`n` random inputs for a dispatcher: requests (now and then redelivered, some read together),
    bubble starts (some from the backlog) and ends (some naming no batch, some an old bubble),
    joins, reports of batches sent (some twice), ticks (some far ahead, then time goes back) and
    `fail_waiting`. A report names batches the caller tracks: `sent` (batch id -> batch)."""
    now, seq, tags = 0.0, 0, dict.fromkeys(workers, 0)
    for _ in range(n):
        now += rnd.choice((0.0, 0.0, 0.0005, 0.002, 0.006)) * rnd.random() if rnd.random() < 0.5 else 0.0
        op = rnd.random()
        if op < 0.3:
            reqs = []
            for _ in range(rnd.choice((1, 1, 1, 3))):
                seq += 1 if rnd.random() < 0.95 else 0  # now and then a redelivered request
                deadline = None if rnd.random() < 0.2 else now + rnd.uniform(0.01, 0.5)
                tokens, kv = rnd.choice((4, 10, 40, 200)), rnd.choice((100, 1000, 5000))
                reqs.append((f"q{seq}", tokens, now - rnd.choice((0.0, 0.0, 0.01)), kv, deadline))
            yield "requests", tuple(reqs), now
        elif op < 0.47:
            w = rnd.choice(workers)
            tags[w] += 1
            started = now - rnd.choice((0.0, 0.0, 0.001, STALE_BUBBLE_S + 0.5))  # ties, and history
            dc = "a" if w < "w6" else "b"
            yield "start", (w, rnd.uniform(0.0, 0.04), rnd.choice((10**9, 6000)), started, tags[w], dc), now
        elif op < 0.62:
            w = rnd.choice(workers)
            yield "end", (w, rnd.choice((tags[w], None, -1)), rnd.uniform(0.0, 0.05)), now
        elif op < 0.65:
            w = rnd.choice(workers)
            at = now - rnd.choice((0.0, 0.0, STALE_BUBBLE_S + 0.5))  # and history
            yield "join", (w, rnd.uniform(0.0, 0.04), rnd.choice((10**9, 6000)), at), now
        elif op < 0.88:
            yield "report", (rnd.random(), rnd.random()), now
        elif op < 0.997:
            yield "tick", (), now + (rnd.uniform(3.0, 6.0) if rnd.random() < 0.05 else 0.0)  # lost batches; then back
        else:
            yield "fail_waiting", (), now


class Driver:
    """Feeds `random_steps` to a dispatcher, reporting on the batches it sent (a random share of
    each batch's layers run, the rarely-finished flag, some reported twice, some bubble ends
    listing batches finished in them)."""

    def __init__(self, s: DispatchState, rnd: random.Random) -> None:
        self.s, self.rnd, self.sent = s, rnd, dict[str, Batch]()

    def step(self, name: str, args: tuple[object, ...], now: float) -> Decisions:
        s, rnd = self.s, self.rnd
        if name == "requests":
            reqs = [Request(i, t, a, k, deadline=d, ticket=f"t{i}", payload=None) for i, t, a, k, d in args]  # type: ignore[misc]
            ds = s.add_requests(reqs, now)
        elif name == "start":
            w, p, free, started, tag, dc = args
            ds = s.bubble_start(BubbleOpened(w, f"a:{w}", p, free, started, tag, dc), now)  # type: ignore[arg-type]
        elif name == "end":
            w, tag, actual = args
            done = tuple(b for b, x in self.sent.items() if x.worker == w and rnd.random() < 0.3)
            ds = s.bubble_end(BubbleClosed(w, tag, actual, done), now)  # type: ignore[arg-type]
        elif name == "join":
            w, typical, free, at = args
            ds = s.worker_joined(WorkerReady(w, f"a:{w}", typical, free, at, dc="a"), now)  # type: ignore[arg-type]
        elif name == "report":
            if not self.sent:
                return Decisions()
            b = self.sent.pop(sorted(self.sent)[int(args[0] * len(self.sent))])  # type: ignore[operator]
            progress = []
            for i in b.items:
                reached = rnd.randint(i.from_layer, i.to_layer)
                started = 0 if rnd.random() < 0.1 else None
                progress.append(
                    Progress(i.id, reached, i.seconds * rnd.uniform(0.5, 2.0), rnd.random() < 0.03, started)
                )
            if args[1] < 0.05:  # type: ignore[operator]
                self.sent[b.batch_id] = b  # reported twice
            ds = s.report(b.batch_id, b.worker, progress, now)
        elif name == "tick":
            ds = s.tick(now)
        else:
            ds = s.fail_waiting("test", now)
        self.sent.update({b.batch_id: b for b in ds.batches})
        for lb in ds.lost:
            self.sent.pop(lb.batch_id, None)
        return ds


def test_the_dispatchers_running_totals_stay_exact() -> None:
    """The waiting count, the queue's seconds and the credit held are kept as running totals to
    skip work at scale; random traffic must never make them drift from a recount."""
    rnd = random.Random(7)
    s = state(max_batch=4)
    d = Driver(s, rnd)
    for name, args, now in random_steps(rnd, 4000, [f"w{i}" for i in range(8)]):
        d.step(name, args, now)
        assert s.room.waiting == sum(r.on_worker is None for r in s.requests.values())
        for c in s.workers.values():
            assert c.held_s == pytest.approx(sum(v[0] for v in c.held.values()), abs=1e-9)
            assert c.held_bytes == sum(v[1] for v in c.held.values())
        assert s.book.held_s == pytest.approx(sum(c.held_s for c in s.workers.values()), abs=1e-9)
        assert s.book.held_n == sum(len(c.held) for c in s.workers.values())
    assert s.counts.batches > 300 and s.counts.done > 50


class FullScanRoom(WaitingRoom[None]):
    """The waiting room without its queue kept in order: packing sorts the whole queue (`pack`)."""

    def __init__(self, order: str, cost: PrefillCostModel, layers: int) -> None:
        super().__init__(order, cost, layers)
        self.key = order_key(order)

    def candidates(self, dc: str, now: float) -> Iterator[Candidate]:
        waiting = [r for r in self.requests.values() if r.on_worker is None]
        rank = {rid: e[-2] for rid, e in self.queue._entries.items()}  # ties in the order they became known
        waiting.sort(key=lambda r: (self.key(Candidate(r.id, 0, 0, r.arrival, 0, r.deadline)), rank[r.id]))
        for r in waiting:
            if not (r.state_dc and r.state_dc != dc and now < r.own_dc_until):
                yield Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)


class FullScanHandout(Handout[None]):
    """The hand-out without the credit index: every pass looks at every worker and ranks them by
    room (ties by name) afresh."""

    def fill(self, now: float, trigger: Trigger) -> Decisions:
        book, room = self.book, self.room
        batches = []
        skip: set[str] = set()
        while room.waiting and room.any_live(now):
            ranked = sorted(
                (c for c in book.workers.values() if book.room_s(c) > 0 and c.worker not in skip),
                key=lambda c: (-book.room_s(c), c.worker),
            )
            ranked = [c for c in ranked if now - c.last_seen <= book.stage_window_s]
            if not ranked:
                break
            b = self.fill_worker(ranked[0], now, trigger)
            if b is None:
                skip.add(ranked[0].worker)
            else:
                batches.append(b)
        return Decisions(batches=tuple(batches))


class FullScan(DispatchState[None]):
    """The dispatcher without its index, as the reference: a `FullScanRoom` and a `FullScanHandout`."""

    def __post_init__(self, credit_bubbles: float, max_credit_s: float, hold_s: float) -> None:
        super().__post_init__(credit_bubbles, max_credit_s, hold_s)
        self.room = FullScanRoom(self.order, self.cost, self.layers)
        h = self.handout
        self.handout = FullScanHandout(
            self.room,
            self.book,
            layers=h.layers,
            cost=h.cost,
            max_batch=h.max_batch,
            batch_prefix=h.batch_prefix,
            counts=h.counts,
        )


def snapshot(s: DispatchState) -> object:
    return (
        [(r.id, r.next_layer, r.on_worker, r.state_dc) for r in s.requests.values()],
        {w: (c.bubble, list(c.lengths), dict(c.held), c.last_seen) for w, c in s.workers.items()},
        s.in_flight,
        s.counts,
        s.room.waiting,
    )


@pytest.mark.parametrize(
    ("seed", "kw"), [(1, {}), (2, {"order": "arrival", "max_batch": 3}), (3, {"credit_bubbles": 4.0})]
)
def test_the_indexed_dispatcher_decides_exactly_as_a_full_scan(seed: int, kw: dict[str, object]) -> None:
    """The index (workers with room, roomiest first) and the queue kept in packing order change the
    cost only: a long random input sequence gives identical decisions, step by step, to a full scan."""
    args: dict[str, object] = {"layers": 4, "max_batch": 6, **kw}
    fast, full = DispatchState(**args), FullScan(**args)  # type: ignore[arg-type]
    d_fast, d_full = Driver(fast, random.Random(seed)), Driver(full, random.Random(seed))
    workers = [f"w{i}" for i in range(12)]  # "w10" sorts before "w2", as names do
    for name, a, now in random_steps(random.Random(seed + 100), 2000, workers):
        got, want = d_fast.step(name, a, now), d_full.step(name, a, now)
        assert got == want, name
        assert snapshot(fast) == snapshot(full)
    assert fast.counts.batches > 200 and fast.counts.done > 30  # it did dispatch


def test_admission_counts_a_bubble_less_the_rest_the_fit_rule_refused() -> None:
    """Issue 63: a worker's `BubbleEnd.refused_ms` is bubble time no block fitted: not capacity."""
    s = state()
    start(s, "w0", 0.010, now=0.0)
    s.bubble_end(BubbleClosed("w0", None, 0.010, (), refused_s=0.004), 0.010)
    start(s, "w0", 0.010, now=0.020)
    s.bubble_end(BubbleClosed("w0", None, 0.010, ()), 0.030)
    assert s._admission._usable_s == pytest.approx(0.006 + 0.010)
