"""A dispatcher taking over a run (`DispatchState.adopt`): the batches its predecessor sent that the
workers still hold are counted, in credit and in flight, and their requests, delivered to it again,
are not sent a second time. A fake clock drives it; nothing needs Redis."""

import pytest

from shared.policies.admission import MAX_CORRECTION, Admission
from shared.policies.dc_routing import DcSnapshot
from shared.policies.dispatch_inputs import BATCH_GRACE_S, Adopted, Progress, Request
from shared.policies.fill import HOLD_STAGED_S
from shared.wire.status import FailureReason
from tests.unit.test_dispatch import LAYERS, finished, ids, join, one, req, start, state

#: a batch "old-1" the previous dispatcher sent to w0: r1 from its start, r2 resumed at layer 2
HELD = Adopted("old-1", "w0", "fill:w0", (("r1", 0, 0.010), ("r2", 2, 0.005)), kv_bytes=200)


def test_a_request_of_an_adopted_batch_is_not_sent_again_and_its_report_finishes_it() -> None:
    s = state()
    assert s.adopt(HELD, now=0.0).batches == ()
    join(s, "w1", 1.0, now=0.0)  # another worker, with room
    ds = s.add_requests([req(1), req(2), req(3)], now=0.1)  # delivered again to the new dispatcher
    assert ids(one(ds)) == ["r3"]  # r1 and r2 are on w0 already: only r3 goes out
    assert s.requests["r1"].on_worker == "w0" and s.requests["r2"].next_layer == 2
    done = s.report("old-1", "w0", [Progress("r1", LAYERS, 0.01, True), Progress("r2", LAYERS, 0.01, True)], 0.2)
    assert finished(done) == ["r1", "r2"]
    assert [f.ticket for f in done.finished] == ["t1", "t2"]  # the entries held here are acked
    assert "old-1" not in s.in_flight and not s.workers["w0"].held


def test_an_adopted_batch_holds_its_workers_credit_until_it_reports() -> None:
    s = state()
    s.adopt(Adopted("old-1", "w0", "fill:w0", (("r1", 0, 0.03),), kv_bytes=200), now=0.0)
    assert s.workers["w0"].held_s == 0.03 and s.workers["w0"].held_bytes == 200
    start(s, "w0", 0.02, now=0.1)  # its bubble: a window of 0.02 s, all of it held
    assert s.add_requests([req(5)], now=0.1).batches == ()
    ds = s.report("old-1", "w0", [Progress("r1", LAYERS, 0.03, True)], 0.2)
    assert ids(one(ds)) == ["r5"]


def test_a_request_whose_adopted_batch_reported_before_it_came_back_is_queued() -> None:
    s = state()
    s.adopt(HELD, now=0.0)
    s.report("old-1", "w0", [Progress("r1", 1, 0.01, False)], 0.1)  # handed back at layer 1
    join(s, "w1", 1.0, now=0.1)
    assert sorted(ids(one(s.add_requests([req(1)], now=0.2)))) == ["r1"]  # its own report came first: queued


def test_the_requests_of_an_adopted_batch_that_never_reports_queue_again() -> None:
    s = state()
    s.adopt(HELD, now=0.0)
    s.add_requests([req(1)], now=0.0)  # came back: held on w0
    later = HOLD_STAGED_S + 1.0 + BATCH_GRACE_S  # past when it could last have reported
    lost = s.tick(later)  # w0 never heard from: its batch is lost
    assert [b.batch_id for b in lost.lost] == ["old-1"]
    assert s.requests["r1"].on_worker is None
    assert ids(one(join(s, "w1", 1.0, now=later))) == ["r1"]  # sent once more, to a worker that lives
    assert ids(one(s.add_requests([req(2)], now=later))) == ["r2"]  # came back after the loss: sent too


def test_a_batch_adopted_twice_counts_once() -> None:
    s = state()
    s.adopt(HELD, now=0.0)
    assert s.adopt(HELD, now=0.0).ignored
    assert s.workers["w0"].held_s == 0.015


def test_a_request_its_predecessor_held_queued_is_not_judged_again_before_the_pipeline_came_round() -> None:
    """A dispatcher taking over measures the bubbles' rate afresh: until the pipeline has come round
    once it refuses (429) a request with an objective arriving. One its predecessor admitted and
    held, delivered to it again still queued (`admitted`), is not judged again: it goes to a worker
    with room at once (before: refused, though accepted, and the new leader sent no batch until the
    pipeline came round, 1.3-1.8 s after taking over; bench/faults.py dispatcher-kill, 2026-12-06)."""
    s = state()
    start(s, "w0", 0.05, now=10.0, tag=(7, 1))  # a bubble opens as it takes over: room, no rate yet
    assert not s.came_round(10.0)
    fresh = Request("new", 10, 10.0, 100, deadline=70.0, objective=10.5, ticket="t-new", payload=None)
    held = Request("held", 10, 9.5, 100, deadline=69.5, objective=10.5, ticket="t-held", payload=None, admitted=True)
    ds = s.add_requests([held, fresh], now=10.0)
    assert [(f.id, f.reason) for f in ds.failed] == [("new", FailureReason.OVERLOADED)]
    assert ids(one(ds)) == ["held"] and s.requests["held"].on_worker == "w0"


def test_a_new_leader_that_took_over_its_predecessors_measurement_admits_before_the_pipeline_came_round() -> None:
    """A leader in another process starts from the rate its predecessor published (`carry_admission`
    of its `DcSnapshot`): a request with an objective arriving before this one's pipeline came round
    is judged on that rate and sent (before: refused, 429, for about an iteration after each
    takeover; bench/faults.py dispatcher-kill, 2026-12-06). A published snapshot without a rate
    changes nothing."""
    s = state()
    start(s, "w0", 0.05, now=10.0, tag=(7, 1))
    s.carry_admission(DcSnapshot("", True, 0.0, None, 9.9))  # nothing measured: nothing taken over
    assert not s.came_round(10.0)
    s.carry_admission(DcSnapshot("", True, 0.0, 0.5, 9.9, correction=1.2))
    assert s.came_round(10.0) and s._admission.rate(10.0) == 0.5 and s._admission.correction() == 1.2
    fresh = Request("new", 10, 10.0, 100, deadline=70.0, objective=10.5, ticket="t-new", payload=None)
    ds = s.add_requests([fresh], now=10.0)
    assert not ds.failed and ids(one(ds)) == ["new"]


def test_a_taken_over_rate_stands_until_the_leaders_own_first_round_is_measured() -> None:
    """The predecessor's rate is used until every worker came round once under this leader; then
    its own (a pipeline that changed in between is measured again within an iteration)."""
    a = Admission(window_s=1e9)
    a.seed(0.9, 3.0)
    assert a.rate(0.0) == 0.9 and a.correction() == MAX_CORRECTION  # a correction is capped as its own
    for i in range(3):
        a.bubble(i * 0.1, 0.02, "w0", (i, 1))
        assert a.rate(i * 0.1) == (0.9 if i < 1 else pytest.approx(0.2))


def test_a_taken_over_measurement_says_training_runs_before_this_leader_sees_a_bubble() -> None:
    """A new leader that took its predecessor's measurement over is ready at once; a request with an
    objective arriving before its first bubble is queued on that measurement, not refused as if
    training had not started (`up`'s restarted dispatcher refused one so, in a test)."""
    s = state()
    s.carry_admission(DcSnapshot("", True, 0.0, 0.5, 9.9))
    fresh = Request("new", 10, 10.0, 100, deadline=70.0, objective=40.0, ticket="t-new", payload=None)
    assert not s.add_requests([fresh], now=10.0).failed
    assert s.requests["new"].on_worker is None  # queued for the next bubble
