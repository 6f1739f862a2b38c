"""The dispatcher's pure state machine: bubbles, queue, reports, expiry, lost batches, and the why
of every decision. A fake clock (plain numbers) drives it; nothing sleeps and nothing needs Redis."""

import random

import pytest

from shared.control.status import FailureReason
from shared.policies.decisions import Batch, Decisions, Trigger
from shared.policies.dispatch import (
    BATCH_GRACE_S,
    STALE_BUBBLE_S,
    BubbleOpened,
    DispatchState,
    Progress,
    Request,
    WorkerReady,
)
from shared.policies.fill import HOLD_STAGED_S, FillPolicy
from shared.policies.packing import Assignment, Candidate, layered_cost, pack
from shared.policies.prefill_cost import PrefillCostModel
from shared.spec.config import BubbleTea

LAYERS = 4


def state(**kw: object) -> DispatchState:
    # a cost model that has learned 1 ms per token (whole prompt)
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    args = {"layers": LAYERS, "guard_s": 0.002, "overhead_s": 0.001, "max_batch": 8, "cost": cost}
    args.update(kw)
    return DispatchState(**args)  # type: ignore[arg-type]


def start(s: DispatchState, worker: str, predicted_s: float, *, now: float, free_memory: int = 10**9) -> Decisions:
    return s.bubble_start(BubbleOpened(worker, f"fill:{worker}", predicted_s, free_memory, started=now), now)


def one(ds: Decisions) -> Batch:
    """The one batch of a decision."""
    assert len(ds.batches) == 1, ds
    return ds.batches[0]


def ranges(b: Batch) -> list[tuple[str, int, int]]:
    return [(i.id, i.from_layer, i.to_layer) for i in b.items]


def ids(b: Batch) -> list[str]:
    return [i.id for i in b.items]


def finished(ds: Decisions) -> list[str]:
    return [f.id for f in ds.finished]


def req(i: int, tokens: int = 10, *, deadline: float | None = None, kv: int = 100) -> Request:
    return Request(id=f"r{i}", tokens=tokens, arrival=float(i), kv_bytes=kv, deadline=deadline, ticket=f"t{i}")


def test_requests_wait_for_a_bubble_then_are_packed_into_it() -> None:
    s = state()
    assert not s.add_request(req(0), now=0.0) and not s.add_request(req(1), now=0.0)
    d = one(start(s, "w1", 0.033, now=1.0))
    # budget 33 - 2 guard - 1 overhead = 30 ms: both 10 ms requests whole
    assert d.worker == "w1" and d.address == "fill:w1" and ranges(d) == [("r0", 0, 4), ("r1", 0, 4)]
    assert all(s.requests[r].in_bubble == "w1" for r in ("r0", "r1"))
    assert d.items[0].payload is None and d.predicted_s == pytest.approx(0.020)


def test_every_batch_says_why() -> None:
    s = state()
    s.add_request(req(0), now=0.0)
    d = one(s.bubble_start(BubbleOpened("w1", "fill:w1", 0.033, 10**9, started=0.99, tag=(3, 7)), now=1.0))
    w = d.why
    assert w.trigger is Trigger.BUBBLE_START and w.bubble == (3, 7) and w.queued == 1
    # 33 ms predicted, 10 ms of it gone before the event arrived, 3 ms guard and overhead: 20 ms left
    assert w.predicted_bubble_s == 0.033 and w.budget_s == pytest.approx(0.020)
    assert w.predicted_s == pytest.approx(0.010)
    assert set(w.fields()) == {"trigger", "bubble", "bubble_ms", "budget_ms", "predicted_ms", "queued"}
    d2 = one(s.add_request(req(1), now=1.0))
    assert d2.why.trigger is Trigger.REQUEST and d2.batch_id != d.batch_id


def test_a_request_arriving_in_an_open_bubble_uses_what_is_left() -> None:
    s = state()
    start(s, "w1", 0.0335, now=0.0)
    d1 = one(s.add_request(req(0, 20), now=0.0))  # 20 of 30.5 ms
    assert ranges(d1) == [("r0", 0, 4)]
    d2 = one(s.add_request(req(1, 20), now=0.0))  # 10.5 ms left: two of its four 5 ms layers
    assert ranges(d2) == [("r1", 0, 2)]
    assert not s.add_request(req(2, 20), now=0.0).batches  # the bubble is full


def test_reports_complete_or_requeue_at_the_resume_point() -> None:
    s = state(stage_next=False)
    s.add_request(req(0, 100), now=0.0)  # 100 ms: longer than the bubbles below
    b1 = one(start(s, "w1", 0.053, now=0.0))  # 50 ms: 2 of 4 layers
    assert s.requests["r0"].in_bubble == "w1"
    s.bubble_end("w1", now=0.05)
    ds = s.report(b1.batch_id, "w1", [Progress("r0", reached_layer=2, seconds=0.050)], now=0.1)
    assert finished(ds) == [] and s.requests["r0"].next_layer == 2 and s.requests["r0"].in_bubble is None
    d = one(start(s, "w2", 0.054, now=0.2))  # another worker resumes it
    assert ranges(d) == [("r0", 2, 4)]
    ds = s.report(d.batch_id, "w2", [Progress("r0", reached_layer=4, seconds=0.050)], now=0.3)
    assert [(f.id, f.ticket) for f in ds.finished] == [("r0", "t0")] and s.requests == {}


def test_only_an_accepted_report_that_moves_a_resumed_request_on_spends_its_saved_state() -> None:
    s = state(stage_next=False)
    s.add_request(req(0, 100), now=0.0)
    b1 = one(start(s, "w1", 0.053, now=0.0))  # layers 0-2: nothing saved to resume from yet
    s.bubble_end("w1", now=0.05)
    assert not s.report(b1.batch_id, "w1", [Progress("r0", 2, 0.050)], now=0.1).spent
    # w2 resumes it from layer 2; w2 pauses past its report time and the batch is given up as lost
    b2 = one(start(s, "w2", 0.030, now=0.2))
    assert ranges(b2) == [("r0", 2, 3)]
    s.bubble_end("w2", now=0.23)
    assert s.tick(now=10.0).lost and s.requests["r0"].next_layer == 2
    b3 = one(start(s, "w3", 0.054, now=10.0))  # the replacement batch resumes from the same state
    assert ranges(b3) == [("r0", 2, 4)]
    # w2's stale run reports layer 3: ignored, so the state w3 resumes from is not spent
    assert not s.report(b2.batch_id, "w2", [Progress("r0", 3, 0.025)], now=10.01).spent
    # w3 hands it back unrun first (its bubble closed): nothing used up either
    s.bubble_end("w3", now=10.02)
    assert not s.report(b3.batch_id, "w3", [Progress("r0", 2, 0.0)], now=10.03).spent
    b4 = one(start(s, "w3", 0.054, now=11.0))
    ds = s.report(b4.batch_id, "w3", [Progress("r0", 4, 0.050)], now=11.1)
    assert finished(ds) == ["r0"] and [(x.id, x.layer) for x in ds.spent] == [("r0", 2)]


def test_a_request_the_worker_failed_is_finished_whatever_layer_it_reached() -> None:
    s = state(stage_next=False)
    s.add_request(req(0, 100), now=0.0)
    b = one(start(s, "w1", 0.053, now=0.0))
    ds = s.report(b.batch_id, "w1", [Progress("r0", reached_layer=0, seconds=0.0, finished=True)], now=0.1)
    assert finished(ds) == ["r0"] and s.requests == {} and s.counts.done == 1


def test_stale_and_duplicate_reports_change_nothing() -> None:
    s = state()
    s.add_request(req(0), now=0.0)
    b = one(start(s, "w1", 1.0, now=0.0))
    assert not s.report("nope", "w1", [Progress("r0", 4, 0.01)], now=0.1).finished  # not in flight
    assert finished(s.report(b.batch_id, "w1", [Progress("r0", 4, 0.01)], now=0.1)) == ["r0"]
    again = s.report(b.batch_id, "w1", [Progress("r0", 4, 0.01)], now=0.2)  # duplicate
    assert not again.finished and again.ignored[0].why == "not in flight"


def test_a_request_is_never_in_two_bubbles() -> None:
    s = state()
    s.add_request(req(0, 100), now=0.0)
    start(s, "w1", 0.053, now=0.0)
    assert not start(s, "w2", 1.0, now=0.0)
    assert s.add_request(req(0, 100), now=0.0).ignored  # redelivered: already known


def test_expired_requests_fail_with_their_reason_but_running_ones_finish() -> None:
    s = state()
    s.add_request(req(0, deadline=1.0), now=0.0)
    s.add_request(req(1, deadline=1.0, tokens=10**6), now=0.0)  # too long for any bubble here
    start(s, "w1", 0.033, now=0.5)
    assert s.requests["r0"].in_bubble == "w1"
    ds = s.tick(now=2.0)  # r0 is running: its worker's report decides
    (f,) = ds.failed
    assert (f.id, f.ticket, f.reason) == ("r1", "t1", FailureReason.DEADLINE)
    assert "deadline passed after 1.0s in the queue" in f.detail and s.counts.expired == 1


def test_a_batch_that_never_reports_back_is_requeued_and_its_worker_bubble_closed() -> None:
    s = state(stage_next=False)
    s.add_request(req(0, 10), now=0.0)
    b = one(start(s, "w1", 0.033, now=0.0))
    assert not s.tick(now=b.predicted_s + BATCH_GRACE_S - 0.001).lost  # still within its grace
    ds = s.tick(now=b.predicted_s + BATCH_GRACE_S + 0.5)
    (lost,) = ds.lost
    assert (lost.batch_id, lost.worker, lost.requests) == (b.batch_id, "w1", 1)
    assert lost.overdue_s == pytest.approx(0.5)
    assert "w1" not in s.bubbles and s.requests["r0"].in_bubble is None and s.counts.requeued == 1
    # a late report from the presumed-dead worker changes nothing; the next bubble elsewhere takes r0
    assert s.report(b.batch_id, "w1", [Progress("r0", 4, 0.01)], now=4.0).ignored
    assert ids(one(start(s, "w2", 0.033, now=4.0))) == ["r0"]


def test_a_lost_worker_loses_all_its_batches_at_once() -> None:
    s = state()
    for i in range(2):
        s.add_request(req(i, 10), now=0.0)
    first = one(start(s, "w1", 0.023, now=0.0))  # 20 ms: r0, r1
    s.bubble_end("w1", now=0.02)
    staged = one(s.add_request(req(3, 10), now=0.02))  # staged for w1's next bubble
    assert staged.hold and ids(first) == ["r0", "r1"]
    later = HOLD_STAGED_S + BATCH_GRACE_S + 1.0
    ds = s.tick(now=later)
    assert {lb.batch_id for lb in ds.lost} == {first.batch_id, staged.batch_id} and s.in_flight == {}
    assert all(r.in_bubble is None for r in s.requests.values()) and "w1" not in s.staged


def test_a_staged_batch_is_not_lost_while_its_worker_may_still_hold_it() -> None:
    """The lost-batch rule waits for the worker's hold time (`bubbletea.hold_ms`, stretched by the
    device time scale) on top of the grace: a slow device's next bubble comes later."""
    s = state(hold_s=5.0)
    s.add_request(req(0, 10), now=0.0)
    first = one(start(s, "w1", 0.013, now=0.0))  # 10 ms: r0, done within the bubble
    assert not s.report(first.batch_id, "w1", [Progress("r0", LAYERS, 0.01)], now=0.012).ignored
    s.bubble_end("w1", now=0.02)
    staged = one(s.add_request(req(1, 10), now=0.02))  # staged for w1's next bubble
    assert staged.hold
    end = 0.02 + staged.predicted_s + BATCH_GRACE_S
    assert not s.tick(now=end + 4.9).lost  # the worker may still hold it
    (lost,) = s.tick(now=end + 5.1).lost
    assert lost.batch_id == staged.batch_id and "w1" not in s.staged


def test_a_default_hold_is_the_specs() -> None:
    assert BubbleTea().hold_ms == HOLD_STAGED_S * 1000 == FillPolicy(guard_s=0.0).hold_s * 1000


def test_bubbles_are_ignored_when_stale_or_disabled() -> None:
    s = state()
    s.add_request(req(0), now=0.0)
    old = BubbleOpened("w1", "fill:w1", 1.0, 10**9, started=0.0)
    (ign,) = s.bubble_start(old, now=STALE_BUBBLE_S + 1).ignored
    assert "history" in ign.why and s.bubbles == {}
    off = state(enabled=False)
    off.add_request(req(0), now=0.0)
    assert (
        "disabled" in off.bubble_start(BubbleOpened("w1", "fill:w1", 1.0, 10**9, started=0.0), now=0.0).ignored[0].why
    )


def test_memory_and_batch_limits_hold_across_dispatches() -> None:
    s = state(max_batch=2)
    for i in range(5):
        s.add_request(req(i, tokens=1, kv=400), now=0.0)
    d = one(start(s, "w1", 1.0, now=0.0, free_memory=1000))
    assert len(d.items) == 2  # batch limit
    d2 = one(s.add_request(req(9, tokens=1, kv=150), now=0.0))  # 200 bytes left: only the small one fits
    assert ids(d2) == ["r9"]


def test_reports_teach_the_cost_model() -> None:
    s = state()
    before = s.cost.predict(100)
    for i in range(50):
        # the first request waits for the bubble; later ones go straight into it (it stays open)
        b = one(s.add_request(req(i, tokens=100), now=float(i)) + start(s, "w1", 10.0, now=float(i)))
        # finished, as a worker reports a request it answered: really 3x slower than predicted
        s.report(b.batch_id, "w1", [Progress(f"r{i}", 4, 0.3, finished=True)], now=float(i))
    assert s.cost.predict(100) == pytest.approx(0.3, rel=0.1) and s.cost.predict(100) > before


def test_a_report_gives_back_budget_so_an_early_finish_is_topped_up() -> None:
    s = state(stage_next=False)
    for i in range(4):
        s.add_request(req(i, 10), now=0.0)
    d1 = one(start(s, "w1", 0.033, now=0.0))  # 30 ms: r0..r2
    assert ids(d1) == ["r0", "r1", "r2"]
    assert not s.add_request(req(9, 10), now=0.0).batches  # nothing left in this bubble
    # r0..r2 finished in 6 ms instead of 30: the bubble has 33 - 3 - 6 = 24 ms left for the rest
    ds = s.report(d1.batch_id, "w1", [Progress(f"r{i}", 4, 0.002) for i in range(3)], now=0.006)
    d2 = one(ds)
    assert finished(ds) == ["r0", "r1", "r2"] and d2.worker == "w1" and not d2.hold
    assert ids(d2) == ["r3", "r9"] and d2.why.trigger is Trigger.REPORT


def test_the_next_bubble_is_staged_when_one_ends_and_counts_against_its_budget() -> None:
    s = state(stage_s=1.0)  # staging limited only by the worker's bubbles
    start(s, "w1", 0.023, now=0.0)  # nothing queued yet
    start(s, "w1", 0.033, now=0.1)  # recent: 23, 33 ms
    s.bubble_end("w1", now=0.15)
    staged = one(s.add_request(req(0, 10), now=0.2))
    for i in range(1, 5):
        assert not s.add_request(req(i, 10), now=0.2).batches
    # staged at once for w1's next bubble, sized by the median of its recent bubbles (33 ms)
    # minus guard and overhead: r0 went alone when it arrived, the others wait for the bubble
    assert staged.hold and ids(staged) == ["r0"] and staged.why.bubble is None
    assert s.staged["w1"][0] == pytest.approx(0.010)
    assert all(s.requests[f"r{i}"].in_bubble is None for i in range(1, 5))
    top = one(start(s, "w1", 0.033, now=0.3))
    # 33 - 3 = 30 ms budget, 10 ms of it staged already: two more
    assert not top.hold and ids(top) == ["r1", "r2"]
    assert "w1" not in s.staged


def test_a_staged_batch_returned_unrun_goes_back_to_the_queue() -> None:
    s = state()
    start(s, "w1", 0.033, now=0.0)
    s.bubble_end("w1", now=0.05)
    staged = one(s.add_request(req(0, 10), now=0.1))
    assert staged.hold
    ds = s.report(staged.batch_id, "w1", [Progress("r0", 0, 0.0)], now=0.2)  # the worker held it too long
    # free again, and staged anew on the worker (it had a bubble recently)
    again = one(ds)
    assert finished(ds) == [] and again.hold and s.requests["r0"].in_bubble == "w1"
    # a worker with no bubble for a while gets nothing staged: the request waits in the queue ...
    ds = s.report(again.batch_id, "w1", [Progress("r0", 0, 0.0)], now=5.0)
    assert not ds.batches and s.requests["r0"].in_bubble is None and "w1" not in s.staged


def test_staged_requests_past_their_deadline_expire() -> None:
    s = state()
    start(s, "w1", 0.033, now=0.0)
    s.bubble_end("w1", now=0.05)
    staged = one(s.add_request(req(0, 10, deadline=1.0), now=0.1))
    assert staged.hold
    assert [f.id for f in s.tick(now=2.0).failed] == ["r0"] and "w1" not in s.staged and s.requests == {}


def joined(s: DispatchState, worker: str, typical_s: float, *, now: float, free_memory: int = 10**9) -> Decisions:
    return s.worker_joined(WorkerReady(worker, f"fill:{worker}", typical_s, free_memory, at=now), now)


def test_a_worker_that_joins_gets_its_first_bubbles_batch_staged_before_that_bubble() -> None:
    """Requests taken while the workers set up are there when they join: the first bubble starts
    with a staged batch, sized for the typical bubble the worker announced."""
    s = state()
    for i in range(3):
        s.add_request(req(i, 10), now=0.0)
    d = one(joined(s, "w1", 0.0235, now=1.0))  # 23.5 ms typical: 20.5 ms of room after guard and overhead
    assert d.hold and d.address == "fill:w1" and ranges(d) == [("r0", 0, 4), ("r1", 0, 4)]
    assert d.why.trigger is Trigger.JOINED and d.why.predicted_bubble_s == 0.0235
    assert not joined(s, "w1", 0.023, now=1.1).batches  # staged once: a repeat sends nothing more
    # its first bubble counts the staged batch against its budget and tops up with the rest
    top = one(start(s, "w1", 0.043, now=1.2))
    assert not top.hold and ranges(top) == [("r2", 0, 4)]


def test_a_joining_worker_with_bubbles_on_record_is_staged_by_them() -> None:
    """A worker rejoining after a recovery keeps its measured bubbles; a bubble of its previous
    life that never ended is closed (a worker that joins is in no bubble)."""
    s = state()
    start(s, "w1", 0.0135, now=0.0)  # 10.5 ms of room, left open: its end never came
    for i in range(3):
        s.add_request(req(i, 10), now=1.0)  # nothing goes to the stale bubble: its time has passed
    assert "w1" in s.bubbles
    d = one(joined(s, "w1", 0.5, now=1.0))
    assert "w1" not in s.bubbles and d.hold and ranges(d) == [("r0", 0, 4)]  # sized by the 13.5 ms on record
    assert d.why.predicted_bubble_s == 0.0135


def test_a_joined_worker_is_staged_once_requests_come_and_history_is_ignored() -> None:
    s = state()
    assert not joined(s, "w1", 0.023, now=0.0).batches  # nothing waits yet
    assert one(s.add_request(req(0, 10), now=0.1)).hold  # the first request is staged there
    old = s.worker_joined(WorkerReady("w2", "fill:w2", 0.023, 10**9, at=0.0), now=STALE_BUBBLE_S + 1.0)
    assert not old.batches and "history" in old.ignored[0].why  # read from the backlog after a restart
    assert not state(enabled=False).worker_joined(WorkerReady("w1", "a", 0.02, 10**9, 0.0), 0.0).batches


def test_staging_is_small_so_idle_workers_do_not_hoard_requests() -> None:
    s = state(stage_s=0.006)
    start(s, "w1", 0.100, now=0.0)
    s.bubble_end("w1", now=0.05)
    staged = one(s.add_request(req(0, 4), now=0.1))  # 4 ms: fits the 6 ms staging allowance
    assert staged.hold and not s.add_request(req(1, 4), now=0.1).batches  # the next one waits for a bubble
    assert s.requests["r1"].in_bubble is None


def test_an_open_bubble_keeps_work_ahead_beyond_its_budget_when_asked() -> None:
    strict, ahead = state(stage_next=False), state(stage_next=False, ahead_s=0.0085)
    for s in (strict, ahead):
        for i in range(3):
            s.add_request(req(i, 4), now=0.0)
    # a 5.5 ms bubble: 2.5 ms of budget after guard and overhead
    d = one(start(strict, "w1", 0.0055, now=0.0))
    assert [(i.id, i.to_layer) for i in d.items] == [("r0", 2)]  # two of four 1 ms layers
    d = one(start(ahead, "w1", 0.0055, now=0.0))
    assert [(i.id, i.to_layer) for i in d.items] == [("r0", 4), ("r1", 4)]  # 8 ms outstanding
    # r0 reported done: 4 ms freed, r2 goes out to keep 8 ms ahead (the bubble outlived its budget)
    ds = ahead.report(d.batch_id, "w1", [Progress("r0", 4, 0.004)], now=0.010)
    d2 = one(ds)
    assert finished(ds) == ["r0"] and ids(d2) == ["r2"]


def test_the_dispatchers_waiting_count_stays_exact() -> None:
    """`DispatchState` keeps a count of waiting requests to skip work at scale; random traffic
    (requests, bubbles, reports, ticks, lost batches, fail_waiting) must never make it drift."""
    rnd = random.Random(7)
    st = DispatchState(layers=4, guard_s=0.001, overhead_s=0.0005, max_batch=4)
    batches: dict[str, Batch] = {}
    now, n = 0.0, 0
    for _ in range(3000):
        now += rnd.random() * 0.01
        op = rnd.random()
        if op < 0.35:
            n += 1
            ds = st.add_request(Request(f"q{n}", rnd.randint(8, 200), now, 1000, deadline=now + rnd.random()), now)
        elif op < 0.55:
            w = f"w{rnd.randint(0, 5)}"
            ds = st.bubble_start(BubbleOpened(w, w, rnd.random() * 0.05, 10**9, now), now)
        elif op < 0.7:
            ds = st.bubble_end(f"w{rnd.randint(0, 5)}", now=now)
        elif op < 0.9 and batches:
            b = batches.pop(rnd.choice(sorted(batches)))
            progress = [Progress(i.id, rnd.randint(i.from_layer, i.to_layer), 0.001) for i in b.items]
            ds = st.report(b.batch_id, b.worker, progress, now)
        elif op < 0.98:
            ds = st.tick(now + rnd.random() * 5)
        else:
            ds = st.fail_waiting("test", now)
        batches.update({b.batch_id: b for b in ds.batches})
        assert st._waiting == sum(r.in_bubble is None for r in st.requests.values())


class FullScan(DispatchState):
    """The dispatcher without its indexes, as the reference: every trigger visits every open bubble
    (by start, ties in the order they opened) and every worker with recent bubbles (by name), and
    packing sorts the whole queue (`pack`). No shortcut: nothing waiting just packs nothing."""

    def _fill_all(self, now: float, trigger: Trigger) -> Decisions:
        out = Decisions()
        for worker in sorted(self.bubbles, key=lambda w: self.bubbles[w].started):
            out += self._fill(worker, now, trigger)
        for worker in sorted(self.recent):
            out += self._stage(worker, now, trigger)
        return out

    def _pack(self, left: float, free_memory: int, now: float) -> tuple[tuple[Assignment, ...], int]:
        waiting = [
            Candidate(r.id, r.tokens, r.next_layer, r.arrival, r.kv_bytes, r.deadline)
            for r in self.requests.values()
            if r.in_bubble is None
        ]
        if left <= 0 or not waiting:
            return (), len(waiting)
        plan = pack(
            waiting,
            budget_s=left,
            free_memory=free_memory,
            layers=self.layers,
            cost=layered_cost(self.cost.predict, self.layers),
            now=now,
            max_requests=self.max_batch,
            order=self.order,
        )
        return plan.assignments, len(waiting)


def snapshot(s: DispatchState) -> object:
    return (
        [(r.id, r.next_layer, r.in_bubble, r.assigned_s) for r in s.requests.values()],
        [(w, b.started, b.sent_s, b.sent_bytes, b.tag) for w, b in s.bubbles.items()],
        s.staged,
        {w: list(d) for w, d in s.recent.items()},
        s.in_flight,
        s.counts,
        s._waiting,
    )


@pytest.mark.parametrize(
    ("seed", "kw"),
    [
        (1, {}),
        (2, {"order": "arrival", "max_batch": 3}),
        (3, {"ahead_s": 0.004, "stage_s": 0.01}),
        (4, {"stage_next": False}),
    ],
)
def test_the_indexed_dispatcher_decides_exactly_as_a_full_scan(seed: int, kw: dict[str, object]) -> None:
    """The indexes (open bubbles with room, idle workers, the queue in packing order) change the
    cost only: a long random input sequence gives identical decisions, step by step, to a full scan."""
    rnd = random.Random(seed)
    args: dict[str, object] = {"layers": 4, "guard_s": 0.001, "overhead_s": 0.0005, "max_batch": 6, **kw}
    fast, full = DispatchState(**args), FullScan(**args)  # type: ignore[arg-type]
    workers = [f"w{i}" for i in range(12)]  # "w10" sorts before "w2", as names do
    out: dict[str, Batch] = {}  # batches in flight, as the reference sent them
    tags: dict[str, int] = {}
    now, n, skipped = 0.0, 0, set()
    for _ in range(1500):
        now += rnd.choice((0.0, 0.0, 0.0005, 0.002, 0.006)) * rnd.random() if rnd.random() < 0.5 else 0.0
        op = rnd.random()
        if op < 0.3:
            n += 1 if rnd.random() < 0.95 else 0  # now and then a redelivered request
            deadline = None if rnd.random() < 0.2 else now + rnd.uniform(0.01, 0.5)
            arrival = now - rnd.choice((0.0, 0.0, 0.01))
            tokens, kv = rnd.choice((4, 10, 40, 200)), rnd.choice((100, 1000, 5000))

            def request(n: int = n, t: int = tokens, a: float = arrival, k: int = kv, d: float | None = deadline):
                return Request(f"q{n}", t, a, k, deadline=d, ticket=f"t{n}")

            step = "add_request", (request(),), (request(),), now
        elif op < 0.5:
            w = rnd.choice(workers)
            tags[w] = tags.get(w, 0) + 1
            started = now - rnd.choice((0.0, 0.0, 0.001, STALE_BUBBLE_S + 0.5))  # ties, and history
            opened = BubbleOpened(w, f"a:{w}", rnd.uniform(0.0, 0.04), rnd.choice((10**9, 6000)), started, tags[w])
            step = "bubble_start", (opened,), (opened,), now
        elif op < 0.62:
            w = rnd.choice(workers)
            tag = rnd.choice((tags.get(w), None, -1))
            step = "bubble_end", (w, tag), (w, tag), now
        elif op < 0.65:
            w = rnd.choice(workers)
            at = now - rnd.choice((0.0, 0.0, STALE_BUBBLE_S + 0.5))  # and history
            ready = WorkerReady(w, f"a:{w}", rnd.uniform(0.0, 0.04), rnd.choice((10**9, 6000)), at)
            step = "worker_joined", (ready,), (ready,), now
        elif op < 0.88 and out:
            b = out.pop(rnd.choice(sorted(out)))
            progress = []
            for i in b.items:
                reached = rnd.randint(i.from_layer, i.to_layer)
                progress.append(Progress(i.id, reached, i.seconds * rnd.uniform(0.5, 2.0), rnd.random() < 0.03))
            if rnd.random() < 0.05:
                out[b.batch_id] = b  # reported twice
            step = "report", (b.batch_id, b.worker, progress), (b.batch_id, b.worker, progress), now
        elif op < 0.997:
            at = now + (rnd.uniform(3.0, 6.0) if rnd.random() < 0.05 else 0.0)  # lost batches; then time goes back
            step = "tick", (), (), at
        else:
            step = "fail_waiting", ("test",), ("test",), now
        name, a_fast, a_full, at = step
        if name == "bubble_end":
            got, want = fast.bubble_end(*a_fast, now=at), full.bubble_end(*a_full, now=at)  # type: ignore[arg-type]
        else:
            got, want = getattr(fast, name)(*a_fast, at), getattr(full, name)(*a_full, at)
        assert got == want, name
        assert snapshot(fast) == snapshot(full)
        out.update({b.batch_id: b for b in want.batches})
        for lb in want.lost:
            out.pop(lb.batch_id, None)
        if len(fast._room._visit) < len(fast.bubbles):
            skipped.add("bubbles")
        if fast._room._aside:
            skipped.add("blocked")
        if len(fast._idle) < len(fast.recent):
            skipped.add("workers")
    assert fast.counts.batches > 200 and fast.counts.done > 30  # it did dispatch
    assert skipped >= {"bubbles", "blocked"} | ({"workers"} if fast.stage_next else set())  # the indexes skipped some
