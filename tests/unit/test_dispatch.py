"""The dispatcher's pure state machine: bubbles, queue, reports, expiry."""

import pytest

from shared.policies.dispatch import Dispatch, DispatchState, Progress, Request
from shared.policies.prefill_cost import PrefillCostModel

LAYERS = 4


def state(**kw: object) -> DispatchState:
    # a cost model that has learned 1 ms per token (whole prompt), with no safety margin left
    cost = PrefillCostModel(prior=[(10, 0.010), (100, 0.100), (1000, 1.0)])
    cost._rel_err = 0.0
    args = {"layers": LAYERS, "guard_s": 0.002, "overhead_s": 0.001, "max_batch": 8, "cost": cost}
    args.update(kw)
    return DispatchState(**args)  # type: ignore[arg-type]


def one(ds: list[Dispatch]) -> Dispatch:
    """The one batch of a fill."""
    assert ds and len({d.worker for d in ds}) == 1 and len({d.hold for d in ds}) == 1, ds
    return Dispatch(ds[0].worker, tuple(a for d in ds for a in d.assignments), ds[0].hold)


def req(i: int, tokens: int = 10, *, deadline: float | None = None, kv: int = 100) -> Request:
    return Request(id=f"r{i}", tokens=tokens, arrival=float(i), kv_bytes=kv, deadline=deadline)


def test_requests_wait_for_a_bubble_then_are_packed_into_it() -> None:
    s = state()
    assert s.add_request(req(0), now=0.0) == [] and s.add_request(req(1), now=0.0) == []
    d = one(s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=1.0))
    # budget 33 - 2 guard - 1 overhead = 30 ms: both 10 ms requests whole
    assert d.worker == "w1" and [(a.id, a.from_layer, a.to_layer) for a in d.assignments] == [
        ("r0", 0, 4),
        ("r1", 0, 4),
    ]
    assert all(s.requests[r].in_bubble == "w1" for r in ("r0", "r1"))


def test_a_request_arriving_in_an_open_bubble_uses_what_is_left() -> None:
    s = state()
    s.bubble_start("w1", predicted_s=0.0335, free_memory=10**9, now=0.0)
    d1 = one(s.add_request(req(0, 20), now=0.0))  # 20 of 30.5 ms
    assert [(a.id, a.to_layer) for a in d1.assignments] == [("r0", 4)]
    d2 = one(s.add_request(req(1, 20), now=0.0))  # 10.5 ms left: two of its four 5 ms layers
    assert [(a.id, a.from_layer, a.to_layer) for a in d2.assignments] == [("r1", 0, 2)]
    assert s.add_request(req(2, 20), now=0.0) == []  # the bubble is full


def test_reports_complete_or_requeue_at_the_resume_point() -> None:
    s = state(stage_next=False)
    s.add_request(req(0, 100), now=0.0)  # 100 ms: longer than the bubbles below
    s.bubble_start("w1", predicted_s=0.053, free_memory=10**9, now=0.0)  # 50 ms: 2 of 4 layers
    assert s.requests["r0"].in_bubble == "w1"
    s.bubble_end("w1")
    done, _ = s.report("w1", [Progress("r0", reached_layer=2, seconds=0.050)], now=0.1)
    assert done == [] and s.requests["r0"].next_layer == 2 and s.requests["r0"].in_bubble is None
    d = one(s.bubble_start("w2", predicted_s=0.054, free_memory=10**9, now=0.2))  # another worker resumes it
    assert [(a.id, a.from_layer, a.to_layer) for a in d.assignments] == [("r0", 2, 4)]
    done, _ = s.report("w2", [Progress("r0", reached_layer=4, seconds=0.050)], now=0.3)
    assert done == ["r0"] and s.requests == {}


def test_stale_and_duplicate_reports_change_nothing() -> None:
    s = state()
    s.add_request(req(0), now=0.0)
    s.bubble_start("w1", predicted_s=1.0, free_memory=10**9, now=0.0)
    assert s.report("w9", [Progress("r0", 4, 0.01)], now=0.1) == ([], [])  # not its worker
    assert s.report("w1", [Progress("r0", 4, 0.01)], now=0.1)[0] == ["r0"]
    assert s.report("w1", [Progress("r0", 4, 0.01)], now=0.2) == ([], [])  # duplicate


def test_a_request_is_never_in_two_bubbles() -> None:
    s = state()
    s.add_request(req(0, 100), now=0.0)
    s.bubble_start("w1", predicted_s=0.053, free_memory=10**9, now=0.0)
    assert s.bubble_start("w2", predicted_s=1.0, free_memory=10**9, now=0.0) == []


def test_expiry_spares_running_requests_and_lost_workers_requeue() -> None:
    s = state()
    s.add_request(req(0, deadline=1.0), now=0.0)
    s.add_request(req(1, deadline=1.0, tokens=10**6), now=0.0)  # too long for any bubble here
    s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=0.5)
    assert s.requests["r0"].in_bubble == "w1"
    assert s.expire(now=2.0) == ["r1"]  # r0 is running: its worker's report decides
    s.worker_lost("w1")
    assert s.requests["r0"].in_bubble is None and "w1" not in s.bubbles


def test_memory_and_batch_limits_hold_across_dispatches() -> None:
    s = state(max_batch=2)
    for i in range(5):
        s.add_request(req(i, tokens=1, kv=400), now=0.0)
    d = one(s.bubble_start("w1", predicted_s=1.0, free_memory=1000, now=0.0))
    assert len(d.assignments) == 2  # batch limit
    d2 = one(s.add_request(req(9, tokens=1, kv=150), now=0.0))  # 200 bytes left: only the small one fits
    assert [a.id for a in d2.assignments] == ["r9"]


def test_reports_teach_the_cost_model() -> None:
    s = state()
    before = s.cost.predict(100)
    for i in range(50):
        s.add_request(req(i, tokens=100), now=float(i))
        s.bubble_start("w1", predicted_s=10.0, free_memory=10**9, now=float(i))
        s.report("w1", [Progress(f"r{i}", 4, 0.3)], now=float(i))  # really 3x slower than predicted
    assert s.cost.predict(100) == pytest.approx(0.3, rel=0.1) and s.cost.predict(100) > before


def test_a_report_gives_back_budget_so_an_early_finish_is_topped_up() -> None:
    s = state(stage_next=False)
    for i in range(4):
        s.add_request(req(i, 10), now=0.0)
    d1 = one(s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=0.0))  # 30 ms: r0..r2
    assert [a.id for a in d1.assignments] == ["r0", "r1", "r2"]
    assert s.add_request(req(9, 10), now=0.0) == []  # nothing left in this bubble
    # r0..r2 finished in 6 ms instead of 30: the bubble has 33 - 3 - 6 = 24 ms left for the rest
    done, ds = s.report("w1", [Progress(f"r{i}", 4, 0.002) for i in range(3)], now=0.006)
    d2 = one(ds)
    assert done == ["r0", "r1", "r2"] and d2.worker == "w1" and not d2.hold
    assert [a.id for a in d2.assignments] == ["r3", "r9"]


def test_the_next_bubble_is_staged_when_one_ends_and_counts_against_its_budget() -> None:
    s = state(stage_s=1.0)  # staging limited only by the worker's bubbles
    s.bubble_start("w1", predicted_s=0.023, free_memory=10**9, now=0.0)  # nothing queued yet
    s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=0.1)  # recent: 23, 33 ms
    s.bubble_end("w1", now=0.15)
    (staged,) = s.add_request(req(0, 10), now=0.2)
    for i in range(1, 5):
        assert s.add_request(req(i, 10), now=0.2) == []
    # staged at once for w1's next bubble, sized by the median of its recent bubbles (33 ms)
    # minus guard and overhead: r0 went alone when it arrived, the others wait for the bubble
    assert staged is not None and staged.hold and [a.id for a in staged.assignments] == ["r0"]
    assert s.staged["w1"][0] == pytest.approx(0.010)
    assert all(s.requests[f"r{i}"].in_bubble is None for i in range(1, 5))
    top = one(s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=0.3))
    # 33 - 3 = 30 ms budget, 10 ms of it staged already: two more
    assert not top.hold and [a.id for a in top.assignments] == ["r1", "r2"]
    assert "w1" not in s.staged


def test_a_staged_batch_returned_unrun_goes_back_to_the_queue() -> None:
    s = state()
    s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=0.0)
    s.bubble_end("w1", now=0.05)
    (staged,) = s.add_request(req(0, 10), now=0.1)
    assert staged.hold
    done, again = s.report("w1", [Progress("r0", 0, 0.0)], now=0.2)  # the worker held it too long
    # free again, and staged anew on the worker (it had a bubble recently)
    assert done == [] and again[0].hold and s.requests["r0"].in_bubble == "w1"
    # a worker with no bubble for a while gets nothing staged: the request waits in the queue ...
    done, again = s.report("w1", [Progress("r0", 0, 0.0)], now=5.0)
    assert again == [] and s.requests["r0"].in_bubble is None and "w1" not in s.staged


def test_staged_requests_past_their_deadline_expire() -> None:
    s = state()
    s.bubble_start("w1", predicted_s=0.033, free_memory=10**9, now=0.0)
    s.bubble_end("w1", now=0.05)
    (staged,) = s.add_request(req(0, 10, deadline=1.0), now=0.1)
    assert staged.hold
    assert s.expire(now=2.0) == ["r0"] and "w1" not in s.staged and s.requests == {}


def test_staging_is_small_so_idle_workers_do_not_hoard_requests() -> None:
    s = state(stage_s=0.006)
    s.bubble_start("w1", predicted_s=0.100, free_memory=10**9, now=0.0)
    s.bubble_end("w1", now=0.05)
    (staged,) = s.add_request(req(0, 4), now=0.1)  # 4 ms: fits the 6 ms staging allowance
    assert staged.hold and s.add_request(req(1, 4), now=0.1) == []  # the next one waits for a bubble
    assert s.requests["r1"].in_bubble is None


def test_an_open_bubble_keeps_work_ahead_beyond_its_budget_when_asked() -> None:
    strict, ahead = state(stage_next=False), state(stage_next=False, ahead_s=0.0085)
    for s in (strict, ahead):
        for i in range(3):
            s.add_request(req(i, 4), now=0.0)
    # a 5.5 ms bubble: 2.5 ms of budget after guard and overhead
    d = one(strict.bubble_start("w1", predicted_s=0.0055, free_memory=10**9, now=0.0))
    assert [(a.id, a.to_layer) for a in d.assignments] == [("r0", 2)]  # two of four 1 ms layers
    d = one(ahead.bubble_start("w1", predicted_s=0.0055, free_memory=10**9, now=0.0))
    assert [(a.id, a.to_layer) for a in d.assignments] == [("r0", 4), ("r1", 4)]  # 8 ms outstanding
    # r0 reported done: 4 ms freed, r2 goes out to keep 8 ms ahead (the bubble outlived its budget)
    done, ds = ahead.report("w1", [Progress("r0", 4, 0.004)], now=0.010)
    d2 = one(ds)
    assert done == ["r0"] and [a.id for a in d2.assignments] == ["r2"]
